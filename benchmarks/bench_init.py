"""Cost of the non-degenerate init: building a cached tiny checkpoint with it vs transformers' own init.

Builds ``cached_checkpoint`` of each family's default tiny config into a fresh
cache directory (build, init, ``save_pretrained``: what a test session pays on a
cache miss), alternating ``init="transformers"`` (the baseline) and
``init="modelpatch"`` in the same process, and takes the median of each. Goal:
ratio <= 1.05x.

Usage: ``python benchmarks/bench_init.py [--repeats 15] [llama bert ...]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers.utils import logging as transformers_logging

from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.models.checkpoints import cached_checkpoint

FAMILIES = ("llama", "bert", "qwen3_moe", "gpt2", "mamba")
GOAL = 1.05


def build_seconds(model_type: str, init: str, scratch: Path) -> float:
    """Seconds for one cache miss: a fresh directory, so nothing is reused."""
    config = tiny_config(model_type)
    cache = Path(tempfile.mkdtemp(dir=scratch))
    start = time.perf_counter()
    cached_checkpoint(config, cache_dir=cache, init=init)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers_logging.set_verbosity_error()
    print(f"{'family':12s} {'transformers':>13s} {'modelpatch':>11s}  ratio")
    totals = {"transformers": 0.0, "modelpatch": 0.0}
    with tempfile.TemporaryDirectory(prefix="bench-init-") as tmp:
        scratch = Path(tmp)
        for model_type in args.families:
            for init in ("transformers", "modelpatch"):  # warm imports and caches, untimed
                build_seconds(model_type, init, scratch)
            times: dict[str, list[float]] = {"transformers": [], "modelpatch": []}
            for _ in range(args.repeats):
                for init in times:  # alternate, so drift in machine load hits both
                    times[init].append(build_seconds(model_type, init, scratch))
            median = {init: statistics.median(values) for init, values in times.items()}
            for init in totals:
                totals[init] += median[init]
            ratio = median["modelpatch"] / median["transformers"]
            print(
                f"{model_type:12s} {median['transformers'] * 1e3:10.1f} ms {median['modelpatch'] * 1e3:8.1f} ms  {ratio:.3f}x"
            )
    overall = totals["modelpatch"] / totals["transformers"]
    verdict = "within" if overall <= GOAL else "OVER"
    print(f"overall: {overall:.3f}x the transformers-init build ({verdict} the {GOAL:.2f}x goal)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
