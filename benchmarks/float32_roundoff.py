"""How far float32 round-off moves each family's outputs: the figures behind the float32 tolerance.

For every family that takes ``attn_implementation="sdpa"`` (transformers' own second implementation
of the same math), loaded as the fixtures load it (a seeded checkpoint, ``from_pretrained``, the
reference with eager attention everywhere, the patched model with sdpa; experts eager on both), on
the inputs ``assert_equivalent`` draws, over every compared output tensor:

- ``sdpa``: |sdpa - eager|, what a correct alternative kernel differs by;
- ``own``: |eager float32 - eager float64| (the reference against a float64 run of itself, as the
  ``oracle`` policy makes it), how far float32 moves the reference on its own.

Each as the largest absolute difference, and in ulps of the tensor's max |value| after the
default rtol (``(|d| - rtol |ref|) / ulp(max |ref|)``): what the float32 ``ulps`` must allow.
Prints their distribution over the families and the families at the top; ``docs/tolerance.md``
quotes the figures.

    python benchmarks/float32_roundoff.py --jobs 2       # every family (4 minutes on 2 cores)
    python benchmarks/float32_roundoff.py llama qwen3_5   # just these
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: measure this checkout's package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from split_families import split_over_processes
from transformers.utils import logging as transformers_logging

from pytest_modelpatch.compare._engine.devices import evaluating
from pytest_modelpatch.compare._engine.inputs import default_inputs
from pytest_modelpatch.compare._engine.outputs import flatten_outputs
from pytest_modelpatch.compare._engine.running import forward
from pytest_modelpatch.compare._engine.tolerance import DEFAULT_POLICY, ulp
from pytest_modelpatch.families.catalog import available_model_types
from pytest_modelpatch.models.builder import LoadChoices, ModelBuilder, ModelRequest
from pytest_modelpatch.models.memory_cache import CacheBound
from pytest_modelpatch.models.sweeps import family_towers, skip_reason

PER_TYPE_TIMEOUT_S = 60
RTOL = DEFAULT_POLICY.entry("float32").rtol
# experts eager on both sides: grouped_mm takes no float64, and it computes what eager does (bitwise, on CPU)
SDPA = LoadChoices({"attn_implementation": "sdpa", "experts_implementation": "eager"})


@dataclass
class RoundoffRow:
    """One family's figures (``None`` where it has none, and ``error`` says why)."""

    model_type: str
    sdpa: float | None = None  # max |sdpa - eager|
    sdpa_ulps: float | None = None  # the same in ulps of each tensor's max |value|, after rtol
    own: float | None = None  # max |float32 eager - float64 eager|
    own_ulps: float | None = None
    error: str = ""


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout(f"no result in {PER_TYPE_TIMEOUT_S}s")


def _leaves(outputs: Any) -> dict[str, torch.Tensor]:
    return {path: leaf.double() for path, leaf in flatten_outputs(outputs)
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel()}  # fmt: skip


def differences(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The largest |difference| over the finite elements both hold, and the same in ulps of each tensor's max |reference|."""
    worst, worst_ulps = 0.0, 0.0
    for path, ref in reference.items():
        value = other.get(path)
        if value is None or value.shape != ref.shape:
            continue
        both = ref.isfinite() & value.isfinite()
        if not both.any():
            continue
        diff = (ref - value).abs()[both]
        worst = max(worst, float(diff.max()))
        spacing = ulp(float(ref[both].abs().max()), "float32")
        if spacing:
            worst_ulps = max(worst_ulps, float((diff - RTOL * ref[both].abs()).max()) / spacing)
    return worst, worst_ulps


def measure(model_type: str, builder: ModelBuilder) -> RoundoffRow:
    """The family's sdpa and own round-off; an error row where it takes no sdpa or does not run."""
    row = RoundoffRow(model_type)
    signal.alarm(PER_TYPE_TIMEOUT_S)
    try:
        request = ModelRequest(model_type)
        reference, patched = builder.reference(request, choices=SDPA), builder.patched(request, choices=SDPA)
        inputs = default_inputs(reference)
        with evaluating(reference, patched):
            eager, sdpa = _leaves(forward(reference, inputs)), _leaves(forward(patched, inputs))
        wide = reference.to(torch.float64)  # the builder keeps one model, and this is its last use
        with evaluating(wide):
            exact = _leaves(forward(wide, {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                                           for k, v in inputs.items()}))  # fmt: skip
        row.sdpa, row.sdpa_ulps = differences(eager, sdpa)
        row.own, row.own_ulps = differences(eager, {k: v.float().double() for k, v in exact.items()})
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        lines = str(exc).strip().splitlines()
        row.error = f"{type(exc).__name__}: {lines[0][:120] if lines else ''}"
    finally:
        signal.alarm(0)
    return row


def run_here(types: list[str]) -> list[RoundoffRow]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="roundoff-") as cache:
        builder = ModelBuilder(Path(cache), model_cache=CacheBound(count=1))
        for model_type in types:
            with contextlib.redirect_stdout(sys.stderr):
                rows.append(measure(model_type, builder))
            print(f"  {model_type:32s} {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else math.nan


def summary(rows: list[RoundoffRow], real: float = 1e-3) -> list[str]:
    """The distributions, over the families whose sdpa difference is round-off (below ``real``); those above named apart."""
    measured = [r for r in rows if r.sdpa is not None]
    apart = sorted((r for r in measured if r.sdpa >= real), key=lambda r: -r.sdpa)
    kept = [r for r in measured if r.sdpa < real]
    lines = [f"{len(measured)} of {len(rows)} families measured; differing for real (sdpa >= {real:g}): "
             + (", ".join(f"{r.model_type} {r.sdpa:.3g}" for r in apart) or "none")]  # fmt: skip
    for name in ("sdpa", "sdpa_ulps", "own", "own_ulps"):
        values = [getattr(r, name) for r in kept]
        top = sorted(kept, key=lambda r: -getattr(r, name))[:6]
        lines.append(f"{name:9s} over {len(values)}: max {max(values, default=math.nan):.3g}, 99% {quantile(values, 0.99):.3g}, "
                     f"median {quantile(values, 0.5):.3g}; largest: "
                     + ", ".join(f"{r.model_type} {getattr(r, name):.3g}" for r in top))  # fmt: skip
    ratio = max((r.sdpa_ulps / r.own_ulps for r in kept if r.own_ulps), default=math.nan)
    lines.append(f"largest sdpa / own ratio (in ulps): {ratio:.3g}")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every family that runs here)")
    parser.add_argument("--jobs", type=int, default=1, help="processes to split the families over")
    parser.add_argument("--json", type=Path, help="write one row per family to this file")
    parser.add_argument("--quiet", action="store_true", help="no summary (a process of --jobs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers_logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _alarm)
    towers = family_towers()
    types = args.types or [t for t in available_model_types() if not skip_reason(t, towers.get(t))]
    start = time.perf_counter()
    if args.jobs > 1:
        rows = [RoundoffRow(**row) for row in split_over_processes(__file__, types, args.jobs, ["--quiet"])]
    else:
        rows = run_here(types)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if not args.quiet:
        print("\n".join(summary(rows)))
        print(f"total time: {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
