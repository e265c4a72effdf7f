"""Compile parity: ``torch.compile`` of the patched model computes what the eager reference computes.

The compiled forward is :class:`~pytest_modelpatch.compare.graph.parity.LogitsOnly` around the
patched model. A recording backend sits in front of the real one: dynamo hands it every graph
it captured, with the reason the graph ended, so graph breaks are counted and located in the
same compile that produces the numbers (no second trace, as ``torch._dynamo.explain`` would
need). Dynamo's caches are reset before and after, so nothing compiled outlives the check.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import evaluating
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.tolerance import TolerancePolicy, resolve_tolerance
from pytest_modelpatch.compare.graph.dynamo_state import fresh_dynamo
from pytest_modelpatch.compare.graph.parity import (
    LogitsOnly,
    ParityReport,
    compare_traced,
    finish,
    judge_usage,
    logits_inputs,
    skip_without,
    start_report,
)  # fmt: skip
from pytest_modelpatch.compare.graph.trace_failures import SourceLocation, describe_failure, locate, user_frames
from pytest_modelpatch.errors import ModelPatchError

_COMPILERS = ("g++", "c++", "clang++", "cc", "gcc", "clang")


@dataclass
class CompileReport(ParityReport):
    """``torch.compile`` of a patched model against the eager reference, with its graph breaks located."""

    check_kind = "compile"
    graph_breaks: list[SourceLocation | str] = field(default_factory=list)
    max_graph_breaks: int | None = None

    @property
    def too_many_breaks(self) -> bool:
        return self.max_graph_breaks is not None and len(self.graph_breaks) > self.max_graph_breaks

    @property
    def passed(self) -> bool:
        return super().passed and not self.too_many_breaks

    def breaks_text(self) -> str:
        """``2 graph breaks: file.py:12 (LlamaMLP.forward) x2``, grouped by location."""
        if not self.graph_breaks:
            return "no graph breaks"
        counts: dict[str, int] = {}
        for where in self.graph_breaks:
            text = where.short if isinstance(where, SourceLocation) else where
            counts[text] = counts.get(text, 0) + 1
        places = "; ".join(f"{text} x{n}" if n > 1 else text for text, n in counts.items())
        plural = "s" if len(self.graph_breaks) != 1 else ""
        return f"{len(self.graph_breaks)} graph break{plural}: {places}"

    def trace_lines(self) -> list[str]:
        lines = [self.breaks_text()]
        if self.too_many_breaks:
            lines.append(f"more than max_graph_breaks={self.max_graph_breaks}; first at {self.graph_breaks[0]}")
        return lines


def default_backend() -> tuple[str, str]:
    """``("inductor", "")`` when a C++ compiler is on PATH (inductor needs one on CPU), else ``("aot_eager", note)``."""
    if any(shutil.which(name) for name in _COMPILERS):
        return "inductor", ""
    return (
        "aot_eager",
        "backend aot_eager: no C++ compiler on PATH for inductor (install g++ to test inductor's kernels)",
    )


class GraphRecorder:
    """A ``torch.compile`` backend that notes each graph's break reason, then compiles it with ``inner``."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.graphs = 0
        self.breaks: list[Any] = []  # dynamo's GraphCompileReason for every graph that ended at a break

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        reason = getattr(graph, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            self.breaks.append(reason)
        return self.inner(graph, example_inputs)


def inner_backend(backend: str | Callable[..., Any], mode: str | None, dynamic: bool | None) -> Callable[..., Any]:
    """The compiler function ``torch.compile(backend=backend, mode=mode)`` would use."""
    from pytest_modelpatch.errors import PatchUsageError

    if mode not in (None, "default"):
        if backend != "inductor":
            raise PatchUsageError(f"mode={mode!r} is an inductor option; backend={backend!r} takes none. Drop mode=.")
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        options = list_mode_options(mode, dynamic)
        return lambda graph, example_inputs: compile_fx(graph, example_inputs, config_patches=options)
    return torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend


def break_location(reason: Any, model: torch.nn.Module) -> SourceLocation | str:
    """Where a graph break happened (innermost user frame), or its reason when dynamo kept no frames."""
    location = locate(user_frames(getattr(reason, "user_stack", None) or []), model)
    return location or str(getattr(reason, "reason", reason)).splitlines()[0]


def compile_and_compare(
    report: CompileReport,
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    inner: Callable[..., Any],
    fullgraph: bool,
    dynamic: bool | None,
) -> None:
    """Compile ``LogitsOnly(patched)``, compare it on ``inputs``, and note its graph breaks in ``report``."""
    recorder = GraphRecorder(inner)
    compiled = torch.compile(LogitsOnly(patched), backend=recorder, fullgraph=fullgraph, dynamic=dynamic)
    try:
        compare_traced(report, reference, patched, compiled, [inputs])
    except Exception as error:  # a compile failure (fullgraph break, backend error) is a finding, located
        if isinstance(error, (ModelPatchError, AssertionError)):
            raise
        report.failure = describe_failure(error, patched, report.how)
    report.graph_breaks = [break_location(reason, patched) for reason in recorder.breaks]


def assert_compiles_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any] | torch.Tensor | None = None,
    *,
    fullgraph: bool = False,
    backend: str | Callable[..., Any] | None = None,
    mode: str | None = None,
    dynamic: bool | None = None,
    max_graph_breaks: int | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> CompileReport:
    """Fail unless ``torch.compile`` of ``patched`` matches the eager ``reference``; graph breaks counted and located.

    ``backend=None`` is inductor where a C++ compiler exists, else aot_eager (noted in the report).
    ``fullgraph=True`` makes a graph break a failure located at its line; ``max_graph_breaks``
    fails the check beyond that many breaks. Inductor's default tolerance is the ``loose`` policy.
    A replacement class that never ran (counted on one eager forward) fails the check, unless
    ``allow_unused=True``.

    Example::

        report = assert_compiles_equivalent(reference_model, patched_model, backend="aot_eager")
        print(report.breaks_text())   # "no graph breaks"
    """
    __tracebackhide__ = True
    skip_without("torch.compile", "torch._dynamo.reset", "torch._dynamo.lookup_backend")
    if not torch._dynamo.is_dynamo_supported():
        import pytest

        pytest.skip(f"torch.compile is not supported with torch {torch.__version__} on this Python")
    require_same_model(reference, patched, "assert_compiles_equivalent")
    start = time.perf_counter()
    note = ""
    if backend is None:
        backend, note = default_backend()
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    options = [f"backend={name!r}", f"fullgraph={fullgraph}"]
    options += [f"mode={mode!r}"] * (mode is not None) + [f"dynamic={dynamic}"] * (dynamic is not None)
    spec = resolve_tolerance(atol, rtol, policy)
    if spec.policy_source == "default" and name == "inductor":
        # inductor fuses and reorders floating-point work: ten times the eager default
        spec = resolve_tolerance(atol, rtol, "loose")
    report = start_report(CompileReport, f"torch.compile({', '.join(options)})", reference, patched, spec)
    report.notes += [note] if note else []
    report.max_graph_breaks = max_graph_breaks
    first = logits_inputs(reference, inputs)
    with fresh_dynamo(), evaluating(patched):
        # in a function of its own, so the compiled module is gone before dynamo is reset
        compile_and_compare(
            report, reference, patched, first, inner_backend(backend, mode, dynamic), fullgraph, dynamic
        )
    judge_usage(report, patched, first, allow_unused)
    return finish(report, start)
