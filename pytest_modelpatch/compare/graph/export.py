"""Export parity: the patched model still goes through ``torch.export`` and computes what the reference computes.

The patched model is exported with the test's method and context patches active (how
onnx-diagnostic users export), through :class:`~pytest_modelpatch.compare.graph.parity.LogitsOnly`;
the ``ExportedProgram`` runs on the inputs and its logits are compared with the eager, unpatched
reference's (:mod:`.parity`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import evaluating, model_device
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.sharded import sharding_kind
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
from pytest_modelpatch.compare.graph.trace_failures import describe_failure
from pytest_modelpatch.errors import ModelPatchError


@dataclass
class ExportReport(ParityReport):
    """``torch.export`` of a patched model, then its program's logits against the eager reference's."""

    check_kind = "export"


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
# The check
# ---------------------------------------------------------------------------


def second_shape(reference: torch.nn.Module, first: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs of another batch size and sequence length, inside the model's position limit."""
    from pytest_modelpatch.families.inputs import example_inputs

    batch, length = first["input_ids"].shape
    config: Any = reference.config  # a transformers config: torch reads a module's attributes as Tensor | Module
    limit = getattr(config.get_text_config(), "max_position_embeddings", None) or length + 3
    new_length = length + 3 if length + 3 <= limit else max(2, length - 3)
    return example_inputs(
        config, batch_size=batch + 1, seq_len=new_length, seed=1,
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
    config: Any = reference.config  # a transformers config: torch reads a module's attributes as Tensor | Module
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
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
    allow_unused: bool = False,
) -> ExportReport:
    """Fail unless ``torch.export`` of ``patched`` works and its program's logits match the eager ``reference``.

    ``dynamic=True`` exports batch and sequence as ``torch.export.Dim`` and also compares at a
    second shape; ``strict`` is ``torch.export.export``'s. On an export failure the message
    names the line that broke it, the class it belongs to and torch's reason. A replacement class
    that never ran (counted on one eager forward) fails the check, unless ``allow_unused=True``.

    Example::

        assert_exports_equivalent(reference_model, patched_model, dynamic=True)
    """
    __tracebackhide__ = True
    skip_without("torch.export.export", "torch.export.Dim")
    skip_sharded(patched)
    require_same_model(reference, patched, "assert_exports_equivalent")
    start = time.perf_counter()
    first = logits_inputs(reference, inputs)
    shapes = [first, second_shape(reference, first)] if dynamic else [first]
    how = f"torch.export.export(strict={strict})" + (", batch and sequence dynamic" if dynamic else "")
    report = start_report(ExportReport, how, reference, patched, resolve_tolerance(atol, rtol, policy))
    # strict export traces with dynamo, which leaves compiled code and module globals behind
    with fresh_dynamo() if strict else nullcontext(), evaluating(patched):
        export_and_compare(
            report, reference, patched, shapes, dynamic_shapes(reference, first) if dynamic else None, strict
        )
    judge_usage(report, patched, first, allow_unused)
    return finish(report, start)


def export_and_compare(
    report: ExportReport,
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
