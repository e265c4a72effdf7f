"""How far a low-precision model's own training drifts: the yardstick a patched model's training is judged by.

Two trainings of a bfloat16 model that differ by nothing but round-off part within a few steps:
Adam moves a weight by about lr times the sign of its gradient, so a gradient that round-off
tips across zero moves it 2 x lr the other way, and the next step computes on other weights.
The per-dtype tolerances cannot tell that drift from a bug. So, for a bfloat16 or float16
reference, ``assert_trains_equivalent`` measures it on the reference itself:

- **free drift**: the reference trained again in float32, from the same weights on the same
  batches; at each step its loss and gradient norm against the low-precision run's. The patched
  model's figures may differ from the reference's by :data:`DRIFT_FACTOR` times the largest drift
  so far, on top of the per-dtype tolerance;
- **shared weights**: before each step the reference computes the step's loss and gradient
  norm on the patched model's current weights, in its own dtype and in float32. On shared
  weights nothing drifts: what differs is the computation. A patched model whose figures there
  are off the reference's by more than :data:`BIAS_FACTOR` times the reference's own
  low-precision error on average, and off the same way at every step (``|t| >= BIAS_T``),
  computes something else, however small each step's difference: a loss taken in bfloat16
  where the reference takes it in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.train_mode import data_parallel_inner
from pytest_modelpatch.compare.backward.equivalence import checkpoint_gradients

# Measured in bfloat16 on CPU, 16 AdamW steps at lr 1e-2, correct kernels over the tiny families
# (llama's SwiGLU autograd, split-K MLP and fused linear-cross-entropy; sdpa against eager on
# llama, qwen2, mistral, gemma, phi3, qwen3): a step needs up to 5.4 times the drift beyond the
# per-dtype tolerance (phi3's sdpa), so 8. On shared weights their |t| stays at or under 2.3 (their
# offset up to 0.95 times the reference's own error, at 8 steps); a cross-entropy in bfloat16 is
# off 0.75-2.01 times with |t| 4.2-6.3 on five of the six families (docs/tolerance.md has the table).
DRIFT_FACTOR = 8.0
BIAS_FACTOR = 0.5
BIAS_T = 3.5
BIAS_MIN_STEPS = 8  # a mean over fewer steps says little
LOW_PRECISION = (torch.bfloat16, torch.float16)

StepFn = Callable[[int, Sequence[Mapping[str, Any]]], tuple[float, float]]


def low_precision(model: torch.nn.Module) -> bool:
    """Whether the model computes in bfloat16 or float16 (its first floating parameter's dtype)."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return param is not None and param.dtype in LOW_PRECISION


@contextmanager
def in_float32(model: torch.nn.Module) -> Iterator[None]:
    """The model's floating parameters and buffers in float32 for the block, the very tensors it had put back after.

    The parameters stay the same objects (their ``.data`` is swapped), so hooks, ties and
    caches keyed by them hold; a bfloat16 value is exact in float32, so the block starts on the
    same weights.
    """
    inner = data_parallel_inner(model)
    tensors = [t for t in [*inner.parameters(), *inner.buffers()] if t.is_floating_point() and t.dtype != torch.float32]
    held = [(t, t.data) for t in tensors]
    try:
        for tensor, data in held:
            tensor.data = data.float()
        yield
    finally:
        for tensor, data in held:
            tensor.data = data


@contextmanager
def holding_weights_of(reference: torch.nn.Module, patched: torch.nn.Module) -> Iterator[None]:
    """The reference computes on the patched model's current weights for the block (by the checkpoint's names).

    The patched model's parameters are mapped through the reverse of its weight conversions
    and made whole (sharded ones gathered), as the final parameters are compared.
    """
    ref_inner, pat_inner = data_parallel_inner(reference), data_parallel_inner(patched)
    theirs, _ = checkpoint_gradients(pat_inner, {n: p.detach() for n, p in pat_inner.named_parameters()})
    mine = dict(ref_inner.named_parameters(remove_duplicate=False))
    pairs = [(mine[name], value) for name, value in theirs.items() if name in mine and value is not None]
    saved = [(param, param.detach().clone()) for param in {id(p): p for p, _ in pairs}.values()]
    try:
        with torch.no_grad():
            for param, value in pairs:
                param.copy_(value.to(param.device, param.dtype))
        yield
    finally:
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)


@dataclass
class DriftFigures:
    """The reference's own low-precision figures for each step: free-running and on the patched model's weights."""

    wide: list[tuple[float, float]] = field(default_factory=list)  # the float32 run's (loss, gradient norm)
    free: list[tuple[float, float]] = field(default_factory=list)  # |float32 run - run| of each, as the run goes
    shared_low: list[tuple[float, float]] = field(default_factory=list)  # reference on the patched weights
    shared_float32: list[tuple[float, float]] = field(default_factory=list)  # the same in float32

    def envelope(self, step: int) -> tuple[float, float]:
        """The largest free drift of the loss and of the gradient norm up to ``step``."""
        seen = self.free[: step + 1]
        return max((d[0] for d in seen), default=0.0), max((d[1] for d in seen), default=0.0)


def shared_weights_figures(
    reference: torch.nn.Module, patched: torch.nn.Module, step: StepFn, index: int, micro: Sequence[Mapping[str, Any]],
) -> tuple[tuple[float, float], tuple[float, float]]:  # fmt: skip
    """The reference's (loss, gradient norm) of step ``index`` on the patched weights, in its dtype and in float32."""
    with holding_weights_of(reference, patched):
        low = step(index, micro)
        with in_float32(reference):
            wide = step(index, micro)
    return low, wide


@dataclass(frozen=True)
class Bias:
    """How one figure of the patched model leans away from the reference's on shared weights, over the steps.

    ``offset``: the mean of patched - reference over the steps; ``spread``: the root mean square
    of the reference's own low-precision error there (its figure against float32's); ``t``: the
    offset over its standard error (how alike every step's difference is).
    """

    what: str  # "loss" or "gradient norm"
    offset: float
    spread: float
    t: float
    steps: int

    @property
    def ratio(self) -> float:
        """The offset in spreads of the reference's own error."""
        return abs(self.offset) / self.spread if self.spread else (math.inf if self.offset else 0.0)

    @property
    def passed(self) -> bool:
        return self.ratio <= BIAS_FACTOR or abs(self.t) < BIAS_T

    def __str__(self) -> str:
        return (
            f"on shared weights the patched {self.what} is {self.offset:+.3g} off the reference's on average over "
            f"{self.steps} steps, {self.ratio:.2g} times the reference's own low-precision error there "
            f"({self.spread:.3g}, against float32), and alike at every step (t = {self.t:.1f}); "
            f"allowed: {BIAS_FACTOR:g} times, or |t| under {BIAS_T:g}"
        )


def biases(patched: list[tuple[float, float]], figures: DriftFigures) -> list[Bias]:
    """The loss's and the gradient norm's lean over the steps (none under :data:`BIAS_MIN_STEPS` steps).

    Each figure is judged over all the steps and over the first :data:`BIAS_MIN_STEPS`; a failing
    window is reported (all the steps first). Late in a run, once the loss has fallen near zero, a
    bfloat16 gradient norm's round-off grows (on an H200 one step's was 2.4, the first eight's under
    0.1): over 16 steps a bfloat16 cross-entropy's lean drowned in it (t -3.0), over its first 8 it
    showed (t beyond -3.5). Two windows, not every one: each more would be another chance for a
    correct kernel to lean by luck.
    """
    steps = len(figures.shared_low)
    if steps < BIAS_MIN_STEPS:
        return []
    found = []
    for index, what in enumerate(("loss", "gradient norm")):
        leans = [_lean(patched, figures, index, what, n) for n in sorted({BIAS_MIN_STEPS, steps}, reverse=True)]
        found.append(next((lean for lean in leans if not lean.passed), leans[0]))
    return found


def _lean(patched: list[tuple[float, float]], figures: DriftFigures, index: int, what: str, steps: int) -> Bias:
    ref = [r[index] for r in figures.shared_low[:steps]]
    offsets = [p[index] - r for p, r in zip(patched[:steps], ref)]
    offset = sum(offsets) / steps
    deviation = math.sqrt(sum((o - offset) ** 2 for o in offsets) / (steps - 1))
    t = offset / (deviation / math.sqrt(steps)) if deviation else (math.inf if offset else 0.0)
    spread = math.sqrt(sum((r - w[index]) ** 2 for r, w in zip(ref, figures.shared_float32)) / steps)
    return Bias(what, offset, spread, t, steps)
