"""Cost of assert_backward_equivalent against a bare forward+backward of both models on the same inputs.

Both timings in one run, on the same tiny model and inputs (the config's example inputs with
labels), in ``--repeats`` interleaved pairs. Printed: the best of each, and the median of the pairs'
ratios, which the goal is judged by: a pair takes ~15 ms, so the machine's drift over seconds falls
on both halves alike, and 60 pairs keep the median within a few hundredths from run to run (20
pairs gave medians 0.09 apart). Both models are built as a pytest session builds them
(``ModelBuilder`` inside the test's ``ActivePatches``, the interception wrappers held for the run
as the plugin holds them from ``pytest_configure``), so the reference enters ``pristine()`` and
is verified on every call, as it is for users:

- ``assert_backward_equivalent``: train-mode setup and restore, both steps, every comparison;
- bare: ``model(**inputs).loss.backward()`` for the reference and the patched model, ``.grad``
  cleared between runs (goal: the check <= 1.3x this).

Usage::

    python benchmarks/bench_backward.py                          # llama_swiglu_autograd, fp32
    python benchmarks/bench_backward.py --patch llama_fused_qkv --dtype bfloat16
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
from pytest_modelpatch.compare._engine.inputs import default_inputs
from pytest_modelpatch.compare.backward.equivalence import assert_backward_equivalent
from pytest_modelpatch.compare.backward.step import with_labels
from pytest_modelpatch.isolation.interception import hold_for_session
from pytest_modelpatch.isolation.per_test.patch_spec import PatchSpec
from pytest_modelpatch.isolation.registration import ActivePatches
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest


def bare_step(reference: Any, patched: Any, inputs: dict[str, Any]) -> float:
    start = time.perf_counter()
    for model in (reference, patched):
        model.train()
        model.forward(
            **inputs
        ).loss.backward()  # .forward: the plugin's root hooks (pristine scope, usage counts) are not run
        model.eval()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def checked_step(reference: Any, patched: Any, inputs: dict[str, Any]) -> float:
    start = time.perf_counter()
    assert_backward_equivalent(reference, patched, inputs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", default="llama_swiglu_autograd")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=60)
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
            inputs = with_labels(reference, default_inputs(reference))
            for _ in range(3):  # warm up both paths
                bare_step(reference, patched, inputs), checked_step(reference, patched, inputs)
            # interleaved, so load from the other engineers' jobs falls on both alike
            pairs = [
                (bare_step(reference, patched, inputs), checked_step(reference, patched, inputs))
                for _ in range(args.repeats)
            ]
        finally:
            active.close()
    hold_for_session(False)
    bare, checked = min(b for b, _ in pairs), min(c for _, c in pairs)
    median = statistics.median(c / b for b, c in pairs)
    print(f"patch {args.patch}, {args.dtype}, {args.repeats} interleaved pairs")
    print(f"bare forward+backward of both models: {bare * 1e3:8.2f} ms")
    print(
        f"assert_backward_equivalent:           {checked * 1e3:8.2f} ms  ({checked / bare:.2f}x bare, median ratio {median:.2f}x; goal: median <= 1.3x)"
    )


if __name__ == "__main__":
    main()
