"""pytest-modelpatch: prove that a patched transformers model is still the model.

The face: the checks (``assert_*`` one comparison, ``check_*`` over drawn inputs), their reports,
tolerances and the base errors. The rest is in documented submodules, each with its own
``__all__``: :mod:`.strategies`, :mod:`.models`, :mod:`.isolation`, :mod:`.lint`, :mod:`.report`,
:mod:`.roundtrip` and :mod:`.errors` (docs/reference.md). Importing this package imports neither
torch nor transformers; each public name is loaded from its module on first access.

PYTEST_DONT_REWRITE: a rank process (``python -m pytest_modelpatch.parallel.rank``) imports this
package before its pytest starts, and pytest warns for each plugin module it finds imported and
cannot rewrite, which fails a session run under ``-W error``. It holds no ``assert`` to rewrite.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A face module's ``__getattr__`` and ``__dir__``: each of ``exports`` (name -> module under
    ``pytest_modelpatch``) is imported on first access and kept, so a face imports nothing heavy.

    Example: ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)``.
    """

    def load(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def listing() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return load, listing


# public name -> module that defines it. The naming rule (docs/reference.md): assert_* runs one
# comparison and raises; check_* runs it over drawn inputs.
_EXPORTS: dict[str, str] = {
    # errors.py: the base of every error, and the one a wrong use raises (the rest: pytest_modelpatch.errors)
    "ModelPatchError": "errors",
    "PatchUsageError": "errors",
    # compare/: the checks, their reports, tolerances
    "assert_equivalent": "compare.forward.equivalence",
    "EquivalenceReport": "compare.forward.equivalence",
    "check_equivalent": "compare.forward.properties",
    "check_backward_equivalent": "compare.forward.properties",
    "PropertyReport": "compare.forward.properties",
    "assert_backward_equivalent": "compare.backward.equivalence",
    "BackwardReport": "compare.backward.equivalence",
    "assert_decodes_equivalent": "compare.decoding.equivalence",
    "DecodingReport": "compare.decoding.equivalence",
    "check_decodes_equivalent": "compare.decoding.properties",
    "DecodingPropertyReport": "compare.decoding.properties",
    "assert_trains_equivalent": "compare.training.steps",
    "TrainingReport": "compare.training.steps",
    "assert_module_equivalent": "compare._engine.divergence",
    "ModuleEquivalenceReport": "compare._engine.divergence",
    "assert_exports_equivalent": "compare.graph.export",
    "ExportReport": "compare.graph.export",
    "assert_compiles_equivalent": "compare.graph.compile",
    "CompileReport": "compare.graph.compile",
    "ParityReport": "compare.graph.parity",
    "TolerancePolicy": "compare._engine.tolerance",
    "DtypeTolerance": "compare._engine.tolerance",
    "ToleranceSpec": "compare._engine.tolerance",
    "resolve_tolerance": "compare._engine.tolerance",
    "sqnr_policy": "compare._engine.tolerance",
    "oracle_policy": "compare._engine.tolerance",
    "DEFAULT_POLICY": "compare._engine.tolerance",
    "LOOSE_POLICY": "compare._engine.tolerance",
    "STRICT_POLICY": "compare._engine.tolerance",
    # roundtrip/ and isolation/: the checks of lossless save and load and of reversible conversions
    "assert_roundtrip": "roundtrip.check",
    "RoundtripReport": "roundtrip.check",
    "assert_reversible": "isolation.reversibility",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__ = lazy_exports(__name__, _EXPORTS)[0]


def __dir__() -> list[str]:
    return __all__
