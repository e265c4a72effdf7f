"""Build the scan index: run as ``python -m pytest_modelpatch.lint.index_builder PATH``.

Nothing is imported: transformers, torch and whatever else the family modules use are
read as text (:mod:`pytest_modelpatch.lint.source_scan`) and their names resolved the way
Python's import system would bind them, lazily, one name at a time, so a build reads
only the files some family module's names lead to. Importing the transformers core and
torch alone costs more than reading every family module, and the lint never needs an
object: a class's nature comes from its bases, and its children from its ``__init__``.

Three roots give natures: ``torch.nn.Module`` (a module), transformers' ``ModelOutput``
(an output) and ``PreTrainedConfig`` (a config). The core modules listed are those
importing ``transformers``, ``transformers.modeling_utils``, ``transformers.generation``
and every core module a family module imports from would load, followed through their
module-level imports (both arms of an ``if``; a ``try`` body and its ``else``).
Classes compiled into extension modules have no source and are not listed.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import machinery, util
from pathlib import Path
from typing import Any

from pytest_modelpatch.lint.scan_index import CORE, ClassEntry, ScanIndex, _version, write_atomically
from pytest_modelpatch.lint.source_scan import SourceFile

# Strings and comments, removed before reading the names an __init__ uses.
_NOISE = re.compile(r'(?s)""".*?"""|\'\'\'.*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|#[^\n]*')
_IDENTIFIER = re.compile(r"(?<![\w.])([A-Za-z_]\w*)")
_SELF_CALL = re.compile(r"\bself\.(\w+)\s*\(")
# Names passed here are not children: super(Cls, self), isinstance(x, Cls).
_NOT_CHILD = re.compile(r"\b(?:super|isinstance|issubclass)\s*\([^()]*\)")

# ("class", key) | ("module", name) | ("function", module, name) | ("dict", [Ref]) | ("other",)
# and, until first looked up, ("import", module, name) | ("expr", ast.expr)
Ref = tuple[Any, ...]
OTHER: Ref = ("other",)
_LAZY = ("import", "expr")

# Where natures come from: every nn.Module, ModelOutput and config class derives from one.
ROOTS = {
    "torch.nn.modules.module:Module": (True, "module"),
    "transformers.utils.generic:ModelOutput": (False, "output"),
    "transformers.configuration_utils:PreTrainedConfig": (False, "config"),
}
# What importing a model loads before any family module: the package, the model base
# class and the generation mixins every generative model binds.
CORE_ROOTS = ("transformers", "transformers.modeling_utils", "transformers.generation")


class ModuleFinder:
    """Source files of modules by dotted name, found without importing anything.

    Top-level names go through the import system's finders (``search_path`` None: the
    interpreter's, so editable installs are found too; else a path finder over
    ``search_path``); submodules are files in their package's folder.
    """

    def __init__(self, search_path: list[str] | None = None) -> None:
        self.search_path = search_path
        self.memo: dict[str, Path | None] = {}

    def path(self, module: str) -> Path | None:
        """The ``.py`` file (``__init__.py`` for a package), or None: absent or compiled."""
        if module in self.memo:
            return self.memo[module]
        parent, _, last = module.rpartition(".")
        found = None
        if parent:
            parent_path = self.path(parent)
            if parent_path is not None and parent_path.name == "__init__.py":
                folder = parent_path.parent
                if (folder / last / "__init__.py").is_file():
                    found = folder / last / "__init__.py"
                elif (folder / f"{last}.py").is_file():
                    found = folder / f"{last}.py"
        else:
            found = self._top_level(module)
        self.memo[module] = found
        return found

    def _top_level(self, name: str) -> Path | None:
        # Frozen standard modules (abc, io) have their source on the path all the same.
        finders = [util.find_spec, machinery.PathFinder.find_spec] if self.search_path is None else [
            lambda top: machinery.PathFinder.find_spec(top, self.search_path)
        ]
        for find in finders:
            try:
                origin = getattr(find(name), "origin", None)  # a top-level name: found, not imported
            except (ImportError, ValueError):
                continue
            if origin and origin.endswith(".py") and Path(origin).is_file():
                return Path(origin)
        return None


class Builder:
    """Resolves names in transformers' (and its imports') sources into one ScanIndex."""

    def __init__(self, root: Path, search_path: list[str] | None = None) -> None:
        self.root = root
        self.finder = ModuleFinder(search_path)
        self.finder.memo["transformers"] = root / "__init__.py"
        self.paths: dict[str, Path] = {}  # family modules, the ones every build lists
        for folder in sorted((root / "models").iterdir()):
            for path in sorted(folder.glob("modeling_*.py")) + sorted(folder.glob("configuration_*.py")):
                self.paths[f"transformers.models.{folder.name}.{path.stem}"] = path
                self.finder.memo[f"transformers.models.{folder.name}.{path.stem}"] = path
        self.package_modules: dict[str, list[str]] = {}
        for module in self.paths:
            self.package_modules.setdefault(module.rsplit(".", 1)[0], []).append(module)
        self.files: dict[str, SourceFile | None] = {}
        self.texts: dict[Path, str] = {}
        self.namespaces: dict[str, dict[str, Ref]] = {}
        self.statements: dict[str, list[ast.stmt]] = {}  # import statements, for the closure
        self.exports: dict[str, list[str]] = {}  # literal __all__
        self.names_memo: dict[tuple[int, str], set[str]] = {}
        self.natures: dict[str, tuple[bool, str]] = {}
        self.base_models: dict[str, list[tuple[str, str]]] | None = None
        self.keys: dict[str, int] = {}
        self.classes: list[ClassEntry] = []
        self.static: dict[str, tuple[str, str]] = {}  # key -> (module, class name)
        self.made: set[str] = set()  # classes made by a call such as namedtuple(...)
        self.children_memo: dict[str, list[tuple[str, str]]] = {}
        self.lazy_memo: dict[tuple[str, str], Ref] = {}
        self._family_definitions: dict[str, str] | None = None
        self.installed_memo: dict[str, bool] = {}

    # -- names ---------------------------------------------------------------
    def text(self, path: Path) -> str:
        if path not in self.texts:
            self.texts[path] = path.read_text(encoding="utf-8", errors="replace")
        return self.texts[path]

    def source(self, module: str) -> SourceFile | None:
        """The scanned source of a module, or None when it has none (or does not parse)."""
        if module not in self.files:
            path = self.finder.path(module)
            try:
                self.files[module] = SourceFile.read(self.text(path), self.installed) if path is not None else None
            except (OSError, SyntaxError, ValueError):
                self.files[module] = None
        return self.files[module]

    def installed(self, top: str) -> bool:
        """Whether a top-level module could be imported here: source, compiled or built in."""
        if top not in self.installed_memo:
            try:
                found = self.finder.path(top) is not None or util.find_spec(top) is not None
            except (ImportError, ValueError):
                found = False
            self.installed_memo[top] = found
        return self.installed_memo[top]

    def is_lazy(self, module: str) -> bool:
        """A package whose ``__init__`` replaces itself by transformers' ``_LazyModule``."""
        path = self.finder.path(module)
        return path is not None and path.name == "__init__.py" and "_LazyModule(" in self.text(path)

    def namespace(self, module: str) -> dict[str, Ref]:
        """Top-level names of a module, imports and assignments unresolved until looked up."""
        if module in self.namespaces:
            return self.namespaces[module]
        names: dict[str, Ref] = {}
        self.namespaces[module] = names  # early, so that import cycles end
        scanned = self.source(module)
        if scanned is None:
            return names
        imports: list[ast.stmt] = []
        self.statements[module] = imports
        # A module may rename itself (_collections_abc is "collections.abc"); its
        # classes' __module__ follows.
        shown = _renamed(scanned) or module
        for name in scanned.classes:
            self.static[f"{shown}:{name}"] = (module, name)
        for node in scanned.statements:
            if isinstance(node, ast.ClassDef):
                names[node.name] = ("class", f"{shown}:{node.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = ("function", module, node.name)
            else:
                self._bind(module, node, names, imports)
        for name in scanned.functions:
            if name not in scanned.conditional:
                names[name] = ("function", module, name)
        for name in scanned.classes:
            if name not in scanned.conditional:
                names[name] = ("class", f"{shown}:{name}")
        return names

    def lookup(self, module: str, name: str) -> Ref:
        """What ``module.name`` is bound to at the end of the module's top level."""
        names = self.namespace(module)
        ref = names.get(name, OTHER)
        if ref[0] in _LAZY:
            names[name] = OTHER  # while resolving: a cycle back here finds nothing
            ref = names[name] = self._resolve(module, ref)
        return ref

    def _resolve(self, module: str, ref: Ref) -> Ref:
        if ref[0] == "import":
            return self.import_ref(ref[1], ref[2])
        return self.expression_ref(module, ref[1])

    def _bind(self, module: str, node: ast.stmt, names: dict[str, Ref], imports: list[ast.stmt]) -> None:
        if isinstance(node, ast.Import):
            imports.append(node)
            for alias in node.names:
                top = alias.name if alias.asname else alias.name.split(".")[0]
                names[alias.asname or top] = ("module", top)
        elif isinstance(node, ast.ImportFrom):
            imports.append(node)
            base = _absolute(module, node.level, node.module or "", self.finder.path(module))
            for alias in node.names:
                if alias.name == "*":
                    names.update(self.star(base))
                else:
                    names[alias.asname or alias.name] = ("import", base, alias.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names[target.id] = ("expr", node.value)
                    if target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        self.exports[module] = [
                            e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                        ]

    def star(self, module: str) -> dict[str, Ref]:
        """What ``from module import *`` binds: its ``__all__``, else its public names."""
        names = self.namespace(module)
        if module in self.exports:
            return {name: ("import", module, name) for name in self.exports[module]}
        return {name: ref for name, ref in names.items() if not name.startswith("_")}

    def expression_ref(self, module: str, node: ast.expr) -> Ref:
        """An alias (``X = nn.LayerNorm``) or a dict of classes; anything else is not a class."""
        if isinstance(node, ast.Dict):
            return ("dict", [self.expression_ref(module, v) for v in node.values if v is not None])
        if isinstance(node, ast.Call) and (_dotted_name(node.func) or "").split(".")[-1] in _CLASS_FACTORIES:
            key = f"{module}:{_first_string(node) or 'namedtuple'}"
            self.made.add(key)
            return ("class", key)
        dotted = _dotted_name(node)
        return self.dotted_ref(module, dotted) if dotted else OTHER

    def dotted_ref(self, module: str, dotted: str) -> Ref:
        """What ``a.b.c`` names, looked up in ``module``."""
        first, *rest = dotted.split(".")
        ref = self.lookup(module, first)
        for attr in rest:
            if ref[0] != "module":
                return OTHER  # attributes of classes and objects are not followed
            ref = self.import_ref(ref[1], attr)
        return ref

    def import_ref(self, module: str, name: str) -> Ref:
        """What ``from module import name`` binds."""
        submodule = f"{module}.{name}"
        if self.finder.path(submodule) is not None:
            return ("module", submodule)
        if self.finder.path(module) is None:
            return self.opaque(module, name)
        ref = self.lookup(module, name)
        if ref == OTHER and self.is_lazy(module):
            ref = self.lazy_ref(module, name)
        return ref if ref != OTHER else self.opaque(module, name)

    def opaque(self, module: str, name: str) -> Ref:
        """A name no source binds: compiled (a C type) or exported at run time.

        Named like a class (``Tokenizer``, ``defaultdict`` is not), it is taken for one
        that is not an ``nn.Module``: every module class has Python source to read.
        """
        if not self.installed(module.split(".")[0]):
            return OTHER
        looks_like_class = name[:1].isupper() and not name.isupper() and not module.startswith("transformers")
        return ("class", f"{module}:{name}") if looks_like_class else OTHER

    def lazy_ref(self, package: str, name: str) -> Ref:
        """A name of a lazy package: the submodule that defines it (as ``_LazyModule`` finds it)."""
        if (package, name) not in self.lazy_memo:
            self.lazy_memo[package, name] = OTHER  # while searching: a cycle finds nothing
            self.lazy_memo[package, name] = self._search_package(package, name)
        return self.lazy_memo[package, name]

    def _search_package(self, package: str, name: str) -> Ref:
        if package in self.package_modules:
            # A family package re-exports its modules' names; only modeling and
            # configuration modules can define a class the lint cares about.
            candidates = self.package_modules[package]
        elif package == "transformers" and name in self.family_definitions():
            return self.lookup(self.family_definitions()[name], name)
        else:
            folder = self.finder.path(package).parent  # type: ignore[union-attr]
            candidates = [f"{package}.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]
            candidates += [f"{package}.{p.parent.name}" for p in sorted(folder.glob("*/__init__.py"))]
        word = re.compile(rf"\b{re.escape(name)}\b")
        found = OTHER
        for candidate in candidates:
            path = self.finder.path(candidate)
            if path is None or candidate == "transformers.models" or not word.search(self.text(path)):
                continue
            ref = self.import_ref(candidate, name) if path.name == "__init__.py" else self.lookup(candidate, name)
            if ref[0] in ("class", "function") and ref[1].split(":")[0] == candidate:
                return ref  # the defining module wins over one that re-imports the name
            if found == OTHER:
                found = ref
        return found

    def family_definitions(self) -> dict[str, str]:
        """Class or function name -> the family module defining it (what the top-level
        ``transformers`` package exports from its models)."""
        if self._family_definitions is None:
            self._family_definitions = {}
            for module in self.paths:
                scanned = self.source(module)
                for name in [*scanned.classes, *scanned.functions] if scanned is not None else []:
                    self._family_definitions.setdefault(name, module)
        return self._family_definitions

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
        """(is an nn.Module, kind) of a class, from the roots its bases lead to."""
        if key in ROOTS:
            return ROOTS[key]
        if key in self.natures:
            return self.natures[key]
        if key in self.made or key not in self.static or key in seen:
            return False, "class"
        seen.add(key)
        module, name = self.static[key]
        found = [
            self.nature(ref[1], seen)
            for base in self.source(module).classes[name].bases  # type: ignore[union-attr]
            if (ref := self.dotted_ref(module, base))[0] == "class"
        ]
        # issubclass order: a module first, then an output, then a config.
        kinds = {kind for _, kind in found}
        result = next(((k == "module", k) for k in ("module", "output", "config") if k in kinds), (False, "class"))
        self.natures[key] = result
        return result

    def children(self, key: str) -> list[tuple[str, str]]:
        """(name looked up, class key) for each module class an instance builds, directly."""
        if key in self.children_memo:
            return self.children_memo[key]
        self.children_memo[key] = found = []
        located = self.locate(key)
        if located is None:
            return found
        module, scanned, name = located
        used = self.init_names(scanned, name)
        for base in scanned.classes[name].bases:
            ref = self.dotted_ref(module, base)
            if ref[0] == "class" and ref[1] != key:
                found += [edge for edge in self.children(ref[1]) if edge not in found]
        names = self.namespace(module)
        for word in sorted(used):
            if word not in names:
                continue
            for ref in _flatten(self.lookup(module, word)):
                edge = (word, ref[1]) if ref[0] == "class" else None
                if edge is not None and edge[1] != key and edge not in found and self.nature(edge[1], set())[0]:
                    found.append(edge)
        return found

    def locate(self, key: str) -> tuple[str, SourceFile, str] | None:
        """(module, its source, class name) for a class defined in transformers."""
        if key not in self.static or not key.startswith("transformers"):
            return None
        module, name = self.static[key]
        scanned = self.source(module)
        return (module, scanned, name) if scanned is not None else None

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
            modules[module] = (_family(module), self.bound_classes(module))
            scanned = self.source(module)
            if scanned is not None and module.split(".")[-1].startswith("configuration_"):
                for cls in scanned.classes.values():
                    if cls.model_type:
                        model_types.setdefault(cls.model_type, _family(module))
        for module in sorted(self.loaded_core()):
            if not self.is_lazy(module):
                modules[module] = (CORE, self.bound_classes(module))
        children: dict[int, list[tuple[str, int]]] = {}
        for key in list(self.keys):
            if self.classes[self.keys[key]].is_module:
                edges = [(word, self.class_index(child)) for word, child in self.children(key)]
                edges += self.auto_edges(key)
                if edges:
                    children[self.keys[key]] = edges
        return ScanIndex(transformers_version, self.classes, modules, children, model_types)

    def bound_classes(self, module: str) -> dict[str, int]:
        """Attribute name -> class index, for every class a module binds at top level."""
        found = {}
        for name in list(self.namespace(module)):
            ref = self.lookup(module, name)
            if ref[0] == "class":
                found[name] = self.class_index(ref[1])
        return found

    def loaded_core(self) -> set[str]:
        """The core modules importing the models loads: CORE_ROOTS and every core module a
        family module imports from, followed through module-level imports."""
        loaded: set[str] = set()
        pending = list(CORE_ROOTS)
        for module in self.paths:
            self.namespace(module)
            pending += self.imported(module)
        while pending:
            module = pending.pop()
            if module in loaded or not module.startswith("transformers") or module in self.paths:
                continue
            if self.finder.path(module) is None:
                continue
            loaded.add(module)
            self.namespace(module)
            if "." in module:
                pending.append(module.rsplit(".", 1)[0])
            pending += self.imported(module)
        return loaded

    def imported(self, module: str) -> list[str]:
        """The modules that running the top level of ``module`` imports."""
        found: list[str] = []
        for node in self.statements.get(module, []):
            if isinstance(node, ast.Import):
                found += [alias.name for alias in node.names]
                continue
            assert isinstance(node, ast.ImportFrom)
            base = _absolute(module, node.level, node.module or "", self.finder.path(module))
            found.append(base)
            for alias in node.names:
                if self.finder.path(f"{base}.{alias.name}") is not None:
                    found.append(f"{base}.{alias.name}")
                elif alias.name != "*" and base.startswith("transformers") and self.is_lazy(base):
                    ref = self.lazy_ref(base, alias.name)
                    if ref[0] in ("class", "function"):
                        found.append(ref[1].split(":")[0])  # a function's module, a class's key
        return found

    def auto_edges(self, key: str) -> list[tuple[str, int]]:
        """``AutoModel.from_config(config)`` in a family class builds that family's base model."""
        located = self.locate(key)
        if located is None or _family(self.classes[self.keys[key]].module) == CORE:
            return []
        _, scanned, name = located
        bases_text = " ".join(scanned.classes[name].bases)
        if "AutoModel" not in self.init_names(scanned, name) and "Generic" not in bases_text:
            return []
        if self.base_models is None:
            self.base_models = {}
            wanted = self.base_model_names()
            for module in self.paths:
                for word in self.namespace(module):
                    if word in wanted and (ref := self.lookup(module, word))[0] == "class" and ref[1].startswith(module + ":"):
                        self.base_models.setdefault(_family(module), []).append((word, ref[1]))
        family = self.classes[self.keys[key]].family
        return [(word, self.class_index(ref)) for word, ref in self.base_models.get(family, []) if ref != key]

    def base_model_names(self) -> set[str]:
        """The class names in ``MODEL_MAPPING_NAMES`` (what ``AutoModel`` builds), read from source."""
        scanned = self.source("transformers.models.auto.modeling_auto")
        call = _assigned(scanned, "MODEL_MAPPING_NAMES") if scanned is not None else None
        if call is None:
            return set()
        pairs = call.args[0] if isinstance(call, ast.Call) and call.args else call
        try:
            return {v for _, v in ast.literal_eval(pairs) if isinstance(v, str)}
        except (ValueError, TypeError):
            return set()


def _assigned(scanned: SourceFile, name: str) -> ast.expr | None:
    """The value of the first top-level ``name = ...`` of a module."""
    for node in scanned.statements:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    return None


def _renamed(scanned: SourceFile) -> str | None:
    value = _assigned(scanned, "__name__")
    return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None


def _names_used(text: str) -> set[str]:
    return set(_IDENTIFIER.findall(_NOT_CHILD.sub("", _NOISE.sub("", text))))


def _flatten(ref: Ref) -> list[Ref]:
    return [r for item in ref[1] for r in _flatten(item)] if ref[0] == "dict" else [ref]


def _family(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else CORE


def _absolute(module: str, level: int, target: str, path: Path | None) -> str:
    """The module a ``from`` import names; a package's own ``__init__`` counts as level 0."""
    if level == 0:
        return target
    package = module.split(".")
    if path is None or path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (level - 1)]
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
    spec = util.find_spec("transformers")  # a top-level name: found, not imported
    if spec is None or spec.origin is None:
        print("transformers is not installed", file=sys.stderr)
        return 1
    builder = Builder(Path(spec.origin).parent)
    index = builder.build(_version("transformers"))
    write_atomically(Path(argv[0]), index.to_json(_version("torch")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
