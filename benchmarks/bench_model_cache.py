"""Peak RSS of a session over many model specs, with and without ini ``modelpatch_model_cache``.

300 tests over 30 specs (tiny llama, one seed per spec, so 30 distinct checkpoints and
reference models); each test takes ``reference_model`` and ``patched_model`` and runs
``assert_equivalent``. The same suite runs twice in one invocation, unbounded and with the
bound, each in its own pytest process; a conftest prints the process's peak RSS
(``ru_maxrss``) and the test loop's time. Tests are grouped by spec (as test modules usually
are); ``--interleave`` cycles through the specs instead, the worst case for an LRU.

Run: python benchmarks/bench_model_cache.py [--bound 4] [--tests 300] [--specs 30] [--hidden 256]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MODULE = """
import pytest
from pytest_modelpatch import assert_equivalent

SPECS = {specs}
HIDDEN = {hidden}
ORDER = [i % SPECS for i in range({tests})] if {interleave} else sorted(i % SPECS for i in range({tests}))


def make(seed):
    @pytest.mark.model("llama", seed=seed, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN)
    @pytest.mark.patch(unpatched=True)  # the stock model against itself: the cache's cost is measured
    def test(reference_model, patched_model):
        assert_equivalent(reference_model, patched_model)
    return test


for index, seed in enumerate(ORDER):
    globals()[f"test_{{index:03d}}_spec_{{seed}}"] = make(seed)
"""

CONFTEST = """
import resource
import time

_start = []


def pytest_runtest_setup(item):
    _start.append(time.perf_counter()) if not _start else None


def pytest_sessionfinish(session):
    loop = time.perf_counter() - _start[0] if _start else 0.0
    print(f"\\nBENCH peak_rss_kb={{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}} loop_s={{loop:.2f}}")
"""


def run(folder: Path, bound: str) -> tuple[float, float]:
    """(peak RSS in MB, loop seconds) of one pytest run with ``modelpatch_model_cache = bound``."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-s",
            "-o", f"modelpatch_model_cache={bound}", "--basetemp", str(folder / "tmp")]  # fmt: skip
    done = subprocess.run(args, cwd=folder, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"BENCH peak_rss_kb=(\d+) loop_s=([\d.]+)", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"pytest failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return int(found.group(1)) / 1024, float(found.group(2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bound", default="4", help="modelpatch_model_cache for the bounded run (e.g. 4 or 64MB)")
    parser.add_argument("--tests", type=int, default=300)
    parser.add_argument("--specs", type=int, default=30)
    parser.add_argument(
        "--hidden", type=int, default=256, help="hidden size of every spec (intermediate is twice that)"
    )
    parser.add_argument("--interleave", action="store_true", help="cycle through the specs: every test a cache miss")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(CONFTEST.format())
        (folder / "test_many_specs.py").write_text(
            MODULE.format(specs=args.specs, hidden=args.hidden, tests=args.tests, interleave=args.interleave)
        )
        # each run builds the specs' checkpoints in its own --basetemp, so both pay the same for them
        unbounded, bounded = run(folder, ""), run(folder, args.bound)
    order = "interleaved" if args.interleave else "grouped by spec"
    print(f"{args.tests} tests over {args.specs} llama specs (hidden {args.hidden}), {order}")
    print(f"unbounded                        peak RSS {unbounded[0]:8.1f} MB   test loop {unbounded[1]:6.1f} s")
    print(f"modelpatch_model_cache = {args.bound:<7} peak RSS {bounded[0]:8.1f} MB   test loop {bounded[1]:6.1f} s")
    print(f"bounded/unbounded                peak RSS {bounded[0] / unbounded[0]:.2f}x        "
          f"test loop {bounded[1] / unbounded[1]:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
