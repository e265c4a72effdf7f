"""Cost of assert_decodes_equivalent against two bare generate() calls with the same settings.

Both sides decode the same tiny models from the same default prompts (a left-padded batch of 3,
unequal lengths), greedily, ``--new-tokens`` tokens, with the same cache. The bare side is
``reference.generate(...)`` plus ``patched.generate(...)``; the check also compares every step's
logits and tokens (goal: at most 1.2x). ``--repeats`` interleaved pairs, measured in this run:
the medians of each side, and the median of the pairs' ratios, which the goal is judged by.

Usage::

    python benchmarks/bench_decoding.py                         # llama_fused_qkv, dynamic and static
    python benchmarks/bench_decoding.py --patch mistral_fused_qkv --new-tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `fixtures` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.monkey_patching import register_patch_mapping

from fixtures import load_patch, tiny_config
from pytest_modelpatch.compare.decoding.equivalence import assert_decodes_equivalent, default_prompts
from pytest_modelpatch.isolation.guard import builtin_patch_state, isolated_patch_state
from pytest_modelpatch.models.checkpoints import cached_checkpoint, load_pretrained


def paired_times(bare: Callable[[], Any], check: Callable[[], Any], repeats: int) -> tuple[list[float], list[float]]:
    """``repeats`` interleaved (bare, check) pairs, the order alternating, after one warm-up of each.

    A pair takes ~50 ms, so the drift of a shared machine over seconds falls on both halves alike:
    two separate medians of 20 runs moved from 0.44x to 1.67x between runs; paired ratios do not.
    """
    bare(), check()  # warm-up: first-call allocations and lazy imports
    bares, checks = [], []
    for index in range(repeats):
        for run, times in ((bare, bares), (check, checks))[:: 1 if index % 2 == 0 else -1]:
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return bares, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", default="llama_fused_qkv")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    patch = load_patch(args.patch)
    with tempfile.TemporaryDirectory() as cache, isolated_patch_state():
        path = cached_checkpoint(tiny_config(patch.MODEL_TYPE), cache_dir=Path(cache))
        with builtin_patch_state():
            reference = load_pretrained(path)
        register_patch_mapping(patch.MAPPING)
        for model_type, transforms in patch.CONVERSIONS.items():
            register_checkpoint_conversion_mapping(model_type, transforms, overwrite=True)
        patched = load_pretrained(path)
    prompts = default_prompts(reference)
    print(
        f"{args.patch}: batch {tuple(prompts['input_ids'].shape)}, {args.new_tokens} new tokens, {args.repeats} interleaved pairs"
    )
    for cache_implementation in (None, "static"):
        settings = {"max_new_tokens": args.new_tokens, "cache_implementation": cache_implementation}

        def bare() -> None:
            with torch.no_grad():
                for model in (reference, patched):
                    model.generate(**prompts, **settings, do_sample=False, eos_token_id=None, pad_token_id=0)

        def check() -> None:
            assert_decodes_equivalent(reference, patched, prompts, **settings)

        bares, checks = paired_times(bare, check, args.repeats)
        ratio = statistics.median(c / b for b, c in zip(bares, checks))
        print(f"  {cache_implementation or 'dynamic'} cache: two generate() {statistics.median(bares) * 1e3:.1f} ms, "
              f"assert_decodes_equivalent {statistics.median(checks) * 1e3:.1f} ms, "
              f"median ratio of the pairs {ratio:.2f}x (goal <= 1.2x)")  # fmt: skip


if __name__ == "__main__":
    main()
