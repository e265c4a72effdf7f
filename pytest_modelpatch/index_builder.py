"""Build the scan index: run as ``python -m pytest_modelpatch.index_builder PATH``.

The transformers core (and torch) is imported; family modules
(``transformers/models/*/modeling_*.py`` and ``configuration_*.py``) are read as text
by :mod:`pytest_modelpatch.source_scan`. Names a family module imports from the core
or from third parties are resolved on the imported objects; names it imports from
other family modules are resolved in their source.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import types
from pathlib import Path
from typing import Any

from pytest_modelpatch.scan_index import CORE, ClassEntry, ScanIndex, write_atomically
from pytest_modelpatch.source_scan import SourceFile

# Strings and comments, removed before reading the names an __init__ uses.
_NOISE = re.compile(r'(?s)""".*?"""|\'\'\'.*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|#[^\n]*')
_IDENTIFIER = re.compile(r"(?<![\w.])([A-Za-z_]\w*)")
_SELF_CALL = re.compile(r"\bself\.(\w+)\s*\(")
# Names passed here are not children: super(Cls, self), isinstance(x, Cls).
_NOT_CHILD = re.compile(r"\b(?:super|isinstance|issubclass)\s*\([^()]*\)")

Ref = tuple[Any, ...]  # ("class", key) | ("module", name) | ("function", module, name) | ("other",)
OTHER: Ref = ("other",)


class Builder:
    """Resolves names in family sources and imported modules into one ScanIndex."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, SourceFile] = {}  # static family modules by module name
        self.paths: dict[str, Path] = {}
        for folder in sorted((root / "models").iterdir()):
            for path in sorted(folder.glob("modeling_*.py")) + sorted(folder.glob("configuration_*.py")):
                self.paths[f"transformers.models.{folder.name}.{path.stem}"] = path
        self.package_modules: dict[str, list[str]] = {}
        for module in self.paths:
            self.package_modules.setdefault(module.rsplit(".", 1)[0], []).append(module)
        self.namespaces: dict[str, dict[str, Ref]] = {}
        self.names_memo: dict[tuple[int, str], set[str]] = {}
        self.base_models: dict[str, list[tuple[str, str]]] | None = None
        self.keys: dict[str, int] = {}
        self.classes: list[ClassEntry] = []
        self.runtime: dict[str, type] = {}  # key -> class object, for imported classes
        self.static: dict[str, tuple[str, str]] = {}  # key -> (module, class name)
        self.made: set[str] = set()  # classes made by a call such as namedtuple(...)
        self.core_files: dict[str, SourceFile | None] = {}
        self.children_memo: dict[str, list[tuple[str, str]]] = {}

    # -- names ---------------------------------------------------------------
    def source(self, module: str) -> SourceFile:
        if module not in self.files:
            self.files[module] = SourceFile.read(self.paths[module].read_text(encoding="utf-8"))
        return self.files[module]

    def namespace(self, module: str) -> dict[str, Ref]:
        """Top-level names of a static family module, resolved."""
        if module in self.namespaces:
            return self.namespaces[module]
        names: dict[str, Ref] = {}
        self.namespaces[module] = names  # early, so that import cycles end
        scanned = self.source(module)
        for node in scanned.statements:
            self._bind(module, node, names)
        for name in scanned.functions:
            names[name] = ("function", module, name)
        for name in scanned.classes:
            key = f"{module}:{name}"
            self.static[key] = (module, name)
            names[name] = ("class", key)
        return names

    def _bind(self, module: str, node: ast.stmt, names: dict[str, Ref]) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name if alias.asname else alias.name.split(".")[0]
                names[alias.asname or top] = ("module", top)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.level, node.module or "")
            for alias in node.names:
                if alias.name == "*":
                    continue
                names[alias.asname or alias.name] = self.import_ref(base, alias.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = self.expression_ref(module, node.value, names)
            for target in targets:
                if isinstance(target, ast.Name):
                    names[target.id] = value

    def expression_ref(self, module: str, node: ast.expr, names: dict[str, Ref]) -> Ref:
        """An alias (``X = nn.LayerNorm``) or a dict of classes; anything else is not a class."""
        if isinstance(node, ast.Dict):
            return ("dict", [self.expression_ref(module, v, names) for v in node.values])
        if isinstance(node, ast.Call) and (_dotted_name(node.func) or "").split(".")[-1] in _CLASS_FACTORIES:
            key = f"{module}:{_first_string(node) or 'namedtuple'}"
            self.made.add(key)
            return ("class", key)
        dotted = _dotted_name(node)
        return self.dotted_ref(names, dotted) if dotted else OTHER

    def dotted_ref(self, names: dict[str, Ref], dotted: str) -> Ref:
        first, *rest = dotted.split(".")
        ref = names.get(first, OTHER)
        for attr in rest:
            if ref[0] == "module":
                ref = self.import_ref(ref[1], attr)
            elif ref[0] == "class" and ref[1] in self.runtime:
                ref = self.object_ref(getattr(self.runtime[ref[1]], attr, None))
            else:
                return OTHER
        return ref

    def import_ref(self, module: str, name: str) -> Ref:
        """What ``from module import name`` binds."""
        if module in self.paths:
            return self.namespace(module).get(name, OTHER)
        submodule = f"{module}.{name}"
        if submodule in self.paths:
            return ("module", submodule)
        for inner in self.package_modules.get(module, ()):
            # A family package re-exports its modules' names; importing it would
            # scan the whole folder (transformers' lazy import structure).
            if name in self.namespace(inner):
                return self.namespace(inner)[name]
        try:
            imported = importlib.import_module(module)
            return self.object_ref(getattr(imported, name))
        except Exception:  # noqa: BLE001 - optional dependencies missing: the name is absent
            try:
                return self.object_ref(importlib.import_module(submodule))
            except Exception:  # noqa: BLE001
                return OTHER

    def object_ref(self, value: Any) -> Ref:
        if isinstance(value, type):
            key = f"{value.__module__}:{value.__qualname__}"
            self.runtime.setdefault(key, value)
            return ("class", key)
        if isinstance(value, types.ModuleType):
            return ("module", value.__name__)
        return OTHER

    # -- classes -------------------------------------------------------------
    def class_index(self, key: str) -> int:
        if key in self.keys:
            return self.keys[key]
        module, name = key.split(":", 1)
        is_module, kind = self.nature(key, set())
        self.keys[key] = len(self.classes)
        self.classes.append(ClassEntry(name, module, _family(module), is_module, kind))
        return self.keys[key]

    def nature(self, key: str, seen: set[str]) -> tuple[bool, str]:
        """(is an nn.Module, kind) of a class, from its bases for classes read as text."""
        if key in self.runtime:
            return _runtime_nature(self.runtime[key])
        if key in self.made:
            return False, "class"
        if key in self.keys:
            entry = self.classes[self.keys[key]]
            return entry.is_module, entry.kind
        if key in seen:
            return False, "class"
        seen.add(key)
        module, name = self.static[key]
        names = self.namespace(module)
        for base in self.source(module).classes[name].bases:
            ref = self.dotted_ref(names, base)
            if ref[0] == "class":
                is_module, kind = self.nature(ref[1], seen)
                if kind != "class":
                    return is_module, kind
        return False, "class"

    def children(self, key: str) -> list[tuple[str, str]]:
        """(name looked up, class key) for each module class an instance builds, directly."""
        if key in self.children_memo:
            return self.children_memo[key]
        self.children_memo[key] = found = []
        located = self.locate(key)
        if located is None:
            return found
        module, scanned, name, names = located
        used = self.init_names(scanned, name)
        for base in scanned.classes[name].bases:
            ref = self.dotted_ref(names, base)
            if ref[0] == "class" and ref[1] != key:
                found += [edge for edge in self.children(ref[1]) if edge not in found]
        for word in sorted(used):
            for ref in _flatten(names.get(word, OTHER)):
                if ref[0] == "class" and ref[1] != key and self.nature(ref[1], set())[0]:
                    if (word, ref[1]) not in found:
                        found.append((word, ref[1]))
        return found

    def locate(self, key: str) -> tuple[str, SourceFile, str, dict[str, Ref]] | None:
        """(module, its source, class name, its names) for a class defined in transformers."""
        if key in self.static:
            module, name = self.static[key]
            return module, self.source(module), name, self.namespace(module)
        cls = self.runtime.get(key)
        module = getattr(cls, "__module__", "")
        if cls is None or not module.startswith("transformers") or "." in cls.__qualname__:
            return None
        if module not in self.core_files:
            path = getattr(sys.modules.get(module), "__file__", None)
            self.core_files[module] = SourceFile.read(Path(path).read_text(encoding="utf-8")) if path else None
        scanned = self.core_files[module]
        if scanned is None or cls.__name__ not in scanned.classes:
            return None
        if module not in self.namespaces:
            self.namespaces[module] = {k: self.object_ref(v) for k, v in vars(sys.modules[module]).items()}
        return module, scanned, cls.__name__, self.namespaces[module]

    def init_names(self, scanned: SourceFile, name: str) -> set[str]:
        """Names used by ``__init__`` and by the methods and same-file functions it calls."""
        memo = (id(scanned), name)
        if memo in self.names_memo:
            return self.names_memo[memo]
        cls = scanned.classes[name]
        used: set[str] = set()
        self.names_memo[memo] = used
        pending = ["__init__"]
        seen: set[str] = set()
        while pending:
            method = pending.pop()
            if method in seen:
                continue
            seen.add(method)
            text = cls.method(method) if not method.startswith("fn:") else scanned.function(method[3:])
            if text is None:
                continue
            words = _names_used(text)
            used |= words
            pending += _SELF_CALL.findall(text)
            pending += [f"fn:{word}" for word in words if word in scanned.functions]
        return used

    # -- the index -----------------------------------------------------------
    def build(self, transformers_version: str) -> ScanIndex:
        modules: dict[str, tuple[str, dict[str, int]]] = {}
        model_types: dict[str, str] = {}
        for module in self.paths:
            names = self.namespace(module)
            modules[module] = (_family(module), {n: self.class_index(r[1]) for n, r in names.items() if r[0] == "class"})
            for cls in self.source(module).classes.values():
                if module.split(".")[-1].startswith("configuration_") and cls.model_type:
                    model_types.setdefault(cls.model_type, _family(module))
        for module in self._loaded_core():
            namespace = vars(sys.modules[module])
            modules[module] = (_family(module), {})
            for attr, value in list(namespace.items()):
                ref = self.object_ref(value)
                if ref[0] == "class":
                    modules[module][1][attr] = self.class_index(ref[1])
        children: dict[int, list[tuple[str, int]]] = {}
        for key in list(self.keys):
            if self.classes[self.keys[key]].is_module:
                edges = [(word, self.class_index(child)) for word, child in self.children(key)]
                edges += self.auto_edges(key)
                if edges:
                    children[self.keys[key]] = edges
        return ScanIndex(transformers_version, self.classes, modules, children, model_types)

    def auto_edges(self, key: str) -> list[tuple[str, int]]:
        """``AutoModel.from_config(config)`` in a family class builds that family's base model."""
        located = self.locate(key)
        if located is None or _family(self.classes[self.keys[key]].module) == CORE:
            return []
        _, scanned, name, _ = located
        bases_text = " ".join(scanned.classes[name].bases)
        if "AutoModel" not in self.init_names(scanned, name) and "Generic" not in bases_text:
            return []
        if self.base_models is None:
            self.base_models = {}
            wanted = _base_model_names()
            for module in self.paths:
                for word, ref in self.namespace(module).items():
                    if word in wanted and ref[0] == "class" and ref[1] in self.static and ref[1].startswith(module):
                        self.base_models.setdefault(_family(module), []).append((word, ref[1]))
        family = self.classes[self.keys[key]].family
        return [(word, self.class_index(ref)) for word, ref in self.base_models.get(family, []) if ref != key]

    def _loaded_core(self) -> list[str]:
        lazy = getattr(importlib.import_module("transformers.utils.import_utils"), "_LazyModule", ())
        return sorted(
            name
            for name, module in list(sys.modules.items())
            if name.startswith("transformers") and module is not None
            and name not in self.paths and not isinstance(module, lazy)
        )


_BASE_MODELS: set[str] = set()


def _base_model_names() -> set[str]:
    if not _BASE_MODELS:
        from transformers.models.auto import modeling_auto

        _BASE_MODELS.update(v for v in modeling_auto.MODEL_MAPPING_NAMES.values() if isinstance(v, str))
    return _BASE_MODELS


def _names_used(text: str) -> set[str]:
    return set(_IDENTIFIER.findall(_NOT_CHILD.sub("", _NOISE.sub("", text))))


def _flatten(ref: Ref) -> list[Ref]:
    return [r for item in ref[1] for r in _flatten(item)] if ref[0] == "dict" else [ref]


def _runtime_nature(cls: type) -> tuple[bool, str]:
    import torch
    from transformers.configuration_utils import PretrainedConfig
    from transformers.utils import ModelOutput

    if issubclass(cls, torch.nn.Module):
        return True, "module"
    if issubclass(cls, ModelOutput):
        return False, "output"
    if issubclass(cls, PretrainedConfig):
        return False, "config"
    return False, "class"


def _family(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "models" else CORE


def _absolute(module: str, level: int, target: str) -> str:
    if level == 0:
        return target
    package = module.split(".")[:-level]
    return ".".join(package + ([target] if target else []))


_CLASS_FACTORIES = {"namedtuple", "NamedTuple", "TypedDict", "make_dataclass"}


def _first_string(node: ast.Call) -> str | None:
    first = node.args[0] if node.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _dotted_name(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def main(argv: list[str]) -> int:
    import torch
    import transformers
    import transformers.generation  # noqa: F401 - bound by every generative model
    import transformers.modeling_utils  # noqa: F401 - the core every modeling module imports

    torch.set_num_threads(1)
    builder = Builder(Path(transformers.__file__).parent)
    index = builder.build(transformers.__version__)
    write_atomically(Path(argv[0]), index.to_json(torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
