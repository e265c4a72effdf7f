"""What transformers' own source says a replaced class must accept, read as text.

The contract lint needs three facts about an original class that its source states and that
importing transformers would only slow down: the parameters of its ``forward`` and which of
them the body reads; the calls its parent module makes to construct it
(``LlamaAttention(config=config, layer_idx=layer_idx)``, or through a module-level dict of
classes: ``FALCON_ATTENTION_CLASSES[...](config, layer_idx)``) and to run it
(``self.self_attn(hidden_states=..., position_ids=..., **kwargs)``); and the family's
``_no_split_modules``. They depend only on the installed transformers, so each module's facts
are read once and kept in the contract facts cache (:mod:`pytest_modelpatch.lint.contract.cache`):
a warm lint parses no source.
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from pytest_modelpatch.lint.contract.cache import facts_cache
from pytest_modelpatch.lint.scan_index import transformers_location

METHODS = ("forward", "__init__")  # the methods whose parameters the contract lint compares


@dataclass(frozen=True)
class Params:
    """The named parameters of a function (``self`` left out), what its body reads, and renamed keywords.

    The first ``positional`` of ``names`` can be passed by position, the rest only by keyword.
    ``renamed``: ``(old, new)`` for each ``@deprecate_kwarg(old, ..., new_name=new)`` on it, as
    transformers 5.24 put ``("past_key_values", "cache")`` on every attention and decoder layer.
    """

    names: tuple[str, ...]
    required: tuple[str, ...]
    var_keyword: bool
    read: frozenset[str]
    renamed: tuple[tuple[str, str], ...] = ()
    positional: int = 0
    var_positional: bool = False

    def signature(self) -> inspect.Signature:
        """These parameters as an ``inspect.Signature`` to bind calls against (a default stands in as None)."""
        kind = inspect.Parameter
        params = [
            kind(
                n,
                kind.POSITIONAL_OR_KEYWORD if i < self.positional else kind.KEYWORD_ONLY,
                default=kind.empty if n in self.required else None,
            )
            for i, n in enumerate(self.names)
        ]
        if self.var_positional:
            params.insert(self.positional, kind("_args", kind.VAR_POSITIONAL))
        if self.var_keyword:
            params.append(kind("_kwargs", kind.VAR_KEYWORD))
        return inspect.Signature(params)

    def required_call(self, parent: str, module: str) -> CallSite:
        """A call passing only the required parameters, by position where they can be (no call was read)."""
        by_position = [n for n in self.names[: self.positional] if n in self.required]
        keywords = tuple(n for n in self.names[self.positional :] if n in self.required)
        return CallSite(parent, module, 0, len(by_position), keywords, False)


@dataclass(frozen=True)
class CallSite:
    """One call in a parent class: how many positional arguments, which keywords, where."""

    parent: str
    module: str
    line: int
    positional: int
    keywords: tuple[str, ...]
    unpacks: bool  # *args or **kwargs: what else it passes cannot be read
    attribute: str = ""  # a run's: the parent's attribute it calls (self.<attribute>(...), or a loop over it)

    def __str__(self) -> str:
        args = [f"<{i}>" for i in range(self.positional)] + [f"{k}=..." for k in self.keywords]
        args += ["**..."] if self.unpacks else []
        return f"{self.parent} ({self.module}, line {self.line}) calls it with ({', '.join(args)})"


@dataclass
class ModuleCalls:
    """Construction and forward calls of each class name, made by the classes of one module."""

    constructions: dict[str, list[CallSite]]
    forwards: dict[str, list[CallSite]]


def module_path(module: str) -> Path | None:
    """The source file of a ``transformers.*`` module, found without importing it."""
    root = transformers_location()
    if not root or not module.startswith("transformers"):
        return None
    base = Path(root).parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@dataclass
class ModuleFacts:
    """What one module's source says: its calls, ``{class: _no_split_modules}``, ``{"Class.method": Params}``."""

    calls: ModuleCalls
    no_split: dict[str, list[str]]
    params: dict[str, Params]

    def to_json(self) -> dict[str, Any]:
        def sites(table: dict[str, list[CallSite]]) -> dict[str, list[list[Any]]]:
            return {
                name: [
                    [s.parent, s.module, s.line, s.positional, list(s.keywords), s.unpacks, s.attribute] for s in found
                ]
                for name, found in table.items()
            }

        return {
            "constructions": sites(self.calls.constructions),
            "forwards": sites(self.calls.forwards),
            "no_split": self.no_split,
            "params": {
                k: [
                    list(p.names),
                    list(p.required),
                    p.var_keyword,
                    sorted(p.read),
                    [list(pair) for pair in p.renamed],
                    p.positional,
                    p.var_positional,
                ]
                for k, p in self.params.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModuleFacts:
        def sites(table: dict[str, list[list[Any]]]) -> dict[str, list[CallSite]]:
            return {
                str(name): [
                    CallSite(str(p), str(m), int(line), int(n), tuple(map(str, kw)), bool(u), str(a))
                    for p, m, line, n, kw, u, a in found
                ]
                for name, found in table.items()
            }

        params = {
            str(k): Params(
                tuple(map(str, names)),
                tuple(map(str, required)),
                bool(var),
                frozenset(map(str, read)),
                tuple((str(old), str(new)) for old, new in renamed),
                int(positional),
                bool(var_positional),
            )
            for k, (names, required, var, read, renamed, positional, var_positional) in data["params"].items()
        }
        no_split = {str(k): [str(v) for v in names] for k, names in data["no_split"].items()}
        return cls(ModuleCalls(sites(data["constructions"]), sites(data["forwards"])), no_split, params)


@functools.lru_cache(maxsize=256)
def module_facts(module: str) -> ModuleFacts:
    """The facts of a ``transformers.*`` module: from the facts cache, else read from its source."""
    return facts_cache().get("modules", module, ModuleFacts.from_json, lambda: read_module(module), ModuleFacts.to_json)


def read_module(module: str) -> ModuleFacts:
    """Parse a module's source (once) into its :class:`ModuleFacts`."""
    tree = _tree(module)
    classes = _classes(tree)
    params = {
        f"{name}.{method}": found
        for name in classes
        for method in METHODS
        if (found := _method_params(classes, name, method)) is not None
    }
    return ModuleFacts(_module_calls(module, classes, _lookup_tables(tree)), _no_split_modules(classes), params)


def _tree(module: str) -> ast.Module | None:
    path = module_path(module)
    if path is None:
        return None
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _classes(tree: ast.Module | None) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)} if tree else {}


def method_params(module: str, class_name: str, method: str) -> Params | None:
    """``forward``/``__init__`` parameters of a class, following bases defined in the same module."""
    return module_facts(module).params.get(f"{class_name}.{method}")


def _method_params(classes: dict[str, ast.ClassDef], class_name: str, method: str) -> Params | None:
    seen: set[str] = set()
    todo = [class_name]
    while todo:
        name = todo.pop(0)
        if name in seen or name not in classes:
            continue
        seen.add(name)
        node = classes[name]
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == method:
                return params_of(item)
        todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
    return None


def params_of(function: ast.FunctionDef) -> Params:
    """The :class:`Params` of a parsed function definition."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    named = positional[1:] + list(args.kwonlyargs)  # [0] is self
    defaults = len(args.defaults)
    required = [a.arg for a in positional[1 : len(positional) - defaults]]
    required += [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    read = frozenset(
        n.id for statement in function.body for n in ast.walk(statement) if isinstance(n, ast.Name)
    ) | frozenset(
        n.value for statement in function.body for n in ast.walk(statement)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )  # fmt: skip
    return Params(
        tuple(a.arg for a in named),
        tuple(required),
        args.kwarg is not None,
        read,
        _renamed(function),
        max(len(positional) - 1, 0),
        args.vararg is not None,
    )


def _renamed(function: ast.FunctionDef) -> tuple[tuple[str, str], ...]:
    """``(old, new)`` of each ``@deprecate_kwarg("old", "version", new_name="new")`` decorator."""
    found = []
    for decorator in function.decorator_list:
        if not (
            isinstance(decorator, ast.Call)
            and getattr(decorator.func, "id", getattr(decorator.func, "attr", "")) == "deprecate_kwarg"
            and decorator.args
            and isinstance(decorator.args[0], ast.Constant)
        ):
            continue
        new = next((k.value for k in decorator.keywords if k.arg == "new_name"), None)
        if isinstance(new, ast.Constant) and isinstance(new.value, str) and isinstance(decorator.args[0].value, str):
            found.append((decorator.args[0].value, new.value))
    return tuple(found)


def module_calls(module: str) -> ModuleCalls:
    """Every construction ``Name(...)`` and every ``self.attr(...)`` run of a class bound to ``self.attr``."""
    return module_facts(module).calls


def _module_calls(module: str, classes: dict[str, ast.ClassDef], tables: dict[str, set[str]]) -> ModuleCalls:
    calls = ModuleCalls({}, {})
    for parent, node in classes.items():
        bound: dict[str, set[str]] = {}  # self attribute -> class names constructed into it
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            for name in _constructed(call, tables):
                calls.constructions.setdefault(name, []).append(_site(parent, module, call))
        for assign in (n for n in ast.walk(node) if isinstance(n, ast.Assign)):
            names = _stored(assign.value, tables)
            for target in assign.targets:
                if _self_attr(target):
                    bound.setdefault(target.attr, set()).update(names)
        for function in (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
            loops = {
                loop.target.id: attr
                for loop in ast.walk(function)
                if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)
                for attr in [a.attr for a in ast.walk(loop.iter) if _self_attr(a)][:1]
            }
            for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
                attr = call.func.attr if _self_attr(call.func) else None
                if attr is None and isinstance(call.func, ast.Name):
                    attr = loops.get(call.func.id)
                for name in sorted(bound.get(attr or "", ())):
                    calls.forwards.setdefault(name, []).append(_site(parent, module, call, attr or ""))
    return calls


def _constructed(call: ast.Call, tables: dict[str, set[str]]) -> list[str]:
    """The class names a call builds: ``Name(...)``, or each class of a lookup table, ``TABLE[key](...)``."""
    if isinstance(call.func, ast.Name):
        return [call.func.id]
    if isinstance(call.func, ast.Subscript) and isinstance(call.func.value, ast.Name):
        return sorted(tables.get(call.func.value.id, ()))
    return []


def _stored(value: ast.AST, tables: dict[str, set[str]]) -> set[str]:
    """The classes whose instances an assigned value holds: ``A(...) if c else B(...)``, ``ModuleList([L(...)])``.

    Not the arguments of a constructor (``Model(config, decoder=Decoder(config))`` holds a Model).
    """
    if isinstance(value, ast.Call) and (built := _constructed(value, tables)):
        return set(built)
    return {name for child in ast.iter_child_nodes(value) for name in _stored(child, tables)}


def _lookup_tables(tree: ast.Module | None) -> dict[str, set[str]]:
    """Module-level dicts of class names (``FALCON_ATTENTION_CLASSES = {"eager": FalconAttention, ...}``)."""
    tables: dict[str, set[str]] = {}
    for node in tree.body if tree else []:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, ast.Dict) and value.values and all(isinstance(v, ast.Name) for v in value.values):
            for target in targets:
                if isinstance(target, ast.Name):
                    tables[target.id] = {v.id for v in value.values if isinstance(v, ast.Name)}
    return tables


def _self_attr(node: ast.AST) -> TypeGuard[ast.Attribute]:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _site(parent: str, module: str, call: ast.Call, attribute: str = "") -> CallSite:
    keywords = tuple(k.arg for k in call.keywords if k.arg is not None)
    unpacks = any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)
    positional = sum(not isinstance(a, ast.Starred) for a in call.args)
    return CallSite(parent, module, call.lineno, positional, keywords, unpacks, attribute)


def no_split_modules(module: str) -> dict[str, list[str]]:
    """``{class: _no_split_modules}`` for each class of a module that sets a literal list."""
    return module_facts(module).no_split


def _no_split_modules(classes: dict[str, ast.ClassDef]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, node in classes.items():
        for item in node.body:
            if isinstance(item, (ast.Assign, ast.AnnAssign)):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                if any(isinstance(t, ast.Name) and t.id == "_no_split_modules" for t in targets) and item.value:
                    try:
                        value = ast.literal_eval(item.value)
                    except ValueError:
                        continue
                    if isinstance(value, (list, tuple)):
                        found[name] = [str(v) for v in value]
    return found
