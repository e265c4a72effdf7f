"""Contract lint cost: what the signature, weights and plan checks add to a warm lint of every example patch.

Each measurement is a fresh process, as a ``modelpatch lint`` run is, with a warm scan index
and every example patch in ``fixtures/patches`` imported first (importing a patch imports torch
and transformers, which a contract lint needs anyway). Per patch, in its family:

- names: the name lint of its keys (what a warm ``modelpatch lint`` does, the baseline);
- contract: the same call with ``conversions=``, every check and ``structures=meta_structures``;
- again: the contract call repeated in the same process (a second registration in a session).

Two kinds of process, interleaved over rounds: ``cold facts`` starts with no contract facts cache
(it parses the family sources and builds the original tiny models, as before the cache existed:
the baseline) and ``warm facts`` with the file the previous cold run wrote. Goal: contract minus
names, summed over all example patches, < 0.2 s in a warm process. The machine may be shared:
best and median over the rounds are printed, and ``gc.collect()`` runs before each timed call so
that a collection triggered by earlier work is not charged to whichever call happens to pay it.

Run: OMP_NUM_THREADS=1 python benchmarks/bench_lint_contract.py [ROUNDS]
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(call: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure() -> dict[str, float]:
    """One process's sums over every example patch: names, contract, again (wall s)."""
    import torch

    from fixtures import PATCH_MODULES, load_patch
    from pytest_modelpatch.lint.model_structures import meta_structures
    from pytest_modelpatch.lint.patterns import lint_patterns
    from pytest_modelpatch.lint.scan_index import load_index

    torch.set_num_threads(1)
    index = load_index()
    patches = [load_patch(name) for name in PATCH_MODULES]
    lint_patterns(["LlamaAttention"], families=["llama"], index=index)  # warm the name lint's own tables
    sums = {"names": 0.0, "contract": 0.0, "again": 0.0}
    for patch in patches:

        def names() -> None:
            lint_patterns(list(patch.MAPPING), families=[patch.MODEL_TYPE], index=index)

        def contract() -> None:
            lint_patterns(
                patch.MAPPING,
                families=[patch.MODEL_TYPE],
                conversions=patch.CONVERSIONS,
                index=index,
                structures=meta_structures,
            )

        sums["names"] += timed(names)
        sums["contract"] += timed(contract)
        sums["again"] += timed(contract)
    return sums


def run_process(cache: Path) -> dict[str, float]:
    env = dict(os.environ, MODELPATCH_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, "--measure"], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int) -> None:
    from pytest_modelpatch.lint.contract.cache import facts_path
    from pytest_modelpatch.lint.scan_index import index_path, load_index

    load_index()  # the scan index is warm in both kinds of process: copied from the caller's cache
    warm_index = index_path()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        os.environ["MODELPATCH_CACHE_DIR"] = str(cache)
        shutil.copy(warm_index, index_path())
        results: dict[str, list[dict[str, float]]] = {"cold facts": [], "warm facts": []}
        for _ in range(rounds):
            facts_path().unlink(missing_ok=True)
            results["cold facts"].append(run_process(cache))
            results["warm facts"].append(run_process(cache))
    print(f"{rounds} rounds, one process each; sums over every example patch, wall s (best / median)")
    added: dict[str, list[float]] = {}
    for kind, rows in results.items():
        added[kind] = [r["contract"] - r["names"] for r in rows]
        again = [r["again"] - r["names"] for r in rows]
        print(
            f"{kind:11} names {_bm([r['names'] for r in rows])}  contract {_bm([r['contract'] for r in rows])}  "
            f"added {_bm(added[kind])}  added again {_bm(again)}"
        )
    ratio = statistics.median(added["warm facts"]) / statistics.median(added["cold facts"])
    print(f"added by the contract lint, warm facts vs cold (the uncached baseline): x{ratio:.2f}   (goal < 0.2 s)")


def _bm(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
    else:
        main(int(sys.argv[1]) if sys.argv[1:] else 5)
