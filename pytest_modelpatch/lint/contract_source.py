"""What transformers' own source says a replaced class must accept, read as text.

The contract lint needs three facts about an original class that its source states and that
importing transformers would only slow down: the parameters of its ``forward`` and which of
them the body reads; the calls its parent module makes to construct it
(``LlamaAttention(config=config, layer_idx=layer_idx)``) and to run it
(``self.self_attn(hidden_states=..., position_ids=..., **kwargs)``); and the family's
``_no_split_modules``. Each module file is parsed once per process.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

from pytest_modelpatch.lint.scan_index import transformers_location


@dataclass(frozen=True)
class Params:
    """The named parameters of a function (``self`` left out) and what its body reads."""

    names: tuple[str, ...]
    required: tuple[str, ...]
    var_keyword: bool
    read: frozenset[str]


@dataclass(frozen=True)
class CallSite:
    """One call in a parent class: how many positional arguments, which keywords, where."""

    parent: str
    module: str
    line: int
    positional: int
    keywords: tuple[str, ...]
    unpacks: bool  # *args or **kwargs: what else it passes cannot be read

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


@functools.lru_cache(maxsize=256)
def _tree(module: str) -> ast.Module | None:
    path = module_path(module)
    if path is None:
        return None
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _classes(module: str) -> dict[str, ast.ClassDef]:
    tree = _tree(module)
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)} if tree else {}


def method_params(module: str, class_name: str, method: str) -> Params | None:
    """``forward``/``__init__`` parameters of a class, following bases defined in the same module."""
    classes = _classes(module)
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
    return Params(tuple(a.arg for a in named), tuple(required), args.kwarg is not None, read)


@functools.lru_cache(maxsize=256)
def module_calls(module: str) -> ModuleCalls:
    """Every construction ``Name(...)`` and every ``self.attr(...)`` run of a class bound to ``self.attr``."""
    calls = ModuleCalls({}, {})
    for parent, node in _classes(module).items():
        bound: dict[str, str] = {}  # self attribute -> class name constructed into it
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            calls.constructions.setdefault(call.func.id, []).append(_site(parent, module, call))
        for assign in (n for n in ast.walk(node) if isinstance(n, ast.Assign)):
            names = {c.func.id for c in ast.walk(assign.value) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            for target in assign.targets:
                if _self_attr(target):
                    for name in names:
                        bound[target.attr] = name  # type: ignore[union-attr]
        for function in (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
            loops = {
                loop.target.id: attr
                for loop in ast.walk(function)
                if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)
                for attr in [a.attr for a in ast.walk(loop.iter) if _self_attr(a)][:1]
            }
            for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
                attr = call.func.attr if _self_attr(call.func) else None  # type: ignore[union-attr]
                if attr is None and isinstance(call.func, ast.Name):
                    attr = loops.get(call.func.id)
                if attr in bound:
                    calls.forwards.setdefault(bound[attr], []).append(_site(parent, module, call))
    return calls


def _self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _site(parent: str, module: str, call: ast.Call) -> CallSite:
    keywords = tuple(k.arg for k in call.keywords if k.arg is not None)
    unpacks = any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)
    positional = sum(not isinstance(a, ast.Starred) for a in call.args)
    return CallSite(parent, module, call.lineno, positional, keywords, unpacks)


def no_split_modules(module: str) -> dict[str, list[str]]:
    """``{class: _no_split_modules}`` for each class of a module that sets a literal list."""
    found: dict[str, list[str]] = {}
    for name, node in _classes(module).items():
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
