"""Contract lint cost: what the signature, weights and plan checks add to a warm lint of every example patch.

For each example patch in ``fixtures/patches`` (imported first: importing a patch imports torch
and transformers, which a contract lint needs anyway), in one process with a warm scan index:

- baseline: the name lint of its keys in its family (what a warm ``modelpatch lint`` does);
- contract: the same call with ``conversions=``, ``checks`` = all and ``structures=meta_structures``,
  the first time (tiny meta-device models built; the cost a ``modelpatch lint --mapping`` run pays)
  and again (cached: the cost of a second registration of the same patch in a session).

Goal: contract - baseline, summed over all example patches, < 0.2 s. Wall and CPU time are
printed: the machine may be shared.

Run: OMP_NUM_THREADS=1 python benchmarks/bench_lint_contract.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures import PATCH_MODULES, load_patch  # noqa: E402


def timed(call) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    start, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from pytest_modelpatch.lint.patterns import lint_patterns
    from pytest_modelpatch.lint.scan_index import load_index
    from pytest_modelpatch.models.structure import meta_structures

    index = load_index()
    patches = [load_patch(name) for name in PATCH_MODULES]
    lint_patterns(["LlamaAttention"], families=["llama"], index=index)  # warm the lint's own tables
    rows = []
    for name, patch in zip(PATCH_MODULES, patches):
        def names() -> None:
            lint_patterns(list(patch.MAPPING), families=[patch.MODEL_TYPE], index=index)

        def contract() -> None:
            lint_patterns(patch.MAPPING, families=[patch.MODEL_TYPE], conversions=patch.CONVERSIONS, index=index,
                          structures=meta_structures)

        rows.append((name, timed(names), timed(contract), timed(contract)))
    print(f"{'patch':28} {'names':>8} {'contract':>9} {'again':>8}   (wall s)")
    for name, base, first, again in rows:
        print(f"{name:28} {base[0]:8.3f} {first[0]:9.3f} {again[0]:8.3f}")
    base = sum(r[1][0] for r in rows)
    first = sum(r[2][0] for r in rows)
    again = sum(r[3][0] for r in rows)
    cpu_added = sum(r[2][1] for r in rows) - sum(r[1][1] for r in rows)
    print(f"all {len(rows)} patches: names {base:.3f} s, contract {first:.3f} s (x{first / base:.1f}), "
          f"cached {again:.3f} s (x{again / base:.1f})")
    print(f"added by the contract lint: {first - base:.3f} s wall, {cpu_added:.3f} s cpu; "
          f"cached {again - base:.3f} s   (goal < 0.2 s)")


if __name__ == "__main__":
    main()
