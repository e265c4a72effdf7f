"""Names in Python sources resolved as the import system would bind them, without importing anything.

:class:`ModuleFinder` finds a module's source file by its dotted name; :class:`NameResolver`
reads each module's top-level bindings from its source on first need (imports, ``__all__``,
assignments, classes made by ``namedtuple`` and the like) and follows a name to what it is:
a class, a module, a function, or something opaque. The scan index's builder
(:mod:`pytest_modelpatch.lint.index_builder`) reads transformers' classes through it.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable
from importlib import machinery, metadata, util
from pathlib import Path
from typing import Any

from pytest_modelpatch.lint.source_scan import SourceFile

# ("class", key) | ("module", name) | ("function", module, name) | ("dict", [Ref]) | ("other",)
# and, until first looked up, ("import", module, name) | ("expr", ast.expr)
Ref = tuple[Any, ...]
OTHER: Ref = ("other",)
_LAZY = ("import", "expr")


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
        finders: list[Callable[[str], Any]] = (
            [util.find_spec, machinery.PathFinder.find_spec]
            if self.search_path is None
            else [lambda top: machinery.PathFinder.find_spec(top, self.search_path)]
        )
        for find in finders:
            try:
                origin = getattr(find(name), "origin", None)  # a top-level name: found, not imported
            except (ImportError, ValueError):
                continue
            if origin and origin.endswith(".py") and Path(origin).is_file():
                return Path(origin)
        return None


class NameResolver:
    """Resolves names in transformers' (and its imports') sources the way Python would bind them, lazily.

    ``lookup(module, name)`` gives a reference (a class key, a module, a function, ...) without
    importing anything: each module's top-level bindings are read from its source on first need.
    """

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
        self.static: dict[str, tuple[str, str]] = {}  # key -> (module, class name)
        self.made: set[str] = set()  # classes made by a call such as namedtuple(...)
        self.lazy_memo: dict[tuple[str, str], Ref] = {}
        self._family_definitions: dict[str, str] | None = None
        self.installed_memo: dict[str, bool] = {}

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

    def consulted_packages(self) -> dict[str, list[str] | None]:
        """Every top-level package outside the standard library that resolving read or probed:
        ``[distribution, version]`` when installed (``["", ""]`` without metadata), None when absent."""
        tops = {module.partition(".")[0] for module in self.finder.memo} | set(self.installed_memo)
        owners = metadata.packages_distributions()
        consulted: dict[str, list[str] | None] = {}
        for top in sorted(tops - set(sys.stdlib_module_names)):
            if self.finder.memo.get(top) is None and not self.installed(top):
                consulted[top] = None
                continue
            distribution = (owners.get(top) or [""])[0]
            consulted[top] = [distribution, metadata.version(distribution) if distribution else ""]
        return consulted

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
            found_at = self.finder.path(package)
            assert found_at is not None  # a lazy package is searched only once its source was found
            folder = found_at.parent
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


def _assigned(scanned: SourceFile, name: str) -> ast.expr | None:
    """The value of the first top-level ``name = ...`` of a module."""
    for node in scanned.statements:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    return None


def _renamed(scanned: SourceFile) -> str | None:
    value = _assigned(scanned, "__name__")
    return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None


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
