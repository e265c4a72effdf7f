"""Cost of assert_trains_equivalent against two bare training loops of the same steps.

Both timings in one run, on the same tiny model and batches, in ``--repeats`` interleaved pairs;
printed: the best of each and the median of the pairs' ratios, which the goal is judged by
(at most 1.15x). The models are built as a pytest session builds them (``ModelBuilder`` inside the
test's ``ActivePatches``, the interception wrappers held as the plugin holds them), so the
reference enters ``pristine()`` and is verified on every call, as it is for users:

- ``assert_trains_equivalent``: ``--steps`` AdamW steps of both models with every comparison
  (each step's loss, gradient norm and weights, the final weights and eval log-probabilities,
  ties, weights that never train) and both models put back as found;
- bare: the same steps of each model, ``forward(**batch).loss.backward()``, ``AdamW.step()``,
  ``zero_grad()``, on copies of the weights restored after, as a hand-written loop would.

Usage::

    python benchmarks/bench_training.py                       # llama_swiglu_autograd, fp32, 8 steps
    python benchmarks/bench_training.py --dtype bfloat16 --steps 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `fixtures` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from fixtures import load_patch
from pytest_modelpatch.compare.training.steps import assert_trains_equivalent, training_batches
from pytest_modelpatch.isolation.interception import hold_for_session
from pytest_modelpatch.isolation.per_test.patch_spec import PatchSpec
from pytest_modelpatch.isolation.registration import ActivePatches
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest


def bare_training(reference: Any, patched: Any, batches: list[list[dict[str, Any]]], lr: float) -> float:
    start = time.perf_counter()
    for model in (reference, patched):
        saved = [(p, p.detach().clone()) for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model.train()
        for micro in batches:
            model.forward(**micro[0]).loss.backward()  # .forward: the plugin's root hooks are not run
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)
    return time.perf_counter() - start


def checked_training(reference: Any, patched: Any, steps: int, lr: float) -> float:
    start = time.perf_counter()
    assert_trains_equivalent(reference, patched, steps=steps, lr=lr)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", default="llama_swiglu_autograd")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    patch = load_patch(args.patch)
    hold_for_session(True)  # as the plugin does from pytest_configure to pytest_unconfigure
    with tempfile.TemporaryDirectory() as cache:
        builder, request = ModelBuilder(Path(cache)), ModelRequest(patch.MODEL_TYPE)
        active = ActivePatches(
            PatchSpec(mapping=dict(patch.MAPPING), conversions=dict(patch.CONVERSIONS), overwrite=True)
        )
        try:
            reference = builder.reference(request, dtype=args.dtype)
            patched = builder.patched(request, dtype=args.dtype)
            batches = training_batches(reference, None, args.steps, 1)
            for _ in range(2):  # warm up both paths
                (
                    bare_training(reference, patched, batches, args.lr),
                    checked_training(reference, patched, args.steps, args.lr),
                )
            pairs = [(bare_training(reference, patched, batches, args.lr), checked_training(reference, patched, args.steps, args.lr))
                     for _ in range(args.repeats)]  # fmt: skip
        finally:
            active.close()
    hold_for_session(False)
    bare, checked = min(b for b, _ in pairs), min(c for _, c in pairs)
    median = statistics.median(c / b for b, c in pairs)
    print(f"patch {args.patch}, {args.dtype}, {args.steps} AdamW steps, {args.repeats} interleaved pairs")
    print(f"two bare training loops:   {bare * 1e3:8.1f} ms")
    print(
        f"assert_trains_equivalent:  {checked * 1e3:8.1f} ms  ({checked / bare:.2f}x bare, median ratio {median:.2f}x; goal: median <= 1.15x)"
    )


if __name__ == "__main__":
    main()
