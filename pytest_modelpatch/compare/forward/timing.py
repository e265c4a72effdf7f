"""Time the reference and the patched model on a check's inputs: what the patch buys, apart from the check.

Off unless ``--modelpatch-timing`` (or ini ``modelpatch_timing``) asks for it: then every
forward equivalence check runs each model a few more times on the inputs it compared,
warm-up first, and its report row gets ``"timing"``. The comparison's own forwards are
never timed: they include output capture and the comparison itself.

- Seconds are the median of ``repeats`` calls, reference and patched alternating so that
  load drifting on a shared machine weighs on both. The spread of each model's repeats (their
  interquartile range) comes with it: when the two ranges overlap, the difference is within
  the noise and is called "no measurable difference", whatever the ratio of the medians. On
  CUDA each call is timed with CUDA events (the kernels' time, no host sync in between);
  elsewhere with ``time.perf_counter``.
- Both models are called as checks call them, ``model(**inputs)`` under ``no_grad``. A
  shared reference enters the test's pristine scope on every call (``models/reference.py``),
  so ``reference_s`` includes that; at the default tiny size it
  leans ``speedup`` slightly in the patch's favour, at real sizes it vanishes in the noise.
- Peak bytes: on CUDA, ``torch.cuda.max_memory_allocated`` during one forward minus what was
  allocated when it started (the forward's working memory; both models' weights excluded).
  On the CPU torch keeps no allocator statistics, so the figure is ``None`` (``null`` in JSON).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import evaluating, model_device, move_inputs
from pytest_modelpatch.settings import SETTINGS

DEFAULT_WARMUP = 2
DEFAULT_REPEATS = 7

Clock = Callable[[Callable[[], Any]], float]  # runs a call once, returns its seconds


def timing_enabled() -> bool:
    """Whether ``--modelpatch-timing`` (``SETTINGS.timing``, which the plugin sets) asked for timing."""
    return SETTINGS.timing


# ---------------------------------------------------------------------------
# clocks
# ---------------------------------------------------------------------------


def wall_seconds(call: Callable[[], Any]) -> float:
    """Seconds one call takes by the host's clock (CPU models: the call returns when the work is done)."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def cuda_event_seconds(call: Callable[[], Any]) -> float:
    """Seconds one call's kernels take by CUDA events on the current stream (launches are asynchronous)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def clock_for(device: torch.device) -> Clock:
    """CUDA events for a model on a CUDA device, the host's clock for every other device."""
    return cuda_event_seconds if device.type == "cuda" else wall_seconds


def peak_bytes(call: Callable[[], Any], device: torch.device) -> int | None:
    """The working memory one call allocates at its peak on ``device``; ``None`` where torch does not count it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


# ---------------------------------------------------------------------------
# timing two models
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelTiming:
    """Median forward seconds and peak working memory of both models on one check's inputs."""

    reference_s: float
    patched_s: float
    reference_peak_bytes: int | None = None
    patched_peak_bytes: int | None = None
    # the interquartile range of each model's repeats, seconds; None where only a median is known
    reference_spread_s: tuple[float, float] | None = None
    patched_spread_s: tuple[float, float] | None = None

    @property
    def speedup(self) -> float:
        """``reference_s / patched_s``: above 1 the patch is faster."""
        return self.reference_s / self.patched_s if self.patched_s > 0 else float("inf")

    @property
    def measurable(self) -> bool:
        """The two models' spreads do not overlap: the difference is more than the noise of the repeats."""
        if self.reference_spread_s is None or self.patched_spread_s is None:
            return True
        (ref_low, ref_high), (pat_low, pat_high) = self.reference_spread_s, self.patched_spread_s
        return ref_high < pat_low or pat_high < ref_low

    def to_dict(self) -> dict[str, Any]:
        """The report row's ``"timing"`` object."""
        row: dict[str, Any] = {
            "reference_s": self.reference_s, "patched_s": self.patched_s, "speedup": self.speedup,
            "reference_peak_bytes": self.reference_peak_bytes, "patched_peak_bytes": self.patched_peak_bytes,
        }  # fmt: skip
        if self.reference_spread_s is not None and self.patched_spread_s is not None:
            row.update(reference_spread_s=list(self.reference_spread_s), patched_spread_s=list(self.patched_spread_s),
                       measurable=self.measurable)  # fmt: skip
        return row

    def __str__(self) -> str:
        reference, patched = _ms(self.reference_s, self.reference_spread_s), _ms(self.patched_s, self.patched_spread_s)
        times = f"reference {reference}, patched {patched}"
        if not self.measurable:
            return f"no measurable difference: {times}, within the spread of the repeats (speedup {self.speedup:.2f}x)"
        return f"{times}, speedup {self.speedup:.2f}x"


def _ms(median: float, spread: tuple[float, float] | None) -> str:
    shown = f"{median * 1e3:.3g} ms"
    return shown if spread is None else f"{shown} ({spread[0] * 1e3:.3g}-{spread[1] * 1e3:.3g})"


def spread(seconds: list[float]) -> tuple[float, float]:
    """The interquartile range of ``seconds``: where the middle half of the repeats fell."""
    if len(seconds) < 2:
        return seconds[0], seconds[0]
    low, _, high = statistics.quantiles(seconds, n=4, method="inclusive")
    return low, high


def time_models(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
) -> ModelTiming:
    """Time both models' forwards on ``inputs``: ``warmup`` calls each, then ``repeats`` alternating calls, medians.

    Example::

        timing = time_models(reference_model, patched_model, {"input_ids": ids})
        assert timing.speedup > 1.2
    """
    ref_inputs = move_inputs(inputs, model_device(reference))
    pat_inputs = move_inputs(inputs, model_device(patched))
    calls = {"reference": lambda: reference(**ref_inputs), "patched": lambda: patched(**pat_inputs)}
    clocks = {"reference": clock_for(model_device(reference)), "patched": clock_for(model_device(patched))}
    seconds: dict[str, list[float]] = {"reference": [], "patched": []}
    with evaluating(reference, patched):
        for call in calls.values():
            for _ in range(warmup):
                call()
        for index in range(max(1, repeats)):
            # alternate who goes first: neither model always runs on the other's warm caches
            order = ("reference", "patched") if index % 2 == 0 else ("patched", "reference")
            for name in order:
                seconds[name].append(clocks[name](calls[name]))
        peaks = {
            "reference": peak_bytes(calls["reference"], model_device(reference)),
            "patched": peak_bytes(calls["patched"], model_device(patched)),
        }
    return ModelTiming(
        reference_s=statistics.median(seconds["reference"]), patched_s=statistics.median(seconds["patched"]),
        reference_peak_bytes=peaks["reference"], patched_peak_bytes=peaks["patched"],
        reference_spread_s=spread(seconds["reference"]), patched_spread_s=spread(seconds["patched"]),
    )  # fmt: skip


def timing_if_enabled(
    reference: torch.nn.Module, patched: torch.nn.Module, inputs: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The row's ``"timing"`` when ``--modelpatch-timing`` is on, else ``None`` and no extra forward."""
    if not timing_enabled():
        return None
    return time_models(reference, patched, inputs).to_dict()
