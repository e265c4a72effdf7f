"""What export and compile parity share: the traced forward, its inputs, the report, the comparison.

:class:`LogitsOnly` wraps a model as ``(input_ids, attention_mask) -> logits``, so that output
objects and caches stay out of the graph; :func:`compare_traced` runs what was exported or compiled
on each input and compares its logits with the eager, unpatched reference's through
``compare._engine.outputs``; :class:`ParityReport` is the report both checks end with.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from pytest_modelpatch.compare._engine.devices import evaluating, model_device, placement, unwrapped
from pytest_modelpatch.compare._engine.inputs import describe_inputs
from pytest_modelpatch.compare._engine.outputs import TensorComparison, compare_outputs, describe_tolerances
from pytest_modelpatch.compare._engine.reports import CheckReport, given_inputs
from pytest_modelpatch.compare._engine.tolerance import ToleranceSpec
from pytest_modelpatch.compare.graph.trace_failures import TraceFailure
from pytest_modelpatch.models.usage import unused_message, unused_replacements

# ---------------------------------------------------------------------------
# The traced forward
# ---------------------------------------------------------------------------


class LogitsOnly(torch.nn.Module):
    """``model(input_ids, attention_mask, use_cache=False).logits`` as a module: what gets exported or compiled.

    Example: ``torch.export.export(LogitsOnly(model), (ids, mask))``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def logits_inputs(
    reference: torch.nn.Module, inputs: Mapping[str, Any] | torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` on the model's device: from ``inputs``, else drawn from the config."""
    from pytest_modelpatch.errors import PatchUsageError
    from pytest_modelpatch.families.inputs import example_inputs

    device = model_device(reference)
    inputs = given_inputs(inputs, lambda: example_inputs(reference.config, device=device, model_class=type(reference)))
    extra = sorted(set(inputs) - {"input_ids", "attention_mask"})
    if "input_ids" not in inputs or extra:
        raise PatchUsageError(
            f"export and compile checks trace (input_ids, attention_mask) -> logits; got inputs {sorted(inputs)}. "
            "Pass a tensor of input ids or a dict with input_ids and, optionally, attention_mask."
        )
    ids = inputs["input_ids"].to(device)
    mask = inputs.get("attention_mask")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids) if mask is None else mask.to(device)}


def eager_logits(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits in eager mode; a reference model runs pristine through its own hooks."""
    with evaluating(model):
        return LogitsOnly(model)(inputs["input_ids"], inputs["attention_mask"])


def shape_label(inputs: Mapping[str, torch.Tensor]) -> str:
    """``2x8``: batch x sequence of the inputs, used to name compared outputs (``logits_2x8``)."""
    return "x".join(str(n) for n in inputs["input_ids"].shape)


def _missing_api(*names: str) -> str:
    """The first of ``torch.export.export``-style dotted names the installed torch lacks, or ``""``."""
    for name in names:
        value: Any = torch
        for part in name.split(".")[1:]:
            value = getattr(value, part, None)
        if value is None:
            return name
    return ""


def skip_without(*names: str) -> None:
    """Skip the running test when the installed torch lacks one of ``names`` (e.g. ``torch.export.Dim``)."""
    missing = _missing_api(*names)
    if missing:
        import pytest

        pytest.skip(f"torch {torch.__version__} has no {missing}, which this check needs; install torch>=2.4")


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


@dataclass
class ParityReport(CheckReport):
    """Exporting or compiling a patched model, then comparing its logits with the eager reference's.

    :class:`~pytest_modelpatch.compare.graph.export.ExportReport` and
    :class:`~pytest_modelpatch.compare.graph.compile.CompileReport` say which, and add what only
    their trace has (graph breaks) through :meth:`trace_lines` and :meth:`passed`.
    """

    reference: str
    patched: str
    how: str  # e.g. "torch.export.export(strict=False), batch and sequence dynamic"
    tolerance: ToleranceSpec
    comparisons: list[TensorComparison] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    device: str = ""
    dtype: str = ""
    failure: TraceFailure | None = None
    notes: list[str] = field(default_factory=list)
    eager_patched: str = (
        ""  # on a mismatch: whether the eager patched model matched, to tell a trace bug from a patch bug
    )
    duration_s: float = 0.0
    unused: str = ""  # why the check proves nothing about some replacement, when one never ran

    @property
    def passed(self) -> bool:
        return self.failure is None and all(c.passed for c in self.comparisons) and not self.unused

    def trace_lines(self) -> list[str]:
        """What the trace itself found, shown when it did not fail (a compile's graph breaks)."""
        return []

    def __str__(self) -> str:
        where = f" ({self.dtype} on {self.device})" if self.device else ""
        lines = [*self.notes, *(self.trace_lines() if self.failure is None else [])]
        if self.failure is not None:
            return "\n".join([str(self.failure), *lines])
        if self.passed:
            head = (
                f"{self.how} of patched {self.patched} matches eager reference {self.reference}{where}: "
                f"{len(self.comparisons)} outputs, max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}"
            )
            return "\n".join([head, *lines, f"tolerance: {self.tolerance}"])
        failures = [c for c in self.comparisons if not c.passed]
        head = f"{self.how} of patched {self.patched} differs from eager reference {self.reference}{where}"
        if failures:
            head += f" in {len(failures)} of {len(self.comparisons)} outputs"
        elif self.unused:
            head = f"{self.how} of patched {self.patched} matches eager reference {self.reference}{where}, but proves"
            head += " nothing about a replacement:"
        return "\n".join([
            head, *lines, *([self.unused] if self.unused else []), *([self.eager_patched] if self.eager_patched else []),
            *(f"inputs: {text}" for text in self.inputs), *describe_tolerances(failures), *(f"  {c}" for c in failures),
        ])  # fmt: skip

    def passing_detail(self) -> str:
        """How it was traced, with notes and what the trace found."""
        return "; ".join([self.how, *self.notes, *self.trace_lines()])

    def row_fields(self) -> dict[str, Any]:
        # a trace that failed compared nothing: no error figures rather than zeros
        errors = {} if self.comparisons else {"max_abs_error": None, "max_rel_error": None}
        return {"examples": len(self.inputs), **errors}


R = TypeVar("R", bound=ParityReport)


def start_report(
    kind: type[R], how: str, reference: torch.nn.Module, patched: torch.nn.Module, tolerance: ToleranceSpec
) -> R:
    """An empty report of ``kind`` naming both models, the device and the dtype."""
    return kind(
        reference=type(reference).__name__, patched=type(patched).__name__, how=how, tolerance=tolerance,
        **placement(reference),
    )  # fmt: skip


def compare_traced(
    report: ParityReport,
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    traced: Any,
    shapes: list[dict[str, torch.Tensor]],
) -> None:
    """Run ``traced`` (an exported or compiled forward) on each inputs and compare with the eager reference."""
    for inputs in shapes:
        with torch.no_grad():
            got = traced(inputs["input_ids"], inputs["attention_mask"])
        expected = eager_logits(reference, inputs)
        label = f"logits_{shape_label(inputs)}"  # an identifier, so the path reads logits_2x8
        report.comparisons += compare_outputs({label: expected}, {label: got}, report.tolerance)
        report.inputs.append(describe_inputs(inputs))
    if not report.passed:
        eager = compare_outputs(eager_logits(reference, shapes[0]), eager_logits(patched, shapes[0]), report.tolerance)
        same = all(c.passed for c in eager)
        report.eager_patched = (
            "the eager patched model matches the reference: the difference comes from tracing, not from the patch"
            if same else "the eager patched model differs too: run assert_equivalent for the first diverging module"
        )  # fmt: skip


def judge_usage(report: ParityReport, patched: torch.nn.Module, inputs: dict[str, torch.Tensor], allow: bool) -> None:
    """Fail a traced check whose patched model never ran a replacement on ``inputs``, unless ``allow``.

    A traced graph runs no forward hooks, so one eager forward of the patched model on the first
    inputs counts what ran, as ``assert_equivalent`` counts it. A trace that failed is judged by that.
    """
    if allow or report.failure is not None:
        return
    with torch.no_grad():
        eager_logits(patched, inputs)
    unused = [u.replacement for u in unused_replacements(unwrapped(patched))]
    if unused:
        report.unused = unused_message(unused, where="an eager forward on the traced inputs")


def finish(report: R, start: float) -> R:
    """Time, record and judge a report: raise ``AssertionError`` with it when the check failed."""
    __tracebackhide__ = True
    report.duration_s = time.perf_counter() - start
    return report.conclude()
