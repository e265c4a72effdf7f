"""Compare a patched model's training step with the reference's: loss, outputs, every gradient.

``assert_backward_equivalent`` runs one seeded forward and backward of both models in train
mode with dropout off (``compare.backward.step``), compares the loss, the train-mode outputs, the
gradient of every parameter by qualified name and the gradient of the input embeddings, and
on a difference names the first module in backward order whose gradient diverges. Custom
``autograd.Function`` kernels, gradient checkpointing and ``if self.training`` paths are
invisible to the eval-mode forward check; this is where they are caught.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pytest_modelpatch.compare._engine.batched import compare_flat_batched
from pytest_modelpatch.compare._engine.blame import (
    ReplacedCall,
    blame_backward,
    capturing_replaced_calls,
    replaced_module_names,
)
from pytest_modelpatch.compare._engine.devices import placement, unwrapped
from pytest_modelpatch.compare._engine.divergence import Divergence, find_divergence
from pytest_modelpatch.compare._engine.inputs import default_inputs, describe_inputs
from pytest_modelpatch.compare._engine.outputs import TensorComparison, describe_tolerances, flatten_outputs
from pytest_modelpatch.compare._engine.reports import CheckReport, given_inputs
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.sharded import logical_tensors
from pytest_modelpatch.compare._engine.tolerance import (
    DEFAULT_POLICY,
    GRADIENT_POLICY,
    TolerancePolicy,
    ToleranceSpec,
    judged_as,
    resolve_tolerance,
)
from pytest_modelpatch.compare.backward.divergence import (
    BackwardCall,
    BackwardDivergence,
    backward_calls,
    first_backward_divergence,
)
from pytest_modelpatch.compare.backward.step import LossFn, TrainingRun, training_run, with_labels
from pytest_modelpatch.isolation.pristine import running_pristine
from pytest_modelpatch.models.usage import unused_message, unused_replacements

_LOSSES = ("loss", "outputs.loss")  # the model's loss, and the same value among its outputs


def gradient_tolerance(spec: ToleranceSpec) -> ToleranceSpec:
    """The tolerance gradients are judged by: ``spec``, with :data:`GRADIENT_POLICY` when no policy was chosen."""
    if spec.policy_source == "default" and spec.policy is DEFAULT_POLICY:
        return dataclasses.replace(spec, policy=GRADIENT_POLICY)
    return spec


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


@dataclass
class BackwardReport(CheckReport):
    """The outcome of comparing one training step of a patched model with its reference's."""

    check_kind = "backward"

    reference: str
    patched: str
    loss: TensorComparison | None
    loss_source: str
    loss_values: tuple[float, float]  # (reference, patched)
    outputs: list[TensorComparison]
    gradients: list[TensorComparison]  # parameter gradients by qualified name, then input embeddings
    tolerance: ToleranceSpec
    gradient_tolerance: ToleranceSpec
    inputs: str = ""
    device: str = ""
    dtype: str = ""
    checkpointing: str = "off"
    conversions: str = ""  # how gradients were mapped through weight conversions, when they were
    divergence: BackwardDivergence | Divergence | None = None  # Divergence: the train-mode forward differs
    duration_s: float = 0.0
    unused: str = ""
    # outputs one side returns and the other leaves None or out: a fused loss kernel's logits=None in
    # training (Liger-Kernel's linear-cross-entropy); the loss and every gradient are what it must match
    one_sided: list[TensorComparison] = dataclasses.field(default_factory=list)

    @property
    def comparisons(self) -> list[TensorComparison]:
        return ([self.loss] if self.loss is not None else []) + self.outputs + self.gradients

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons) and not self.unused

    @property
    def worst_gradient(self) -> TensorComparison | None:
        """The parameter gradient that erred most: a failing one first, then by max abs error."""
        params = [c for c in self.gradients if not c.path.startswith("input_embeddings")]
        return max(params, key=lambda c: (not c.passed, c.problem is None, c.max_abs), default=None)

    def _loss_line(self) -> str:
        if self.loss is None:
            return f"loss ({self.loss_source}): not compared"
        c, (ref, pat) = self.loss, self.loss_values
        verdict = "ok" if c.passed else f"over tolerance, {c.tolerance}" if c.problem is None else c.problem
        return f"loss ({self.loss_source}): reference {ref:.6g}, patched {pat:.6g}, difference {abs(pat - ref):.3g} ({verdict})"

    @property
    def _one_sided_line(self) -> list[str]:
        if not self.one_sided:
            return []
        return [f"held by one side only, not compared: {'; '.join(str(c) for c in self.one_sided)}"]

    def __str__(self) -> str:
        where = f" ({self.dtype} on {self.device}, gradient checkpointing {self.checkpointing})" if self.device else ""
        count = f"{len(self.gradients)} gradients, {len(self.outputs)} outputs and the loss"
        if self.passed:
            return "\n".join([
                f"patched {self.patched} trains like reference {self.reference}{where}: {count}, "
                f"max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}",
                f"tolerance: outputs {self.tolerance}; gradients {self.gradient_tolerance}",
                *self._one_sided_line,
                *([self.conversions] if self.conversions else []),
            ])  # fmt: skip
        worst = self.worst_gradient
        failures = self.failures
        lines = [
            f"patched {self.patched} differs from reference {self.reference} in training{where}: "
            f"{len(failures)} of {len(self.comparisons)} compared ({count}) differ",
            *([self.unused] if self.unused else []),
            self._loss_line(),
            f"worst parameter gradient: {worst}" if worst is not None else "no parameter gradients compared",
            *self._one_sided_line,
            *([self.conversions] if self.conversions else []),
            f"inputs: {self.inputs}",
            *describe_tolerances(failures),
            *(f"  {c}" for c in failures[:12]),
            *([f"  ... and {len(failures) - 12} more"] if len(failures) > 12 else []),
        ]
        if isinstance(self.divergence, Divergence):
            lines.append("the train-mode forward already differs, so the search starts there:")
        if self.divergence is not None:
            lines.append(str(self.divergence))
        return "\n".join(lines)

    def judged_comparison(self) -> TensorComparison | None:
        """The tolerance of whatever erred most, a gradient or an output: the row shows that one."""
        return max(self.comparisons, key=lambda c: c.max_abs, default=None)


# ---------------------------------------------------------------------------
# Gradients through weight conversions
# ---------------------------------------------------------------------------


def checkpoint_gradients(
    model: torch.nn.Module, gradients: Mapping[str, torch.Tensor | None]
) -> tuple[dict[str, Any], str]:
    """Gradients under the checkpoint's names: through the reverse of the model's weight conversions.

    A model loaded with conversions (a fused ``qkv_proj``) keeps them (``_weight_conversions``,
    transformers 5.x); they are rearrangements, so gradients follow the weights exactly as
    ``save_pretrained`` maps the weights back. Returns the gradients and a line saying what was done.
    """
    conversions = getattr(model, "_weight_conversions", None)
    if not conversions:  # a sharded model's gradients made whole all the same
        return logical_tensors(model, gradients), ""
    from transformers.core_model_loading import revert_weight_conversion

    # a sharded model's gradients whole and in the checkpoint's layout first (fused ones are packed per rank)
    present = logical_tensors(model, {name: grad for name, grad in gradients.items() if grad is not None})
    mapped: dict[str, Any] = dict(revert_weight_conversion(model, present))
    missing = {name: None for name, grad in gradients.items() if grad is None}
    names = ", ".join(
        sorted({type(op).__name__ for c in conversions for op in getattr(c, "operations", [])}) or {"renamings"}
    )
    note = (
        f"gradients of the patched {type(model).__name__} compared under the checkpoint's parameter names, through "
        f"the reverse of its weight conversions ({names})"
    )
    return {**missing, **mapped}, note


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


def _checkpointing(enabled: bool, kwargs: Mapping[str, Any] | None) -> tuple[Mapping[str, Any] | None, str]:
    if not enabled and kwargs is None:
        return None, "off"
    chosen = dict(kwargs) if kwargs is not None else {"use_reentrant": False}  # transformers' default
    return chosen, "reentrant" if chosen.get("use_reentrant") else "non-reentrant"


def compare_training(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any],
    spec: ToleranceSpec,
    *,
    loss: LossFn | None = None,
    checkpointing: Mapping[str, Any] | None = None,
    checkpointing_label: str = "off",
    locate: bool = True,
) -> BackwardReport:
    """One training step of each model on ``inputs``, compared; on a difference, locate it."""
    start = time.perf_counter()
    grad_spec = gradient_tolerance(spec)
    ref = training_run(reference, inputs, loss=loss, checkpointing=checkpointing, around_backward=running_pristine)
    pat = training_run(patched, inputs, loss=loss, checkpointing=checkpointing)
    report = _report(reference, patched, inputs, ref, pat, spec, grad_spec, checkpointing_label)
    if locate and not report.passed:
        report.divergence = _locate(reference, patched, inputs, loss, report, grad_spec)
    report.duration_s = time.perf_counter() - start
    return report


def _report(
    reference: torch.nn.Module, patched: torch.nn.Module, inputs: Mapping[str, Any], ref: TrainingRun, pat: TrainingRun,
    spec: ToleranceSpec, grad_spec: ToleranceSpec, checkpointing: str,
) -> BackwardReport:  # fmt: skip
    ref_all = {"loss": ref.loss, **dict(flatten_outputs(ref.outputs, "outputs"))}
    pat_all = {"loss": pat.loss, **dict(flatten_outputs(pat.outputs, "outputs"))}
    # the loss is float32 whatever precision computed it (transformers upcasts the logits): judged at
    # the model's, as the training check judges it; "loss" first, "outputs.loss" and the outputs after
    dtype = placement(reference)["dtype"]
    loss_spec = judged_as(spec, dtype) if dtype else spec
    part = lambda flat, losses: {k: v for k, v in flat.items() if (k in _LOSSES) == losses}  # noqa: E731
    loss, *outputs = [
        *compare_flat_batched(part(ref_all, True), part(pat_all, True), loss_spec),
        *compare_flat_batched(part(ref_all, False), part(pat_all, False), spec),
    ]
    one_sided = [c for c in outputs if c.one_sided]
    outputs = [c for c in outputs if not c.one_sided]
    ref_grads, ref_note = checkpoint_gradients(reference, ref.gradients)
    pat_grads, pat_note = checkpoint_gradients(patched, pat.gradients)
    # parameters' and input embeddings' gradients in one batched pass (their names cannot clash)
    gradients = compare_flat_batched(
        {**ref_grads, **ref.input_gradients}, {**pat_grads, **pat.input_gradients}, grad_spec
    )
    return BackwardReport(
        reference=type(reference).__name__, patched=type(patched).__name__,
        loss=loss, loss_source=ref.loss_source,
        loss_values=(float(ref.loss), float(pat.loss)),
        outputs=outputs, gradients=gradients, tolerance=spec, gradient_tolerance=grad_spec, one_sided=one_sided,
        inputs=describe_inputs(inputs), checkpointing=checkpointing, conversions=pat_note or ref_note,
        **placement(reference),
    )  # fmt: skip


def _locate(
    reference: torch.nn.Module, patched: torch.nn.Module, inputs: Mapping[str, Any], loss: LossFn | None,
    report: BackwardReport, spec: ToleranceSpec,
) -> BackwardDivergence | Divergence | None:  # fmt: skip
    """The first diverging module: in the train-mode forward when outputs differ, else in the backward.

    The backward search is a second step of each model, without checkpointing, with full
    backward hooks on every module.
    """
    if not all(c.passed for c in [*report.outputs, *([report.loss] if report.loss else [])]):
        return find_divergence(reference, patched, inputs, report.tolerance, train=True)
    calls: tuple[list[BackwardCall], list[BackwardCall]] = ([], [])
    replaced: list[ReplacedCall] = []
    try:
        with (
            backward_calls(reference, calls[0]),
            capturing_replaced_calls(reference, replaced_module_names(reference, patched), replaced),
        ):
            training_run(reference, inputs, loss=loss, around_backward=running_pristine)
        with backward_calls(patched, calls[1]):
            training_run(patched, inputs, loss=loss)
    except RuntimeError as error:  # full backward hooks refuse modules that modify their outputs in place
        report.conversions = "\n".join(
            filter(None, [report.conversions, f"first diverging module not located: {error}"])
        )
        return None
    failing = {c.path: c for c in report.gradients if not c.passed}
    found = first_backward_divergence(calls[0], calls[1], failing, spec)
    if found is not None:
        found.blame = blame_backward(reference, patched, replaced, spec)
    return found


def assert_backward_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any] | torch.Tensor | None = None,
    *,
    gradient_checkpointing: bool = False,
    gradient_checkpointing_kwargs: Mapping[str, Any] | None = None,
    loss: LossFn | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> BackwardReport:
    """Fail unless one training step of ``patched`` computes what ``reference``'s does; returns the report.

    Both models run in train mode with dropout off, under one seed, on the same inputs (default:
    drawn from the config, with labels). The loss is the model's own, ``loss(outputs)``, or a
    fixed random projection of the outputs (:func:`~pytest_modelpatch.compare.backward.step.default_reduction`).
    Compared: the loss, the outputs, every parameter's gradient by name (through the patched
    model's weight conversions) and the input embeddings' gradient. Both models are left as found.

    Example::

        assert_backward_equivalent(reference_model, patched_model)
        assert_backward_equivalent(ref, pat, gradient_checkpointing=True,
                                   gradient_checkpointing_kwargs={"use_reentrant": True})
    """
    __tracebackhide__ = True
    require_same_model(reference, patched, "assert_backward_equivalent")
    inputs = given_inputs(inputs, lambda: with_labels(reference, default_inputs(reference)))
    checkpointing, label = _checkpointing(gradient_checkpointing, gradient_checkpointing_kwargs)
    report = compare_training(
        reference, patched, inputs, resolve_tolerance(atol, rtol, policy),
        loss=loss, checkpointing=checkpointing, checkpointing_label=label,
    )  # fmt: skip
    unused = [u.replacement for u in unused_replacements(unwrapped(patched))]
    if unused and not allow_unused:
        report.unused = unused_message(unused, where="the compared training step")
    return report.conclude()
