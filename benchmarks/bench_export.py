"""Cost of the export and compile checks against a bare torch.export / torch.compile of the same model.

Timings in one run, on the tiny Llama with the fused-QKV patch:

- bare export: ``torch.export.export`` of the same ``(input_ids, attention_mask) -> logits`` wrapper,
  then one run of its program; ``assert_exports_equivalent`` on the same inputs (goal: <= 1.2x);
- bare compile: ``torch.compile`` of the wrapper and its first call, after ``torch._dynamo.reset()``;
  ``assert_compiles_equivalent`` with the same backend (goal: <= 1.2x).

Each is the median of ``--repeats`` runs. Usage::

    python benchmarks/bench_export.py                       # backend aot_eager, 3 repeats
    python benchmarks/bench_export.py --backend inductor --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `fixtures` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.monkey_patching import register_patch_mapping

from fixtures import load_patch, tiny_config
from pytest_modelpatch.compare.graph.compile import assert_compiles_equivalent
from pytest_modelpatch.compare.graph.export import assert_exports_equivalent
from pytest_modelpatch.compare.graph.parity import LogitsOnly, logits_inputs
from pytest_modelpatch.isolation.guard import builtin_patch_state, isolated_patch_state
from pytest_modelpatch.models.checkpoints import cached_checkpoint, load_pretrained


def median_time(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    patch = load_patch("llama_fused_qkv")
    with tempfile.TemporaryDirectory() as cache, isolated_patch_state():
        path = cached_checkpoint(tiny_config("llama"), cache_dir=cache)
        register_patch_mapping(patch.MAPPING)
        for model_type, transforms in patch.CONVERSIONS.items():
            register_checkpoint_conversion_mapping(model_type, transforms, overwrite=True)
        with builtin_patch_state():
            reference = load_pretrained(path).eval()
        patched = load_pretrained(path).eval()
    inputs = logits_inputs(reference, None)
    call = (inputs["input_ids"], inputs["attention_mask"])

    def bare_export() -> None:
        with torch.no_grad():
            torch.export.export(LogitsOnly(patched), call, strict=False).module()(*call)

    def bare_compile() -> None:
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(LogitsOnly(patched), backend=args.backend)(*call)
        torch._dynamo.reset()

    rows = [
        ("export", median_time(bare_export, args.repeats),
         median_time(lambda: assert_exports_equivalent(reference, patched, inputs), args.repeats)),
        (f"compile ({args.backend})", median_time(bare_compile, args.repeats),
         median_time(lambda: assert_compiles_equivalent(reference, patched, inputs, backend=args.backend), args.repeats)),
    ]  # fmt: skip
    print(f"torch {torch.__version__}, tiny Llama + fused QKV, inputs 2x8, median of {args.repeats}")
    print(f"{'check':<22}{'bare (s)':>10}{'check (s)':>11}{'ratio':>8}  goal <= 1.2x")
    for name, bare, check in rows:
        print(f"{name:<22}{bare:>10.3f}{check:>11.3f}{check / bare:>7.2f}x")


if __name__ == "__main__":
    main()
