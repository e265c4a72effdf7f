"""What a family sweep costs: resolving ``families="patched"``, and a swept test against separate tests.

1. Resolving ``families="patched"`` for the mapping ``{"^(Llama|Gemma)RMSNorm$": ...}`` in a fresh
   process: cold (an empty cache folder: the lint's scan index and the table of every family's
   towers are built) and warm (both read from the cache). Goals: at most 10 s cold,
   1 s warm. The time counts ``sweep_families`` alone, after torch and transformers are imported,
   as they are in a pytest session that builds models.
2. One swept test, ``@pytest.mark.model(["llama", "gemma", "llava", "paligemma"])``, against the
   same four families as four separately written tests, each a pytest run of its own process
   (collection and the plugin's work included), alternating, best of ``ROUNDS``. Goal: at most 1.1x.

Run: python benchmarks/bench_sweeps.py [ROUNDS]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ["llama", "gemma", "llava", "paligemma"]
KEY = "^(Llama|Gemma)RMSNorm$"

RESOLVE = """
import time
import torch, transformers  # a model-building session has these already
start = time.perf_counter()
from pytest_modelpatch.models.sweeps import sweep_families
swept = sweep_families("patched", [{key!r}])
print(time.perf_counter() - start, len(swept))
"""

NORM = """
import pytest
from fixtures.patches.mechanisms import LlamaStyleNorm
from pytest_modelpatch import assert_equivalent

PATCH = pytest.mark.patch({{{key!r}: LlamaStyleNorm}})
"""

SWEPT = (
    NORM
    + """

@pytest.mark.model({families!r})
@PATCH
def test_norm(reference_model, patched_model):
    try:
        assert_equivalent(reference_model, patched_model)
    except AssertionError:
        pass  # Gemma's norm is (1 + weight) * x: the failure is expected; the cost is what is measured
"""
)

SEPARATE = NORM + "".join(
    f"""

@pytest.mark.model({family!r})
@PATCH
def test_norm_{family}(reference_model, patched_model):
    try:
        assert_equivalent(reference_model, patched_model)
    except AssertionError:
        pass
"""
    for family in FAMILIES
)


def _env(cache: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MODELPATCH_CACHE_DIR": cache}


def resolve_seconds(cache: str) -> tuple[float, int]:
    run = subprocess.run([sys.executable, "-c", RESOLVE.format(key=KEY)], env=_env(cache), capture_output=True,
                         text=True, check=True)  # fmt: skip
    seconds, count = run.stdout.split()
    return float(seconds), int(count)


def session_seconds(folder: Path, cache: str) -> float:
    # a basetemp of its own: pytest would otherwise rotate the shared /tmp/pytest-of-<user> under other sessions
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--basetemp", str(folder.parent / f"basetemp-{folder.name}"), str(folder)],
        env=_env(cache), capture_output=True, text=True, check=False, cwd=folder,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"the session in {folder} failed:\n{run.stdout[-3000:]}")
    return time.perf_counter() - start


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-sweeps-") as scratch:
        cache = str(Path(scratch) / "cache")
        cold, count = resolve_seconds(cache)
        warm = min(resolve_seconds(cache)[0] for _ in range(3))
        print(f'resolving families="patched" for {KEY!r} ({count} families):')
        print(f"  cold (scan index and towers built): {cold:6.2f} s   goal <= 10 s")
        print(f"  warm (both cached):                 {warm:6.2f} s   goal <= 1 s")
        swept, separate = Path(scratch) / "swept", Path(scratch) / "separate"
        for folder, text in ((swept, SWEPT.format(key=KEY, families=FAMILIES)), (separate, SEPARATE.format(key=KEY))):
            folder.mkdir()
            (folder / "test_norm.py").write_text(text)
        session_seconds(swept, cache)  # untimed: the checkpoints, the bytecode and the page cache are warm for both
        times: dict[str, list[float]] = {"swept": [], "separate": []}
        for _ in range(rounds):
            times["swept"].append(session_seconds(swept, cache))
            times["separate"].append(session_seconds(separate, cache))
        best = {name: min(values) for name, values in times.items()}
        print(f"one test swept over {len(FAMILIES)} families vs {len(FAMILIES)} separate tests (best of {rounds}):")
        print(f"  separate: {best['separate']:6.2f} s")
        print(f"  swept:    {best['swept']:6.2f} s   {best['swept'] / best['separate']:.2f}x   goal <= 1.1x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
