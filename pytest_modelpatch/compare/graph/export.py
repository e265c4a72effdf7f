"""Export parity: the patched model still goes through ``torch.export`` and computes what the reference computes.

The patched model is exported with the test's method and context patches active (how
onnx-diagnostic users export), through :class:`LogitsOnly`, a wrapper whose signature is
``(input_ids, attention_mask) -> logits`` so that output objects and caches stay out of the
graph. The ``ExportedProgram`` runs on the inputs and its logits are compared with the eager,
unpatched reference's through ``compare.outputs``. ``compare.graph.compile`` reuses the wrapper and
the report for ``torch.compile``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare.graph.dynamo_state import fresh_dynamo
from pytest_modelpatch.compare.check_report import CheckReport, given_inputs
from pytest_modelpatch.compare.outputs import TensorComparison, compare_outputs, describe_tolerances
from pytest_modelpatch.compare.running import describe_inputs, evaluating, model_device, placement
from pytest_modelpatch.compare.same_model import check_same_model
from pytest_modelpatch.compare.sharded import sharding_kind
from pytest_modelpatch.compare.tolerance import TolerancePolicy, ToleranceSpec, resolve_tolerance
from pytest_modelpatch.compare.graph.trace_failures import SourceLocation, TraceFailure, describe_failure
from pytest_modelpatch.errors import ModelPatchError

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


def logits_inputs(reference: torch.nn.Module, inputs: Mapping[str, Any] | torch.Tensor | None) -> dict[str, torch.Tensor]:
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


def skip_sharded(patched: torch.nn.Module) -> None:
    """Skip the running test when ``patched`` is sharded: ``torch.export`` cannot trace it (measured on torch 2.13).

    Under tensor parallelism it breaks in transformers' own sharding hooks (DTensor inputs); FSDP2
    and DDP wrap the forward in hooks and collectives it does not trace either. ``torch.compile``
    runs on them, so ``assert_compiles_equivalent`` checks sharded models.
    """
    kind = sharding_kind(patched)
    if kind is not None:
        import pytest

        pytest.skip(
            f"torch.export cannot trace a model sharded by {kind} (torch {torch.__version__}): export the unsharded "
            "model, in a test without @pytest.mark.parallel; assert_compiles_equivalent runs on sharded models"
        )


# ---------------------------------------------------------------------------
# The report, shared with compare.graph.compile
# ---------------------------------------------------------------------------


@dataclass
class ParityReport(CheckReport):
    """Exporting or compiling a patched model, then comparing its logits with the eager reference's."""

    kind: str  # "export" | "compile"
    reference: str
    patched: str
    how: str  # e.g. "torch.export.export(strict=False), batch and sequence dynamic"
    tolerance: ToleranceSpec
    comparisons: list[TensorComparison] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    device: str = ""
    dtype: str = ""
    failure: TraceFailure | None = None
    graph_breaks: list[SourceLocation | str] = field(default_factory=list)
    max_graph_breaks: int | None = None
    notes: list[str] = field(default_factory=list)
    eager_patched: str = ""  # on a mismatch: whether the eager patched model matched, to tell a trace bug from a patch bug
    duration_s: float = 0.0

    @property
    def check_kind(self) -> str:  # type: ignore[override]
        return self.kind

    @property
    def too_many_breaks(self) -> bool:
        return self.max_graph_breaks is not None and len(self.graph_breaks) > self.max_graph_breaks

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.too_many_breaks and all(c.passed for c in self.comparisons)


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

    def __str__(self) -> str:
        where = f" ({self.dtype} on {self.device})" if self.device else ""
        lines = [*self.notes]
        if self.kind == "compile" and self.failure is None:
            lines.append(self.breaks_text())
            if self.too_many_breaks:
                lines.append(f"more than max_graph_breaks={self.max_graph_breaks}; first at {self.graph_breaks[0]}")
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
        return "\n".join([
            head, *lines, *([self.eager_patched] if self.eager_patched else []),
            *(f"inputs: {text}" for text in self.inputs), *describe_tolerances(failures), *(f"  {c}" for c in failures),
        ])  # fmt: skip

    def passing_detail(self) -> str:
        """How it was traced, with notes and (compile) graph breaks."""
        return "; ".join([self.how, *self.notes, *([self.breaks_text()] if self.kind == "compile" else [])])

    def row_fields(self) -> dict[str, Any]:
        # a trace that failed compared nothing: no error figures rather than zeros
        errors = {} if self.comparisons else {"max_abs_error": None, "max_rel_error": None}
        return {"examples": len(self.inputs), **errors}


def start_report(
    kind: str, how: str, reference: torch.nn.Module, patched: torch.nn.Module, tolerance: ToleranceSpec
) -> ParityReport:
    """An empty report naming both models, the device and the dtype."""
    return ParityReport(
        kind=kind, reference=type(reference).__name__, patched=type(patched).__name__, how=how, tolerance=tolerance,
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


def finish(report: ParityReport, start: float) -> ParityReport:
    """Time, record and judge a report: raise ``AssertionError`` with it when the check failed."""
    __tracebackhide__ = True
    report.duration_s = time.perf_counter() - start
    return report.conclude()


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


def second_shape(reference: torch.nn.Module, first: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs of another batch size and sequence length, inside the model's position limit."""
    from pytest_modelpatch.families.inputs import example_inputs

    batch, length = first["input_ids"].shape
    limit = getattr(reference.config.get_text_config(), "max_position_embeddings", None) or length + 3
    new_length = length + 3 if length + 3 <= limit else max(2, length - 3)
    return example_inputs(
        reference.config, batch_size=batch + 1, seq_len=new_length, seed=1,
        device=model_device(reference), model_class=type(reference),
    )  # fmt: skip


def dynamic_shapes(reference: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> tuple[dict[int, Any], ...]:
    """Batch and sequence of both inputs as ``torch.export.Dim``s, the sequence capped at the position limit."""
    from pytest_modelpatch.errors import PatchUsageError

    batch, length = inputs["input_ids"].shape
    if batch < 2 or length < 2:
        # torch specialises a dimension of size 0 or 1 in the example to a constant
        raise PatchUsageError(
            f"dynamic=True needs example inputs with batch and sequence >= 2 (got {batch}x{length}): torch.export "
            "fixes a dimension of size 1 to a constant. Pass larger inputs or none (the default is 2x8)."
        )
    limit = getattr(reference.config.get_text_config(), "max_position_embeddings", None)
    seq = torch.export.Dim("sequence", min=2, max=limit) if limit else torch.export.Dim("sequence", min=2)
    dims = {0: torch.export.Dim("batch", min=2), 1: seq}
    return (dims, dims)


def assert_exports_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any] | torch.Tensor | None = None,
    *,
    dynamic: bool = False,
    strict: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
) -> ParityReport:
    """Fail unless ``torch.export`` of ``patched`` works and its program's logits match the eager ``reference``.

    ``dynamic=True`` exports batch and sequence as ``torch.export.Dim`` and also compares at a
    second shape; ``strict`` is ``torch.export.export``'s. On an export failure the message
    names the line that broke it, the class it belongs to and torch's reason.

    Example::

        assert_exports_equivalent(reference_model, patched_model, dynamic=True)
    """
    __tracebackhide__ = True
    skip_without("torch.export.export", "torch.export.Dim")
    skip_sharded(patched)
    check_same_model(reference, patched, "assert_exports_equivalent")
    start = time.perf_counter()
    first = logits_inputs(reference, inputs)
    shapes = [first, second_shape(reference, first)] if dynamic else [first]
    how = f"torch.export.export(strict={strict})" + (", batch and sequence dynamic" if dynamic else "")
    report = start_report("export", how, reference, patched, resolve_tolerance(atol, rtol, policy))
    # strict export traces with dynamo, which leaves compiled code and module globals behind
    with fresh_dynamo() if strict else nullcontext(), evaluating(patched):
        export_and_compare(report, reference, patched, shapes, dynamic_shapes(reference, first) if dynamic else None, strict)
    return finish(report, start)


def export_and_compare(
    report: ParityReport,
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    shapes: list[dict[str, torch.Tensor]],
    dims: tuple[dict[int, Any], ...] | None,
    strict: bool,
) -> None:
    """Export ``LogitsOnly(patched)`` at the first shape and compare its program at every shape, into ``report``."""
    args = (shapes[0]["input_ids"], shapes[0]["attention_mask"])
    try:
        program = torch.export.export(LogitsOnly(patched), args, dynamic_shapes=dims, strict=strict)
    except Exception as error:  # every export failure is a finding about the patch, reported located
        if isinstance(error, ModelPatchError):
            raise
        report.failure = describe_failure(error, patched, report.how)
        return
    compare_traced(report, reference, patched, program.module(), shapes)
