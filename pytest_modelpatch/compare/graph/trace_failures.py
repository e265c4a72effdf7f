"""Say where and why torch.export or torch.compile gave up on a patched model, in a few lines.

Torch's own errors run to hundreds of lines (guard traces, the partial graph). A person needs
three things: the line of code that broke tracing, the class that line belongs to in the
patched model, and what torch objected to. ``describe_failure`` finds the line from the
user frames torch attaches to its error (``real_stack`` of dynamo errors, the traceback,
or the ``File "...", line N`` torch quotes), taking the innermost frame outside torch.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_QUOTED_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')

# what to do about the failures patches cause most, keyed by a phrase in torch's message
_FIXES = (
    (
        ("data-dependent", "data dependent", "tensor.item", "item()"),
        "The code branches on (or reads out) a tensor's values, which a traced graph cannot do. Make it "
        "branchless (torch.where, torch.clamp, torch.nan_to_num), express real control flow with torch.cond, "
        "or keep the check out of the traced forward.",
    ),
    (
        ("constraints violated", "specializ", "specialis", "not in range"),
        "A dimension meant to be dynamic was fixed by the code (a Python int taken from .shape and branched "
        "on, or a size-dependent cache). Keep sizes symbolic, or export with dynamic=False.",
    ),
)
_DEFAULT_FIX = (
    "Rewrite the construct at that line in a traceable form; torch.export's and torch.compile's "
    "troubleshooting pages list the usual causes."
)


@dataclass(frozen=True)
class SourceLocation:
    """A line of user code, and the patched model's class whose method it is (when one is)."""

    filename: str
    lineno: int
    function: str
    code: str = ""
    owner: str = ""  # e.g. "LlamaMLP.forward at model.layers.0.mlp (rebound to patched_LlamaMLP.forward)"

    def __str__(self) -> str:
        where = f"{_short(self.filename)}:{self.lineno} in {self.function}"
        where += f", {self.owner}" if self.owner else ""
        return f"{where}\n    {self.code}" if self.code else where

    @property
    def short(self) -> str:
        """``file.py:12 (Class.method)``: one location on one line."""
        return f"{_short(self.filename)}:{self.lineno}" + (f" ({self.owner.split(' ')[0]})" if self.owner else "")


@dataclass(frozen=True)
class TraceFailure:
    """Why export or compile failed: what was run, where it broke, torch's reason, and what to do."""

    action: str  # e.g. "torch.export.export(strict=False)"
    patched: str  # the patched model's class name
    error_type: str
    summary: str
    location: SourceLocation | None
    fix: str

    def __str__(self) -> str:
        where = f"broke at {self.location}" if self.location else "no user frame outside torch in the error"
        return "\n".join([
            f"{self.action} failed on patched {self.patched}: {where}",
            f"torch says ({self.error_type}): {self.summary}",
            f"how to fix: {self.fix}",
        ])  # fmt: skip


def describe_failure(error: BaseException, model: torch.nn.Module, action: str) -> TraceFailure:
    """Turn a torch export/compile exception into a located, one-paragraph :class:`TraceFailure`.

    Example::

        try:
            torch.export.export(wrapper, args)
        except Exception as error:
            raise AssertionError(str(describe_failure(error, patched, "torch.export.export"))) from None
    """
    text = str(error)
    lowered = text.lower()
    fix = next((fix for phrases, fix in _FIXES if any(p in lowered for p in phrases)), _DEFAULT_FIX)
    return TraceFailure(
        action=action, patched=type(model).__name__, error_type=type(error).__name__,
        summary=summarize(text), location=locate(_frames(error), model), fix=fix,
    )  # fmt: skip


def summarize(text: str, limit: int = 600) -> str:
    """The first paragraph of a torch error on one line: its title, explanation and first hint."""
    paragraph = next((p for p in text.strip().split("\n\n") if p.strip()), "")
    lines, hinted = [], False
    for line in paragraph.splitlines():
        line = line.strip()
        if line.startswith("Hint:"):
            if hinted:
                continue  # dynamo lists several hints; the first is the specific one
            hinted = True
        lines.append(line)
    summary = " ".join(line for line in lines if line)
    return summary if len(summary) <= limit else summary[: limit - 3].rstrip() + "..."


def locate(frames: Iterable[traceback.FrameSummary], model: torch.nn.Module) -> SourceLocation | None:
    """The innermost frame outside torch, with the class of ``model`` whose method holds it."""
    frame = next((f for f in reversed(list(frames)) if f.filename and not f.filename.startswith(_TORCH_DIR)), None)
    if frame is None or frame.lineno is None:
        return None
    return SourceLocation(
        frame.filename,
        frame.lineno,
        frame.name,
        (frame.line or "").strip(),
        _owner(frame.filename, frame.lineno, model),
    )


def user_frames(stack: Iterable[Any]) -> list[traceback.FrameSummary]:
    """Frames of a dynamo ``user_stack``/``real_stack`` as ``FrameSummary`` objects."""
    return [f for f in stack if isinstance(f, traceback.FrameSummary)]


def _frames(error: BaseException) -> list[traceback.FrameSummary]:
    # dynamo errors carry the user frames it was tracing; the traceback only has torch's own
    real = getattr(error, "real_stack", None)
    if real:
        return user_frames(real)
    quoted = [
        traceback.FrameSummary(m["file"], int(m["line"]), m["name"], line=_source_line(m["file"], int(m["line"])))
        for m in _QUOTED_FRAME.finditer(str(error))
    ]
    if quoted:  # non-strict export quotes "The following call raised this error: File ..."
        return quoted
    return list(traceback.extract_tb(error.__traceback__))


def _source_line(filename: str, lineno: int) -> str:
    import linecache

    return linecache.getline(filename, lineno).strip()


def _owner(filename: str, lineno: int, model: torch.nn.Module) -> str:
    """``Class.method at module.path``: the model class (and submodule) whose method's code holds the line."""
    seen: set[type] = set()
    for name, module in model.named_modules():
        for cls in type(module).__mro__:
            if cls in seen or cls in (torch.nn.Module, object):
                continue
            seen.add(cls)
            for attr, value in vars(cls).items():
                code = getattr(getattr(value, "__func__", value), "__code__", None)
                while code is None and hasattr(value, "__wrapped__"):  # decorated methods, e.g. no_grad
                    value = value.__wrapped__
                    code = getattr(value, "__code__", None)
                if code is None or code.co_filename != filename or not _holds(code, lineno):
                    continue
                owner = f"{type(module).__name__}.{attr} at {name or '<root>'}"
                qualname = getattr(value, "__qualname__", "")
                if qualname and qualname.split(".")[0] != cls.__name__:  # a method patch rebound it
                    owner += f" (rebound to {qualname})"
                return owner
    return ""


def _holds(code: Any, lineno: int) -> bool:
    lines = [line for _, _, line in code.co_lines() if line is not None] if hasattr(code, "co_lines") else []
    return bool(lines) and min(code.co_firstlineno, *lines) <= lineno <= max(lines)


def _short(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if relative.startswith("..") else relative
