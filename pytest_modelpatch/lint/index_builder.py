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
import dataclasses
import re
import sys
from importlib import util
from pathlib import Path

from pytest_modelpatch.lint.name_resolver import NameResolver, Ref, _absolute, _assigned
from pytest_modelpatch.lint.scan_index import CORE, ClassEntry, ScanIndex, _version, write_atomically
from pytest_modelpatch.lint.source_scan import SourceFile

# Strings and comments, removed before reading the names an __init__ uses.
_NOISE = re.compile(r'(?s)""".*?"""|\'\'\'.*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|#[^\n]*')
_IDENTIFIER = re.compile(r"(?<![\w.])([A-Za-z_]\w*)")
_SELF_CALL = re.compile(r"\bself\.(\w+)\s*\(")
# Names passed here are not children: super(Cls, self), isinstance(x, Cls).
_NOT_CHILD = re.compile(r"\b(?:super|isinstance|issubclass)\s*\([^()]*\)")


# Where natures come from: every nn.Module, ModelOutput and config class derives from one.
ROOTS = {
    "torch.nn.modules.module:Module": (True, "module"),
    "transformers.utils.generic:ModelOutput": (False, "output"),
    "transformers.configuration_utils:PreTrainedConfig": (False, "config"),
}
# What importing a model loads before any family module: the package, the model base
# class and the generation mixins every generative model binds.
CORE_ROOTS = ("transformers", "transformers.modeling_utils", "transformers.generation")


class Builder(NameResolver):
    """Reads the classes of every family module, with their natures and children, into one ScanIndex."""

    def __init__(self, root: Path, search_path: list[str] | None = None) -> None:
        super().__init__(root, search_path)
        self.names_memo: dict[tuple[int, str], set[str]] = {}
        self.natures: dict[str, tuple[bool, str]] = {}
        self.base_models: dict[str, list[tuple[str, str]]] | None = None
        self.keys: dict[str, int] = {}
        self.classes: list[ClassEntry] = []
        self.children_memo: dict[str, list[tuple[str, str]]] = {}

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
        scanned = self.source(module)
        assert scanned is not None  # static names the classes of the modules it scanned
        found = [
            self.nature(ref[1], seen)
            for base in scanned.classes[name].bases
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
        found: list[tuple[str, str]] = []
        self.children_memo[key] = found
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
                    if (
                        word in wanted
                        and (ref := self.lookup(module, word))[0] == "class"
                        and ref[1].startswith(module + ":")
                    ):
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


def _names_used(text: str) -> set[str]:
    return set(_IDENTIFIER.findall(_NOT_CHILD.sub("", _NOISE.sub("", text))))


def _flatten(ref: Ref) -> list[Ref]:
    return [r for item in ref[1] for r in _flatten(item)] if ref[0] == "dict" else [ref]


def _family(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else CORE


def main(argv: list[str]) -> int:
    spec = util.find_spec("transformers")  # a top-level name: found, not imported
    if spec is None or spec.origin is None:
        print("transformers is not installed", file=sys.stderr)
        return 1
    builder = Builder(Path(spec.origin).parent)
    index = builder.build(_version("transformers"))
    index = dataclasses.replace(index, packages=builder.consulted_packages())  # what makes this file stale
    write_atomically(Path(argv[0]), index.to_json(_version("torch")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
