"""Read a transformers source file without importing it: its top-level names and methods.

Parsing all of transformers' 27 MB of modeling source with ``ast.parse`` costs about as
much as importing it. The pattern lint needs three things only: the names a module
binds at top level, the bases of its classes and the bodies of their ``__init__`` (and
what ``__init__`` calls). So the file is cut into top-level blocks at column 0 (skipping
triple-quoted strings) with regular expressions, and only the pieces that are needed
are parsed, when first needed. A cut that will not parse falls back to parsing whole.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

# A line at column 0 that starts a statement (not a continuation, comment or closer).
# (A literal "\n" first lets the regex engine skip ahead fast; the file start is added by hand.)
_TOP = re.compile(r"\n(?![\s#)\]}]|else\b|elif\b|except\b|finally\b)")
_METHOD = re.compile(r"\n    (?:async\s+)?def\s+(\w+)\s*\(")
_MODEL_TYPE = re.compile(r"""^    model_type\s*(?::\s*\w+\s*)?=\s*["']([^"']+)["']""", re.M)
# A line indented by at most 4 spaces: ends a method inside a class body.
_SHALLOW = re.compile(r"\n {0,4}(?![\s#)\]}])")
_NAME = re.compile(r"(?:async\s+)?(?:class|def)\s+(\w+)")

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
Installed = Callable[[str], bool]  # whether a top-level module name can be imported

_AVAILABLE = re.compile(r"is_(\w+?)_available$")
# transformers' is_<name>_available() checks, where <name> is not the module it imports.
_PACKAGES = {
    "vision": "PIL",
    "jinja": "jinja2",
    "speech": "torchaudio",
    "torchvision_v2": "torchvision",
    "torch_flex_attn": "torch",
    "torch_distributed": "torch",
    "torch_sdpa": "torch",
    "flash_attn_2": "flash_attn",
    "flash_attn_3": "flash_attn_interface",
    "serve": "fastapi",
    "torch_tpu": "torch_xla",
    "torch_hpu": "habana_frameworks",
}


@dataclass
class ClassSource:
    """A class of a scanned file: where it is, its bases and methods, parsed on demand."""

    name: str
    file: SourceFile
    start: int  # offset of the `class` keyword
    end: int
    node: ast.ClassDef | None = None  # set once the class had to be parsed whole

    @cached_property
    def bases(self) -> list[str]:
        """The base classes of the ``class`` statement as dotted names (``nn.Module``)."""
        if self.node is None:
            text = self.file.text
            opened = text.find("(", self.start, text.find(":", self.start))
            if opened < 0:
                return []
            found = _bases_from(text, opened + 1)
            if found is not None:
                return found
        return [name for base in self._whole().bases if (name := _dotted(base))]

    @cached_property
    def model_type(self) -> str | None:
        """The ``model_type = "..."`` class attribute (configuration classes), or None."""
        match = _MODEL_TYPE.search(self.file.text, self.start, self.end)
        return match.group(1) if match else None

    def method(self, name: str) -> str | None:
        """The source of the method ``name`` defined in this class body, or None."""
        if self.node is None:
            for match in _METHOD.finditer(self.file.text, self.start, self.end):
                if match.group(1) == name:
                    end = self.file.next_start(_SHALLOW, match.end(), self.end)
                    return self.file.text[match.start() + 1 : end]
            return None
        found = next((f for f in self.node.body if isinstance(f, FunctionNode) and f.name == name), None)
        return ast.unparse(found) if found is not None else None

    def _whole(self) -> ast.ClassDef:
        if self.node is None:
            node = ast.parse(self.file.text[self.start : self.end]).body[0]
            assert isinstance(node, ast.ClassDef)
            self.node = node
        return self.node


@dataclass
class SourceFile:
    """The top level of one Python file: statements that bind names, classes, functions."""

    text: str
    statements: list[ast.stmt] = field(default_factory=list)  # imports, assignments
    classes: dict[str, ClassSource] = field(default_factory=dict)
    functions: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Names defined by a class or def inside an `if` or `try`: their nodes are in
    # `statements` too, in order, since a later import in the same arm may rebind them.
    conditional: set[str] = field(default_factory=set)
    installed: Installed | None = None
    _strings: list[int] = field(default_factory=list)  # triple-quote offsets, in pairs
    _parsed_functions: dict[str, FunctionNode] = field(default_factory=dict)  # whole-file fallback

    @classmethod
    def read(cls, text: str, installed: Installed | None = None) -> SourceFile:
        """Scan ``text``; falls back to one whole-file parse when the cut does not parse.

        With ``installed``, ``if is_<package>_available():`` and ``try: import ...``
        take the arm that runs with the packages installed here; without it, or for a
        test it cannot decide, both arms are read and the one that runs with optional
        dependencies present binds last.
        """
        scanned = cls(text, installed=installed)
        scanned._strings = _triple_quotes(text)
        try:
            scanned._scan()
        except SyntaxError:
            scanned = cls(text, installed=installed)
            scanned._add_tree(ast.parse(text).body)
        return scanned

    def in_string(self, offset: int) -> bool:
        """Whether ``offset`` lies inside a triple-quoted string (by quote parity)."""
        return bisect.bisect_right(self._strings, offset) % 2 == 1

    def next_start(self, pattern: re.Pattern[str], pos: int, end: int) -> int:
        """Offset of the next ``pattern`` line start outside strings in [pos, end), else end."""
        for match in pattern.finditer(self.text, pos, end):
            if not self.in_string(match.start()):
                return match.start() + 1
        return end

    def function(self, name: str) -> str | None:
        """The source of the top-level function ``name``, or None."""
        if name in self._parsed_functions:
            return ast.unparse(self._parsed_functions[name])
        span = self.functions.get(name)
        return self.text[span[0] : span[1]] if span is not None else None

    def _scan(self) -> None:
        starts = [0] + [m.start() + 1 for m in _TOP.finditer(self.text) if not self.in_string(m.start())]
        starts.append(len(self.text))
        plain: list[str] = []
        block_start: int | None = None
        for start, end in zip(starts, starts[1:]):
            if block_start is None:
                block_start = start
            if self.text.startswith("@", start):
                continue  # decorators run on to the class or def they decorate
            head = _NAME.match(self.text, start)
            if head is not None and self.text.startswith(("class", "def", "async"), start):
                if self.text.startswith("class", start):
                    self.classes[head.group(1)] = ClassSource(head.group(1), self, start, end)
                else:
                    self.functions[head.group(1)] = (block_start, end)
            else:
                plain.append(self.text[block_start:end])
            block_start = None
        self._add_tree(ast.parse("".join(plain)).body)

    def _add_tree(self, body: list[ast.stmt], nested: bool = False) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found = ClassSource(node.name, self, 0, 0, node=node)
                model_type = next((_constant_model_type(i) for i in node.body if _constant_model_type(i)), None)
                found.__dict__["model_type"] = model_type
                self.classes[node.name] = found
            elif isinstance(node, FunctionNode):
                self.functions[node.name] = (0, 0)
                self._parsed_functions[node.name] = node
            elif isinstance(node, ast.If):
                value = self.truth(node.test)
                if value is not None:
                    self._add_tree(node.body if value else node.orelse, nested=True)
                else:
                    negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
                    self._add_tree(node.body + node.orelse if negated else node.orelse + node.body, nested=True)
                continue
            elif isinstance(node, ast.Try):
                if self._raises(node.body):
                    self._add_tree([s for handler in node.handlers for s in handler.body], nested=True)
                else:
                    self._add_tree(node.body + node.orelse, nested=True)
                self._add_tree(node.finalbody, nested=True)
                continue
            else:
                self.statements.append(node)
                continue
            if nested:
                self.statements.append(node)
                self.conditional.add(node.name)

    def truth(self, test: ast.expr) -> bool | None:
        """The value of an ``if`` test made of availability checks, or None if unknown."""
        if _is_type_checking(test):
            return False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            value = self.truth(test.operand)
            return None if value is None else not value
        if isinstance(test, ast.BoolOp):
            values = [self.truth(v) for v in test.values]
            decisive = isinstance(test.op, ast.Or)  # any True decides an `or`, any False an `and`
            if decisive in values:
                return decisive
            return None if None in values else not decisive
        if isinstance(test, ast.Call) and not test.args and self.installed is not None:
            name = test.func.id if isinstance(test.func, ast.Name) else getattr(test.func, "attr", "")
            match = _AVAILABLE.match(name)
            if match:
                return self.installed(_PACKAGES.get(match.group(1), match.group(1)))
        return None

    def _raises(self, body: list[ast.stmt]) -> bool:
        """Whether a ``try`` body fails at import: an unavailable dependency is checked
        (``if not is_x_available(): raise``) or imported."""
        for node in body:
            if isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body) and self.truth(node.test):
                return True
            if self.installed is not None and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(not self.installed(n.split(".")[0]) for n in names if n) and getattr(node, "level", 0) == 0:
                    return True
        return False


def _triple_quotes(text: str) -> list[int]:
    """Offsets of every triple quote, in order (str.find is far faster than a regex here)."""
    found: list[int] = []
    for quote in ('"""', "'''"):
        pos = text.find(quote)
        while pos >= 0:
            found.append(pos)
            pos = text.find(quote, pos + 3)
    return sorted(found)


_BASE = re.compile(r"\s*([A-Za-z_][\w.]*)\s*(?:\[[^()]*\])?\s*(,|\))")


def _bases_from(text: str, pos: int) -> list[str] | None:
    """Dotted base names from just after ``class X(``; None when they are not plain names."""
    names: list[str] = []
    while True:
        match = _BASE.match(text, pos)
        if match is None:
            rest = text[pos : pos + 80].lstrip()
            return names if rest.startswith(")") else None
        names.append(match.group(1))
        pos = match.end()
        if match.group(2) == ")":
            return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):
        node = node.value
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _constant_model_type(node: ast.stmt) -> str | None:
    if (
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "model_type" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ):
        return str(node.value.value)
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )
