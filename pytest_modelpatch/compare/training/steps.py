"""Train both models for a few optimizer steps and compare them step by step: ``assert_trains_equivalent``.

``assert_backward_equivalent`` compares one forward and backward. The bugs kernel users meet in
training often show only later: a weight packed once and used after the optimizer changed it, a
loss that ignores ``num_items_in_batch`` under gradient accumulation, a tie that breaks, a norm
whose weight never trains. This check runs the same optimizer steps on both models from the same
weights and batches (as Liger-Kernel's convergence tests do, with the per-step figures they
compare) and judges, at every step, the loss and the gradient norm; after the last step every
parameter (by the checkpoint's names, through weight conversions) and the top-k log-probabilities
of an eval batch. Gradient accumulation is transformers' Trainer's: micro-batches with different
numbers of real tokens, ``num_items_in_batch`` passed to a model that takes loss keywords, the loss
divided by the steps otherwise. A bfloat16 or float16 reference's own drift is the yardstick of
each step (``compare.training.drift``). Both models are put back as found: weights, buffers,
gradients, modes and the random state.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.batched import compare_flat_batched
from pytest_modelpatch.compare._engine.devices import model_device, placement, unwrapped
from pytest_modelpatch.compare._engine.divergence import Divergence, find_divergence
from pytest_modelpatch.compare._engine.inputs import describe_inputs
from pytest_modelpatch.compare._engine.outputs import TensorComparison, compare_tensors, describe_tolerances
from pytest_modelpatch.compare._engine.precision import ieee_float32
from pytest_modelpatch.compare._engine.reports import CheckReport
from pytest_modelpatch.compare._engine.running import forward
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.sharded import (
    local_part,
    logical_tensors,
    nonzero_anywhere,
    ranks_disagree,
    resharded,
    sharding_kind,
)  # fmt: skip
from pytest_modelpatch.compare._engine.ties import tie_differences
from pytest_modelpatch.compare._engine.tolerance import (
    DEFAULT_POLICY,
    GRADIENT_POLICY,
    TRAINING_POLICY,
    TolerancePolicy,
    ToleranceSpec,
    resolve_tolerance,
)  # fmt: skip
from pytest_modelpatch.compare._engine.train_mode import as_configured, data_parallel_inner, training_state
from pytest_modelpatch.compare.backward.equivalence import checkpoint_gradients
from pytest_modelpatch.compare.backward.step import LossFn, training_loss, with_labels
from pytest_modelpatch.compare.training.drift import (
    DRIFT_FACTOR,
    Bias,
    DriftFigures,
    biases,
    holding_weights_of,
    in_float32,
    low_precision,
    shared_weights_figures,
)  # fmt: skip
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.pristine import running_pristine
from pytest_modelpatch.models.devices import seed_generators
from pytest_modelpatch.models.usage import unused_message, unused_replacements

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

# Round-off compounds over updates: step s is judged at (1 + s * GROWTH) times the tolerance, the
# final parameters and eval log-probabilities at the last step's (bf16 losses: 9.7e-4 at step 0,
# 5.9e-3 at step 7: about linear).
GROWTH = 0.25
# Adam moves each weight by about lr times the sign of its (averaged) gradient, whatever the
# gradient's size: a gradient that round-off tips across zero moves it 2 x lr the other way. So
# after step s (0-based) the default AdamW's weights may differ by up to 2.5 x lr x (s + 1) each
# (measured: bf16 at lr 1e-2, 0.02 after the first step, on a correct kernel); the loss and the
# gradient norm, not the weights, are where a small bug shows.
ADAM_SIGN_STEPS = 2.5
TOP_K = 20


def _grown(
    spec: ToleranceSpec, factor: float, default: TolerancePolicy, dtype: str | None = None, plus_atol: float = 0.0,
) -> ToleranceSpec:  # fmt: skip
    """``spec`` (with ``default`` in place of the default policy) with every tolerance times ``factor``.

    ``dtype``: judge every tensor as this dtype (the model's: its loss and gradient norm are
    compared as float32 numbers, with the tolerance of the precision that computed them).
    ``plus_atol``: added to the absolute term (Adam's sign-of-the-gradient steps, see below).
    """
    policy = default if spec.policy_source == "default" and spec.policy is DEFAULT_POLICY else spec.policy
    entries = {k: policy.entry(dtype) if dtype else v for k, v in policy.per_dtype.items()}
    scaled = TolerancePolicy(
        policy.name, {k: dataclasses.replace(v, atol=v.atol * factor + plus_atol, rtol=v.rtol * factor, ulps=v.ulps * factor)
                      for k, v in entries.items()},
    )  # fmt: skip
    grow = lambda pair: None if pair is None else (pair[0] * factor + plus_atol, pair[1])  # noqa: E731
    return dataclasses.replace(spec, policy=scaled, atol=grow(spec.atol), rtol=grow(spec.rtol))


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


@dataclass
class TrainingStep:
    """One optimizer step of both models: the loss and the gradient norm compared, what diverged first."""

    step: int
    loss: TensorComparison
    grad_norm: TensorComparison
    losses: tuple[float, float]
    norms: tuple[float, float]
    parameter: str = ""  # the first parameter whose update diverged at this step

    @property
    def passed(self) -> bool:
        return self.loss.passed and self.grad_norm.passed and not self.parameter

    def __str__(self) -> str:
        def figure(name: str, pair: tuple[float, float], comparison: TensorComparison) -> str:
            verdict = (
                "ok"
                if comparison.passed
                else f"differs by {comparison.max_abs:.4g}, allowed {comparison.bound_at_worst:.3g}"
            )
            return f"{name} {pair[0]:.6g} / {pair[1]:.6g} ({verdict})"

        line = f"step {self.step}: {figure('loss', self.losses, self.loss)}, {figure('gradient norm', self.norms, self.grad_norm)}"
        return line + (f"; first parameter whose update diverged: {self.parameter}" if self.parameter else "")


@dataclass
class TrainingReport(CheckReport):
    """The outcome of training both models for ``steps`` optimizer steps on the same batches."""

    check_kind = "training"

    reference: str
    patched: str
    how: str  # "8 AdamW steps at lr 0.001, gradient accumulation 2"
    tolerance: ToleranceSpec
    steps: list[TrainingStep] = field(default_factory=list)
    parameters: list[TensorComparison] = field(default_factory=list)  # after the last step
    logprobs: TensorComparison | None = None
    ties: list[str] = field(default_factory=list)
    untrained: list[str] = field(default_factory=list)
    divergence: Divergence | None = None  # the first diverging module, at the first step whose loss diverged
    divergence_step: int = 0
    drifted: str = ""  # why no module is named: the weights had drifted apart everywhere by that step
    drift: DriftFigures | None = None  # a low-precision reference's own drift (compare.training.drift)
    biases: list[Bias] = field(default_factory=list)
    inputs: str = ""
    device: str = ""
    dtype: str = ""
    duration_s: float = 0.0
    note: str = ""
    unused: str = ""  # why the check proves nothing about some replacement, when one never ran

    @property
    def comparisons(self) -> list[TensorComparison]:
        found = [c for s in self.steps for c in (s.loss, s.grad_norm)] + self.parameters
        return found + ([self.logprobs] if self.logprobs is not None else [])

    @property
    def passed(self) -> bool:
        return (
            not self.ties and not self.untrained and all(c.passed for c in self.comparisons)
            and all(s.passed for s in self.steps) and all(b.passed for b in self.biases) and not self.unused
        )  # fmt: skip

    @property
    def first_failure(self) -> str:
        if self.ties:
            return "before any step: the tied parameters differ"
        step = next((s for s in self.steps if not s.passed), None)
        if step is not None:
            what = [
                n
                for n, ok in (
                    ("loss", step.loss.passed),
                    ("gradient norm", step.grad_norm.passed),
                    ("a parameter's update", not step.parameter),
                )
                if not ok
            ]
            return f"first diverging at step {step.step}: {', '.join(what)}"
        if self.untrained:
            return "a parameter the reference trains is never updated"
        leaning = [b.what for b in self.biases if not b.passed]
        if leaning:
            verb = "leans" if len(leaning) == 1 else "lean"
            return f"over the steps: the {' and the '.join(leaning)} {verb} one way on shared weights"
        if any(not c.passed for c in self.parameters):
            return f"after the last step: {sum(not c.passed for c in self.parameters)} of {len(self.parameters)} parameters differ"
        if self.unused and (self.logprobs is None or self.logprobs.passed):
            return "a replacement class never ran"
        return "after the last step: the eval log-probabilities differ"

    def __str__(self) -> str:
        where = f" ({self.dtype} on {self.device}, {self.how})" if self.device else f" ({self.how})"
        if self.passed:
            return f"patched {self.patched} trains as reference {self.reference} does{where}: {len(self.steps)} steps, max abs {self.max_abs_error:.3g}"
        lines = [
            f"patched {self.patched} trains differently from reference {self.reference}{where}: {self.first_failure}"
        ]
        lines += [f"tie: {line}" for line in self.ties]
        lines += [f"never trained: {line}" for line in self.untrained]
        lines += [self.unused] if self.unused else []
        lines += [f"  {step}" for step in _shown(self.steps)]
        failed = [c for c in self.parameters if not c.passed]
        if failed:
            lines.append(f"after the last step, {len(failed)} of {len(self.parameters)} parameters differ:")
            lines += [f"  {c}" for c in failed[:5]] + ([f"  ... and {len(failed) - 5} more"] if len(failed) > 5 else [])
        if self.logprobs is not None:
            lines.append(f"eval {self.logprobs}")
        lines += [str(b) for b in self.biases if not b.passed]
        lines += [f"inputs: {self.inputs}", *([self.note] if self.note else [])]
        first = next((s for s in self.steps if not s.passed), None)
        judged = [c for c in (first.loss, first.grad_norm) if not c.passed] if first is not None else []
        judged += [c for c in [*self.parameters, *([self.logprobs] if self.logprobs else [])] if not c.passed]
        lines += describe_tolerances(judged[:1] + [c for c in judged[1:] if c.tolerance != judged[0].tolerance][:1])
        lines.append(f"tolerances grow by {GROWTH:g} of the first step's with each step")
        if self.drift is not None:
            lines.append(
                f"each step also allows {DRIFT_FACTOR:g} x the largest drift so far of the reference trained in "
                f"float32 against itself in {self.dtype} (the loss's: {self.drift.envelope(len(self.steps))[0]:.3g} "
                "at the last step)"
            )
        if self.divergence is not None:
            lines.append(self.divergence.text(f"at step {self.divergence_step}, "))
        if self.drifted:
            lines.append(self.drifted)
        return "\n".join(lines)

    def judged_comparison(self) -> TensorComparison | None:
        return max(self.comparisons, key=lambda c: c.max_abs, default=None)


def _shown(steps: list[TrainingStep], limit: int = 12) -> list[Any]:
    """Every step of a short run; of a long one the first two, the first failing one with its neighbours, the last."""
    if len(steps) <= limit:
        return list(steps)
    first = next((s.step for s in steps if not s.passed), 0)
    keep = sorted({0, 1, first - 1, first, first + 1, len(steps) - 1} & set(range(len(steps))))
    shown: list[Any] = []
    for index in keep:
        if shown and isinstance(shown[-1], TrainingStep) and index - shown[-1].step > 1:
            shown.append("...")
        shown.append(steps[index])
    return shown


# ---------------------------------------------------------------------------
# Batches and one optimizer step, as transformers' Trainer runs it
# ---------------------------------------------------------------------------


def training_batches(model: torch.nn.Module, inputs: Any, steps: int, accumulation: int) -> list[list[dict[str, Any]]]:
    """``steps`` lists of ``accumulation`` micro-batches with labels: the given ones, or drawn from the config.

    Drawn micro-batches of one step hold different numbers of real tokens (right padding), as a
    data collator's do, so a loss that ignores ``num_items_in_batch`` weighs them wrongly.
    """
    if inputs is not None:
        given = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        if not given or not all(isinstance(b, Mapping) for b in given):
            raise PatchUsageError(
                "assert_trains_equivalent: inputs= is a dict of model inputs or a list of them, one per micro-batch"
            )
        batches = [with_labels(model, dict(b)) for b in given]
        return [[batches[(s * accumulation + m) % len(batches)] for m in range(accumulation)] for s in range(steps)]
    from pytest_modelpatch.families.inputs import example_inputs

    config, device = unwrapped(model).config, str(next(model.parameters()).device)
    drawn = []
    base = [
        example_inputs(config, seed=seed, device=device, model_class=type(unwrapped(model)))
        for seed in range(min(4, steps * accumulation))
    ]
    for index in range(steps * accumulation):
        batch = dict(base[index % len(base)])
        mask = batch.get("attention_mask")
        if accumulation > 1 and isinstance(mask, torch.Tensor) and mask.dim() == 2 and "input_ids" in batch:
            mask = mask.clone()
            for row in range(mask.shape[0]):  # micro-batch m pads its rows by m + row tokens (at most half)
                pad = min((index % accumulation) + row, mask.shape[1] // 2)
                if pad:
                    mask[row, -pad:] = 0
            batch["attention_mask"] = mask
        drawn.append(with_labels(model, batch))
    return [drawn[s * accumulation : (s + 1) * accumulation] for s in range(steps)]


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether the Trainer passes this model ``num_items_in_batch`` (and then does not divide its loss)."""
    inner = unwrapped(model)
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(inner.forward).parameters.values())


def _items(model: torch.nn.Module, batches: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """The labelled tokens the micro-batches predict, as the Trainer counts them (a causal LM's shifted)."""
    if not batches or not isinstance(batches[0].get("labels"), torch.Tensor):
        return None
    inner = unwrapped(model)
    shifts = type(inner).__name__.endswith("ForCausalLM") and not getattr(inner.config, "is_encoder_decoder", False)
    return sum((b["labels"][..., 1:] if shifts else b["labels"]).ne(-100).sum() for b in batches)


NOTHING_TRAINS = (
    "assert_trains_equivalent: the reference trains nothing (no parameter has requires_grad, or its loss depends on "
    "none that does), so the check would compare nothing. Unfreeze what it should train (requires_grad=True), or "
    "give a loss= that depends on it."
)


@dataclass(frozen=True)
class Trainee:
    """What every step of one model reads, found once per check: whether the Trainer would pass it
    ``num_items_in_batch``, and its trainable parameters by name (the ones its optimizer steps).

    Looked up once: per step, ``inspect.signature`` and ``named_parameters`` would cost a share of a tiny model's steps.
    """

    model: torch.nn.Module
    takes_items: bool
    parameters: list[tuple[str, torch.nn.Parameter]]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Trainee:
        inner = data_parallel_inner(model)
        return cls(model, accepts_loss_kwargs(model), [(n, p) for n, p in inner.named_parameters() if p.requires_grad])


def accumulate(
    trainee: Trainee, batches: Sequence[Mapping[str, Any]], loss: LossFn | None,
    around_backward: Callable[[], AbstractContextManager[Any]],
) -> tuple[float, float, dict[str, torch.Tensor | None]]:  # fmt: skip
    """Forward and backward of one step's micro-batches: the loss as the Trainer logs it, the gradient norm, the gradients."""
    model = trainee.model
    items = _items(model, batches) if trainee.takes_items else None
    total = torch.zeros(())
    for batch in batches:
        kwargs = dict(batch) if items is None else {**batch, "num_items_in_batch": items}
        with torch.enable_grad(), ieee_float32():  # the backward too
            value, _ = training_loss(forward(model, kwargs), loss)
            if items is None:
                value = value / len(batches)
            if (
                value.requires_grad
            ):  # else the model bypasses every parameter it trains: compared as no gradient, not raised
                with around_backward():
                    value.backward()
        total = total + value.detach().float().cpu()
    gradients = {name: p.grad for name, p in trainee.parameters}
    present = [g.detach() for g in logical_tensors(data_parallel_inner(model), gradients).values() if g is not None]
    norm = (
        torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(present)]))
        if present
        else torch.zeros(())
    )
    return float(total), float(norm), gradients


@contextmanager
def kept_as_found(model: torch.nn.Module) -> Iterator[None]:
    """Train mode with dropout off for the block; weights, buffers, gradients, modes and RNG put back after."""
    inner = data_parallel_inner(model)
    # saved and restored through the tensors each sharding keeps (FSDP2's and TP's DTensors, their
    # local shards), never through an FSDP2 unit's all-gather buffer, which its next backward frees
    resharded(inner)
    saved = [(t, local_part(t).detach().clone()) for t in [*inner.parameters(), *inner.buffers()]]
    with ExitStack() as stack:
        device = model_device(model)  # its accelerator's generator too: each step seeds it
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        stack.enter_context(training_state(model))
        try:
            yield
        finally:
            resharded(inner)
            with torch.no_grad():
                for tensor, value in saved:
                    local_part(tensor).copy_(value)


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


def assert_trains_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
    *,
    steps: int = 8,
    optimizer: OptimizerFactory | None = None,
    lr: float = 1e-3,
    grad_accumulation: int = 1,
    loss: LossFn | None = None,
    top_k: int = TOP_K,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> TrainingReport:
    """Fail unless ``patched`` trains as ``reference`` does over ``steps`` optimizer steps; returns the report.

    Both start from their own (equal) weights and take the same batches (``inputs``: a dict, or a
    list of micro-batches used in turn; default: drawn from the config) through ``optimizer``
    (a factory of the parameters, default ``AdamW(lr=lr)``), with ``grad_accumulation``
    micro-batches a step as transformers' Trainer accumulates them. Compared: the loss and the
    gradient norm at every step, every parameter after the last, the top-``top_k`` log-probabilities
    of an eval batch; tied parameters before any step, and parameters the patched model never
    updates. A failure names the first diverging step, what diverged, the first parameter whose
    update diverged and the first diverging module there. In bfloat16 or float16 each step also
    allows a multiple of the reference's own drift from its float32 run, and a figure that leans
    one way at every step on shared weights fails (docs/tolerance.md). Both models are left as found.

    Example::

        assert_trains_equivalent(reference_model, patched_model, steps=8, grad_accumulation=2)
        assert_trains_equivalent(reference_model, patched_model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    """
    __tracebackhide__ = True
    require_same_model(reference, patched, "assert_trains_equivalent")
    if steps < 1 or grad_accumulation < 1:
        raise PatchUsageError(
            f"assert_trains_equivalent: steps and grad_accumulation are at least 1, got {steps} and {grad_accumulation}"
        )
    start = time.perf_counter()
    spec = resolve_tolerance(atol, rtol, policy)
    make = optimizer or (lambda params: torch.optim.AdamW(params, lr=lr))
    batches = training_batches(reference, inputs, steps, grad_accumulation)
    report = TrainingReport(
        reference=type(unwrapped(reference)).__name__, patched=type(unwrapped(patched)).__name__, how=_how(make, optimizer, lr, steps, grad_accumulation),
        tolerance=spec, ties=tie_differences(reference, patched), inputs=describe_inputs(batches[0][0]), **placement(reference),
    )  # fmt: skip
    sign_steps = ADAM_SIGN_STEPS * lr if optimizer is None else 0.0
    spread = _ranks_hint(patched, batches)  # a collective: asked on every rank, pass or fail
    last = 1 + (steps - 1) * GROWTH
    if low_precision(reference):  # its own drift first: the yardstick of every step (compare.training.drift)
        report.drift = _float32_drift(reference, batches, make, loss)
    with kept_as_found(reference), kept_as_found(patched):
        _train(reference, patched, batches, make, loss, spec, report, sign_steps)
        report.parameters = _compare_parameters(
            reference, patched, _grown(spec, last, GRADIENT_POLICY, plus_atol=sign_steps * steps)
        )
        dtype = placement(reference)["dtype"] or None  # log-probabilities in float32, judged at the model's precision
        # a low-precision reference on the patched model's weights: after steps of round-off the two
        # models' weights differ everywhere, and their log-probabilities with them, whatever the patch
        shared = holding_weights_of(reference, patched) if report.drift is not None else nullcontext()
        with shared:
            logprob_spec = _grown(spec, last, TRAINING_POLICY, dtype)
            own_error = report.drift is not None
            report.logprobs = _compare_logprobs(reference, patched, batches, top_k, logprob_spec, own_error)
        unused = [u.replacement for u in unused_replacements(unwrapped(patched))]  # in the eval forward, the last
    if report.drift is not None:
        report.biases = biases([(s.losses[1], s.norms[1]) for s in report.steps], report.drift)
    if not report.passed:
        # again from the same start, the weights compared after every step this time, to name the
        # first parameter whose update diverged (only a failing check pays for it)
        again = dataclasses.replace(report, steps=[])
        with kept_as_found(reference), kept_as_found(patched):
            _train(reference, patched, batches, make, loss, spec, again, sign_steps, watch_parameters=True)
        for step, watched in zip(report.steps, again.steps):
            step.parameter = watched.parameter
    if spread and not report.passed:
        report.note = "\n".join(filter(None, [report.note, spread]))
    if unused and not allow_unused:
        report.unused = unused_message(unused, where="the eval forward after the last step")
    report.duration_s = time.perf_counter() - start
    return report.conclude()


def scalar_comparison(path: str, reference: float, patched: float, spec: ToleranceSpec) -> TensorComparison:
    """Two numbers compared as :func:`~pytest_modelpatch.compare._engine.outputs.compare_tensors` compares one-element float32 tensors."""
    tolerance = spec.for_dtype(torch.float32)
    difference = abs(patched - reference) if math.isfinite(patched) or patched != reference else 0.0
    if math.isnan(patched) != math.isnan(reference):
        difference = math.inf
    bound = tolerance.abs_term(abs(reference)) + tolerance.rtol * abs(reference)
    relative = 0.0 if difference == 0 else difference / abs(reference) if reference else math.inf
    return TensorComparison(
        path, (), "float32", max_abs=difference, max_rel=relative, over=int(difference > bound), total=1, worst_index=(),
        worst_reference=reference, worst_patched=patched, bound_at_worst=bound, tolerance=tolerance,
    )  # fmt: skip


def _how(make: OptimizerFactory, given: OptimizerFactory | None, lr: float, steps: int, accumulation: int) -> str:
    name = "AdamW" if given is None else getattr(given, "__name__", type(given).__name__)
    rate = f" at lr {lr:g}" if given is None else ""
    return f"{steps} {name} step{'s' * (steps != 1)}{rate}, gradient accumulation {accumulation}"


def _train(
    reference: torch.nn.Module, patched: torch.nn.Module, batches: list[list[dict[str, Any]]], make: OptimizerFactory,
    loss: LossFn | None, spec: ToleranceSpec, report: TrainingReport, sign_steps: float, *, watch_parameters: bool = False,
) -> None:  # fmt: skip
    ref_trainee, pat_trainee = Trainee.of(reference), Trainee.of(patched)
    if not ref_trainee.parameters:
        raise PatchUsageError(NOTHING_TRAINS)
    device = model_device(reference)
    ref_opt = make([p for _, p in ref_trainee.parameters])
    pat_opt = make([p for _, p in pat_trainee.parameters])
    # parameter name -> whether any step gave it a nonzero gradient, per model (mapped to checkpoint names at the end)
    ever = ({}, {})  # type: tuple[dict[str, bool], dict[str, bool]]
    located = False
    dtype = placement(reference)["dtype"] or None
    drift = report.drift if not watch_parameters else None

    def reference_step(at: int, micro: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
        seed_generators(device, at)
        figures = accumulate(ref_trainee, micro, loss, running_pristine)[:2]
        for _, param in ref_trainee.parameters:
            param.grad = None
        return figures

    for index, micro in enumerate(batches):
        if drift is not None:  # the reference on the patched model's weights, before either computes this step
            low, wide = shared_weights_figures(reference, patched, reference_step, index, micro)
            drift.shared_low.append(low)
            drift.shared_float32.append(wide)
        seed_generators(device, index)
        ref_loss, ref_norm, ref_grads = accumulate(ref_trainee, micro, loss, running_pristine)
        seed_generators(device, index)
        pat_loss, pat_norm, pat_grads = accumulate(pat_trainee, micro, loss, nullcontext)
        if index == 0 and all(g is None for g in ref_grads.values()):
            raise PatchUsageError(NOTHING_TRAINS)
        _note_trained(ever[0], ref_grads)
        _note_trained(ever[1], pat_grads)
        loss_spec = norm_spec = _grown(spec, 1 + index * GROWTH, TRAINING_POLICY, dtype)
        if report.drift is not None:  # a low-precision reference: its own drift so far is allowed too
            if drift is not None:
                wide_loss, wide_norm = drift.wide[index]
                drift.free.append((abs(wide_loss - ref_loss), abs(wide_norm - ref_norm)))
            drifted_loss, drifted_norm = report.drift.envelope(index)
            loss_spec = _grown(spec, 1 + index * GROWTH, TRAINING_POLICY, dtype, plus_atol=DRIFT_FACTOR * drifted_loss)
            norm_spec = _grown(spec, 1 + index * GROWTH, TRAINING_POLICY, dtype, plus_atol=DRIFT_FACTOR * drifted_norm)
        step = TrainingStep(
            index, scalar_comparison("loss", ref_loss, pat_loss, loss_spec),
            scalar_comparison("gradient norm", ref_norm, pat_norm, norm_spec),
            (ref_loss, pat_loss), (ref_norm, pat_norm),
        )  # fmt: skip
        if not (step.loss.passed and step.grad_norm.passed) and not located and not watch_parameters:
            # once, at the first step whose figures differ, before its update
            located = True
            report.divergence_step = index
            settled = _grown(spec, 1.0, GRADIENT_POLICY)  # weights that still agree: one step's gradient tolerance
            report.divergence, report.drifted = _locate(reference, patched, micro, loss_spec, settled, index)
        for model, opt in ((reference, ref_opt), (patched, pat_opt)):
            resharded(model)  # a forward without backward (locating the divergence) left no stale unsharded copy
            opt.step()
            opt.zero_grad(set_to_none=True)
        if watch_parameters:
            grown = _grown(spec, 1 + index * GROWTH, GRADIENT_POLICY, plus_atol=sign_steps * (index + 1))
            step.parameter = _first_parameter_over(reference, patched, grown)
        report.steps.append(step)
    by_reference, by_patched = _trained_by_name(reference, ever[0]), _trained_by_name(patched, ever[1])
    report.untrained = [
        f"{name}: the reference trains it, the patched model never updates it (no gradient at any step)"
        for name, trained in by_reference.items() if trained and by_patched.get(name) is False
    ]  # fmt: skip
    if len(batches[0]) > 1 and report.steps and not report.steps[0].loss.passed:
        report.note = _items_hint(reference, patched, batches[0], loss)


def _locate(
    reference: torch.nn.Module, patched: torch.nn.Module, micro: Sequence[Mapping[str, Any]], spec: ToleranceSpec,
    settled: ToleranceSpec, index: int,
) -> tuple[Divergence | None, str]:  # fmt: skip
    """The first diverging module at this step, or why none is named.

    Both models took the same steps so far: while their weights still agree, a module that
    diverges now is where the patch differs (none: the difference is outside every module, in
    the loss, say). Once round-off has moved every weight apart (low precision, a few steps in),
    the first module of the forward differs on its own weights whatever the patch replaced, so
    naming it would blame a module the patch never touched.
    """
    moved = _first_parameter_over(reference, patched, settled) if index else ""
    if not moved:
        inputs = {k: v for k, v in micro[0].items() if k != "labels"}
        return find_divergence(reference, patched, inputs, spec, train=True), ""
    replaced = _replaced_modules(reference, patched)
    return None, (
        f"at step {index} the weights already differ (the first: {moved}), as after steps of round-off, so no first "
        f"diverging module is named; the patched model replaces {replaced}"
    )


def _replaced_modules(reference: torch.nn.Module, patched: torch.nn.Module) -> str:
    """The modules whose class the patched model changed, e.g. ``model.layers.0.mlp (LlamaSwiGLUMLP) and 1 more``."""
    theirs = {name: type(module).__name__ for name, module in data_parallel_inner(reference).named_modules()}
    changed = [
        f"{name or '<model>'} ({type(module).__name__})"
        for name, module in data_parallel_inner(patched).named_modules() if theirs.get(name) != type(module).__name__
    ]  # fmt: skip
    if not changed:
        return "no module's class (its difference lies in a forward, a loss or a transform)"
    return changed[0] + (f" and {len(changed) - 1} more" if len(changed) > 1 else "")


def _float32_drift(
    reference: torch.nn.Module, batches: list[list[dict[str, Any]]], make: OptimizerFactory, loss: LossFn | None,
) -> DriftFigures:  # fmt: skip
    """The reference trained in float32 from its own weights on the same batches: each step's loss and gradient norm."""
    figures = DriftFigures()
    with kept_as_found(reference), in_float32(reference):
        trainee = Trainee.of(reference)
        device = model_device(reference)
        optimizer = make([p for _, p in trainee.parameters])
        for index, micro in enumerate(batches):
            seed_generators(device, index)
            figures.wide.append(accumulate(trainee, micro, loss, running_pristine)[:2])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return figures


def _items_hint(
    reference: torch.nn.Module, patched: torch.nn.Module, micro: list[dict[str, Any]], loss: LossFn | None
) -> str:
    """Whether the patched model's loss ignores ``num_items_in_batch`` where the reference's does not: asked, not guessed."""
    items = _items(reference, micro)
    if items is None or not accepts_loss_kwargs(patched):
        return ""

    def losses(model: torch.nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            once, twice = (
                float(training_loss(forward(model, {**micro[0], "num_items_in_batch": n}), loss)[0])
                for n in (items, 2 * items)
            )
            return once, twice

    ref, pat = losses(reference), losses(patched)
    if ref[0] == ref[1] or pat[0] != pat[1]:
        return ""
    return (
        f"hint: the patched model's loss ignores num_items_in_batch: with num_items_in_batch={int(items)} and "
        f"{2 * int(items)} it is {pat[0]:.6g} both times, where the reference's goes {ref[0]:.6g} -> {ref[1]:.6g}. "
        "Under gradient accumulation transformers' Trainer passes it and does not divide the loss by the steps, so "
        "each micro-batch weighs the same whatever its number of real tokens: divide the summed token losses by "
        "num_items_in_batch when given."
    )


def _ranks_hint(patched: torch.nn.Module, batches: list[list[dict[str, Any]]]) -> str:
    """A hint when the ranks of a sharded patched model were given different batches, else ``""``."""
    kind = sharding_kind(patched)
    if kind is None:
        return ""
    flat = {f"{s}.{m}.{k}": v for s, micro in enumerate(batches) for m, b in enumerate(micro) for k, v in b.items()}
    differing = ranks_disagree(flat)
    if not differing:
        return ""
    if kind == "tensor parallel":
        why = "Under tensor parallelism every rank computes its share of one batch, so different batches are mixed."
    else:
        why = (f"{kind} averages the gradients over the ranks, so the patched model trains on every rank's batches "
               "while the whole reference on each rank trains on its own.")  # fmt: skip
    return (
        f"hint: the ranks were given different batches (rank {differing[0]}'s differ from rank 0's). {why} Give every "
        "rank the same inputs (the default drawn batches are the same on every rank): draw them from a seed, not "
        "from a DistributedSampler."
    )


def _note_trained(ever: dict[str, bool], gradients: Mapping[str, Any]) -> None:
    """Mark each parameter that got a nonzero gradient this step; one marked already is not looked at again."""
    pending = [(name, g) for name, g in gradients.items() if not ever.get(name) and g is not None]
    for (name, _), nonzero in zip(pending, nonzero_anywhere([g for _, g in pending])):
        ever[name] = nonzero
    for name in gradients:
        ever.setdefault(name, False)


def _trained_by_name(model: torch.nn.Module, ever: Mapping[str, bool]) -> dict[str, bool]:
    """``ever`` under the checkpoint's names: a fused weight's flag passed to each tensor it was made of."""
    inner = data_parallel_inner(model)
    if not getattr(inner, "_weight_conversions", None):
        return dict(ever)
    params = dict(inner.named_parameters())
    marks = {name: torch.full(tuple(params[name].shape), float(flag)) for name, flag in ever.items() if name in params}
    named, _ = checkpoint_gradients(inner, marks)
    return {name: bool(mark is not None and mark.max() > 0) for name, mark in named.items()}


def _first_parameter_over(reference: torch.nn.Module, patched: torch.nn.Module, spec: ToleranceSpec) -> str:
    """The first parameter whose value is over ``spec`` now, or ``""``: one fused bound over every tensor first.

    A tensor whose largest difference is within the policy's absolute term is within tolerance
    elementwise; only when one is not (never, for a correct patch) are they compared one by one.
    """
    ref_inner, pat_inner = data_parallel_inner(reference), data_parallel_inner(patched)
    ref, pat = dict(ref_inner.named_parameters()), dict(pat_inner.named_parameters())
    plain = ref.keys() == pat.keys() and not any(type(p).__name__ == "DTensor" for p in pat.values())
    if plain and not getattr(pat_inner, "_weight_conversions", None) and ref:
        refs = [p.detach() for p in ref.values()]
        atol = min(spec.for_dtype(t.dtype).atol for t in {t.dtype: t for t in refs}.values())
        largest = torch._foreach_norm(torch._foreach_sub([p.detach() for p in pat.values()], refs), float("inf"))
        if bool((torch.stack(largest) <= atol).all()):
            return ""
    return next((c.path for c in _compare_parameters(reference, patched, spec) if not c.passed), "")


def _compare_parameters(
    reference: torch.nn.Module, patched: torch.nn.Module, spec: ToleranceSpec
) -> list[TensorComparison]:
    """Every parameter of both, by the checkpoint's names (the patched model's through its conversions)."""
    ref_inner, pat_inner = data_parallel_inner(reference), data_parallel_inner(patched)
    ref, _ = checkpoint_gradients(ref_inner, {n: p.detach() for n, p in ref_inner.named_parameters()})
    pat, _ = checkpoint_gradients(pat_inner, {n: p.detach() for n, p in pat_inner.named_parameters()})
    return compare_flat_batched(ref, pat, spec)


def _compare_logprobs(
    reference: torch.nn.Module, patched: torch.nn.Module, batches: list[list[dict[str, Any]]], top_k: int, spec: ToleranceSpec,
    own_error: bool = False,
) -> TensorComparison | None:  # fmt: skip
    """The reference's top-k log-probabilities of an eval batch after training, and the patched model's of those tokens.

    ``own_error``: the reference's own low-precision error, its log-probabilities' largest
    distance from its float32 run's on the same weights, times :data:`DRIFT_FACTOR`, is allowed
    on top of ``spec``.
    """
    batch = {k: v for k, v in batches[-1][0].items() if k != "labels"}
    # in true eval mode: the dropout the training steps turned off is back, so a module that applies
    # it whatever self.training says differs here
    with torch.no_grad(), as_configured(reference, patched):
        reference.eval(), patched.eval()
        ref_logits, pat_logits = _logits(forward(reference, batch)), _logits(forward(patched, batch))
    if ref_logits is None:
        return None
    if pat_logits is None:  # in eval and without labels even a fused loss kernel returns the logits
        problem = f"reference is tensor {tuple(ref_logits.shape)}, patched is None (in eval mode, without labels)"
        return TensorComparison("logits", problem=problem)
    ref_lp, pat_lp = ref_logits.float().log_softmax(-1), pat_logits.float().log_softmax(-1)
    top = ref_lp.topk(min(top_k, ref_lp.shape[-1]), dim=-1).indices
    ref_top, pat_top = ref_lp.gather(-1, top), pat_lp.gather(-1, top.to(pat_lp.device))
    if own_error:
        with torch.no_grad(), as_configured(reference), in_float32(reference):
            wide = _logits(forward(reference, batch))
        if wide is not None:
            wide_top = wide.float().log_softmax(-1).gather(-1, top.to(wide.device)).to(ref_top.device)
            error = float((wide_top - ref_top).abs().max())
            spec = _grown(spec, 1.0, TRAINING_POLICY, plus_atol=DRIFT_FACTOR * error)
    # judged at the precision of the logits they come from, as the loss is: a bf16 model's weights
    # after a few steps differ by bf16 round-off, and its log-probabilities by a few bf16 ulps
    # (a correct fused MLP: 3 ulps of -2.93 after 8 steps under ATEN_CPU_CAPABILITY=default)
    if ref_logits.dtype in (torch.bfloat16, torch.float16):
        ref_top, pat_top = ref_top.to(ref_logits.dtype), pat_top.to(ref_logits.dtype)
    return compare_tensors(f"top-{top.shape[-1]} log-probabilities", ref_top, pat_top, spec)


def _logits(outputs: Any) -> torch.Tensor | None:
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if logits is not None and type(logits).__name__ == "DTensor":
        logits = logits.full_tensor()
    return logits if isinstance(logits, torch.Tensor) else None
