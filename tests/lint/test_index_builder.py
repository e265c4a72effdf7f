"""The scan index is read from source: how names resolve without importing anything.

``tests/lint/test_patterns.py`` checks the index built from the installed transformers against
the imported library; these tests pin each resolution rule on small source trees, where
a wrong rule shows as one wrong name.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from pytest_modelpatch.lint.index_builder import Builder
from pytest_modelpatch.lint.scan_index import CORE, ScanIndex
from pytest_modelpatch.lint.source_scan import SourceFile

# A site-packages folder: a miniature torch and transformers with one family.
TREE = {
    "torch/__init__.py": "",
    "torch/nn/__init__.py": "from torch.nn.modules import *\nfrom torch.nn import functional as functional\n",
    "torch/nn/functional.py": "def relu(x):\n    return x\n",
    "torch/nn/modules/__init__.py": (
        "from .module import Module\nfrom .linear import Linear, _Hidden\n__all__ = ['Module', 'Linear']\n"
    ),
    "torch/nn/modules/module.py": "class Module:\n    pass\n",
    "torch/nn/modules/linear.py": (
        "from .module import Module\nclass Linear(Module):\n    pass\nclass _Hidden(Module):\n    pass\n"
    ),
    "transformers/__init__.py": "from . import utils\n",
    "transformers/utils/__init__.py": "from .generic import ModelOutput\nfrom .import_utils import is_torch_available\n",
    "transformers/utils/import_utils.py": "def is_torch_available():\n    return True\n",
    "transformers/utils/generic.py": "class ModelOutput(dict):\n    pass\n",
    "transformers/configuration_utils.py": "class PreTrainedConfig:\n    pass\n",
    "transformers/modeling_utils.py": "from torch import nn\nclass PreTrainedModel(nn.Module):\n    pass\n",
    "transformers/generation/__init__.py": "_import_structure = {}\nsys.modules[__name__] = _LazyModule(__name__)\n",
    "transformers/generation/utils.py": "class GenerationMixin:\n    pass\n",
    "transformers/renamed.py": '__name__ = "transformers.public"\nclass Shown:\n    pass\n',
    "transformers/models/__init__.py": "",
    "transformers/models/fam/__init__.py": "sys.modules[__name__] = _LazyModule(__name__)\n",
    "transformers/models/fam/configuration_fam.py": (
        "from ...configuration_utils import PreTrainedConfig\n"
        "class FamConfig(PreTrainedConfig):\n    model_type = 'fam'\n"
    ),
}

FAMILY = """
from _io import TextIOWrapper
from torch import nn
from ...generation import GenerationMixin
from ...modeling_utils import PreTrainedModel
from ...renamed import Shown
from ...utils import ModelOutput, is_torch_available
from .configuration_fam import FamConfig

if is_torch_available():
    from torch.nn import Linear as Proj
else:
    class Proj:
        pass

if is_definitely_not_a_package_available():
    from torch.nn import Linear as Missing
else:
    class Missing(nn.Module):
        pass

try:
    import definitely_not_a_package
    class Optional(nn.Module):
        pass
except ImportError:
    Optional = None

class FamOutput(ModelOutput):
    pass

class FamMLP(nn.Module):
    def __init__(self, config):
        self.up = Proj(4, 4)
        self.helper = self.build()

    def build(self):
        return nn.Linear(4, 4)

MIXERS = {"mlp": FamMLP}

class FamLayer(nn.Module):
    def __init__(self, config):
        self.mixer = MIXERS["mlp"](config)

class FamModel(PreTrainedModel, GenerationMixin):
    def __init__(self, config):
        self.layers = nn.ModuleList([FamLayer(config)])
"""


Built = tuple[Builder, ScanIndex, dict[str, tuple[str, str, bool, str]]]


@pytest.fixture
def built(tmp_path: Path) -> Built:
    """The miniature tree built; the family module's bound classes as (module, name, is_module, kind)."""
    for name, text in {**TREE, "transformers/models/fam/modeling_fam.py": FAMILY}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    builder = Builder(tmp_path / "transformers", [str(tmp_path)])
    index = builder.build("0.0")
    names = index.modules["transformers.models.fam.modeling_fam"][1]
    table = {}
    for attr, i in names.items():
        entry = index.classes[i]
        table[attr] = (entry.module, entry.name, entry.is_module, entry.kind)
    return builder, index, table


def test_names_resolve_through_packages_star_imports_and_all(built: Built) -> None:
    _, _, names = built
    assert names["Proj"] == ("torch.nn.modules.linear", "Linear", True, "module")
    assert names["PreTrainedModel"][2:] == (True, "module")  # through `from torch import nn`
    assert names["FamConfig"] == ("transformers.models.fam.configuration_fam", "FamConfig", False, "config")
    assert names["FamOutput"][2:] == (False, "output")


def test_a_lazy_package_name_is_found_in_the_submodule_defining_it(built: Built) -> None:
    _, _, names = built
    assert names["GenerationMixin"] == ("transformers.generation.utils", "GenerationMixin", False, "class")


def test_availability_checks_take_the_arm_that_runs_here(built: Built) -> None:
    _, _, names = built
    # is_torch_available: unknown package name "torch" is installed in this tree -> body
    assert names["Proj"][0] == "torch.nn.modules.linear"
    # a package that is not installed -> the else arm's class
    assert names["Missing"] == ("transformers.models.fam.modeling_fam", "Missing", True, "module")
    # `try: import absent` fails at import -> its handler runs and the body's class is not bound
    assert "Optional" not in names


def test_a_module_that_renames_itself_names_its_classes_so(built: Built) -> None:
    _, _, names = built
    assert names["Shown"][:2] == ("transformers.public", "Shown")


def test_compiled_classes_are_listed_by_import_and_never_modules(built: Built) -> None:
    _, _, names = built
    assert names["TextIOWrapper"] == ("_io", "TextIOWrapper", False, "class")  # no source at all


def test_children_follow_init_methods_and_dicts_of_classes(built: Built) -> None:
    builder, _, _ = built
    key = "transformers.models.fam.modeling_fam:{}".format
    assert ("Proj", "torch.nn.modules.linear:Linear") in builder.children(key("FamMLP"))
    assert ("nn", "torch.nn.modules.linear:Linear") not in builder.children(key("FamMLP"))  # an attribute
    assert ("MIXERS", key("FamMLP")) in builder.children(key("FamLayer"))  # a class held in a dict
    assert ("FamLayer", key("FamLayer")) in builder.children(key("FamModel"))


def test_core_modules_are_those_importing_the_families_loads(built: Built) -> None:
    _, index, _ = built
    core = {name for name, (family, _) in index.modules.items() if family == CORE}
    assert {"transformers.modeling_utils", "transformers.utils.generic", "transformers.renamed"} <= core
    assert "transformers.generation" not in core  # a lazy package binds nothing itself
    assert "transformers.generation.utils" in core  # ...but the submodule it found is loaded


@pytest.mark.parametrize(
    ("test", "installed", "expected"),
    [
        ("is_torch_available()", {"torch"}, True),
        ("is_torch_available()", set(), False),
        ("not is_vision_available()", {"PIL"}, False),  # vision is PIL
        ("is_torch_available() and is_vision_available()", {"torch"}, False),
        ("is_torch_available() or is_vision_available()", {"torch"}, True),
        ("is_torch_available() and version_ok()", {"torch"}, None),
        ("is_torch_available() and version_ok()", set(), False),
        ("TYPE_CHECKING", {"torch"}, False),
        ("sys.version_info >= (3, 12)", {"torch"}, None),
    ],
)
def test_if_tests_made_of_availability_checks_are_decided(
    test: str, installed: set[str], expected: bool | None
) -> None:
    scanned = SourceFile.read("x = 1\n", installed=lambda name: name in installed)
    node = ast.parse(test, mode="eval").body
    assert scanned.truth(node) is expected


def test_top_level_packages_are_found_through_the_import_systems_finders(tmp_path: Path, monkeypatch) -> None:
    """An editable install is found by a finder on sys.meta_path, not on sys.path."""
    import importlib.util
    import sys

    from pytest_modelpatch.lint.name_resolver import ModuleFinder

    package = tmp_path / "src" / "editable_demo_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .core import Thing\n")
    (package / "core.py").write_text("class Thing:\n    pass\n")

    class EditableFinder:  # what setuptools' __editable__ finders do
        @staticmethod
        def find_spec(name: str, path: object = None, target: object = None) -> object:
            if name == "editable_demo_pkg":
                return importlib.util.spec_from_file_location(name, package / "__init__.py")
            return None

    monkeypatch.setattr(sys, "meta_path", [EditableFinder, *sys.meta_path])
    finder = ModuleFinder()
    assert finder.path("editable_demo_pkg") == package / "__init__.py"
    assert finder.path("editable_demo_pkg.core") == package / "core.py"
    assert finder.path("abc") is not None  # frozen in the interpreter, its source on the path
    assert finder.path("_io") is None  # built in: no source
    assert "editable_demo_pkg" not in sys.modules
