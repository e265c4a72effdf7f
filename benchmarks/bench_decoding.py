"""Cost of assert_generates_equivalent against two bare generate() calls with the same settings.

Both sides decode the same tiny models from the same default prompts (a left-padded batch of 3,
unequal lengths), greedily, ``--new-tokens`` tokens, with the same cache. The bare side is
``reference.generate(...)`` plus ``patched.generate(...)``; the check also compares every step's
logits and tokens (goal: at most 1.2x). Medians of ``--repeats`` runs, measured in this run.

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
from pytest_modelpatch.compare.decoding import assert_generates_equivalent, default_prompts
from pytest_modelpatch.isolation.guard import isolated_patch_state, without_patches
from pytest_modelpatch.models.checkpoints import cached_checkpoint, load_pretrained


def median_time(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm-up: first-call allocations and lazy imports
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", default="llama_fused_qkv")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    patch = load_patch(args.patch)
    with tempfile.TemporaryDirectory() as cache, isolated_patch_state():
        path = cached_checkpoint(tiny_config(patch.MODEL_TYPE), cache_dir=Path(cache))
        with without_patches():
            reference = load_pretrained(path)
        register_patch_mapping(patch.MAPPING)
        for model_type, transforms in patch.CONVERSIONS.items():
            register_checkpoint_conversion_mapping(model_type, transforms, overwrite=True)
        patched = load_pretrained(path)
    prompts = default_prompts(reference)
    print(f"{args.patch}: batch {tuple(prompts['input_ids'].shape)}, {args.new_tokens} new tokens, median of {args.repeats}")
    for cache_implementation in (None, "static"):
        settings = {"max_new_tokens": args.new_tokens, "cache_implementation": cache_implementation}

        def bare() -> None:
            with torch.no_grad():
                for model in (reference, patched):
                    model.generate(**prompts, **settings, do_sample=False, eos_token_id=None, pad_token_id=0)

        def check() -> None:
            assert_generates_equivalent(reference, patched, prompts, **settings)

        baseline, ours = median_time(bare, args.repeats), median_time(check, args.repeats)
        print(f"  {cache_implementation or 'dynamic'} cache: two generate() {baseline * 1e3:.1f} ms, "
              f"assert_generates_equivalent {ours * 1e3:.1f} ms, ratio {ours / baseline:.2f}x (goal <= 1.2x)")  # fmt: skip


if __name__ == "__main__":
    main()
