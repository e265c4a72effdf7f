"""What the plugin costs a suite that never uses it: 1000 trivial tests, with and without it.

The test module imports torch and ``transformers.models.llama.modeling_llama`` (so the
leak guard has a modeling module and the attention registries to watch). Baseline: the
same run with ``-p no:modelpatch``, measured in the same invocation, alternating, best of
``ROUNDS``. Printed: the test loop's time (first setup to last teardown, from a conftest
hook, so torch's import does not dilute the ratio) and the whole process's wall time.
Goals: the run of 1000 tests at most 1.02x as long with the plugin as without it,
which is the process line, and at most about 0.1 ms a test, which is the test loop's difference. The loop ratio itself
is printed too: the baseline loop costs ~0.6-0.7 ms a test, so 0.1 ms is ~1.15x there. The guard
runs from hooks (``isolation/per_test/scopes.py``'s ``IsolationScopes.open``), not from an autouse fixture, whose
set-up and tear-down alone cost every test ~0.025 ms. Two scenarios: a bare import, and a session
that has loaded a model, whose conversion table (251 entries, 1390 converters on 5.23) the guard
also watches; a per-entry Python loop over it cost every test 0.31 ms (1.44x) until the guard's
fast path compared it in C. What is left (~0.03-0.04 ms a test, measured in-process): the guard's
identity comparison of transformers' registries, the watched modeling modules and their classes
(memory-bound: ~2,000 objects touched a test), opening the test's scope, and pytest's hook wrappers.
The subprocesses import this checkout's package (PYTHONPATH), not an editable install's, and
cache bytecode as Python does by default (in a temporary folder, even where PYTHONDONTWRITEBYTECODE
is set): otherwise every run compiles the plugin and pytest rewrites its asserts again, ~0.1 s a
run, which counted 1.022x for the whole run of 1200 tests where the cached run counts 1.019x. An
untimed run of each kind fills the cache first.

``--instructions`` counts instead of timing, for a machine too noisy to time ~0.05 ms: the
after-a-model-load scenario under valgrind's cachegrind (~10 min on two cores), at 200 and 1200
tests with and without the plugin, so fixed costs (imports, collection) cancel; it prints the
instructions and first-level data-cache misses a test costs, with and without the plugin, and the
instructions of the whole 1200-test run, the process ratio counted instead of timed.

Run: python benchmarks/bench_overhead.py [ROUNDS] [--instructions]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = 1000
REPO = Path(__file__).resolve().parent.parent

MODULE = """
import torch
from transformers.models.llama import modeling_llama
{setup}


def make(i):
    def test():
        assert modeling_llama.LlamaRMSNorm is not None
    return test


for i in range({tests}):
    globals()[f"test_{{i}}"] = make(i)
"""

# A session that has loaded a model has transformers' conversion table built (251 entries, 1390
# converters on 5.23): the guard watches it, so it is measured apart from a bare import.
AFTER_LOAD = "after a model load (conversion table built)"
SCENARIOS = {
    "modeling module imported": "",
    AFTER_LOAD: (
        "from transformers.conversion_mapping import get_checkpoint_conversion_mapping\n"
        "get_checkpoint_conversion_mapping('llama')"
    ),
}

CONFTEST = """
import time
import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        print(f"\\nLOOP_SECONDS={time.perf_counter() - start:.4f}")
"""


def pytest_args(plugin: bool) -> list[str]:
    """The pytest command of every run: quiet, one process, with or without the plugin."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:xdist"]
    return args if plugin else [*args, "-p", "no:modelpatch"]


def write_suite(folder: Path, tests: int, setup: str) -> Path:
    """``folder`` with the trivial test module and the loop-timing conftest in it."""
    folder.mkdir()
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_trivial.py").write_text(MODULE.format(tests=tests, setup=setup))
    return folder


def pytest_env(folder: Path) -> dict[str, str]:
    """One thread, this checkout's package (not whichever one the venv has installed: an editable
    install points at one worktree only), and bytecode cached beside ``folder`` (shared by every
    suite of one benchmark run).

    Python caches bytecode, and pytest the assertion-rewritten plugin and test modules, unless
    PYTHONDONTWRITEBYTECODE is set (as on the machine these figures come from). Without the cache
    every run compiles and rewrites the plugin's modules again, ~0.1 s no user pays more than once;
    the prefix keeps the cache out of the checkout.
    """
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "PYTHONPYCACHEPREFIX": str(folder.parent / "pycache"),
    }
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run(folder: Path, plugin: bool) -> tuple[float, float]:
    """(test loop seconds, process wall seconds) of one pytest run."""
    start = time.perf_counter()
    done = subprocess.run(
        pytest_args(plugin), cwd=folder, env=pytest_env(folder), capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    found = re.search(r"LOOP_SECONDS=([\d.]+)", done.stdout)
    if done.returncode != 0 or found is None or f"{TESTS} passed" not in done.stdout:
        raise SystemExit(f"pytest failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return float(found.group(1)), wall


def counted(folder: Path, plugin: bool, tests: int) -> dict[str, int]:
    """cachegrind's totals (Ir, D1mr, D1mw, ...) for one pytest run of ``tests`` trivial tests."""
    write_suite(folder, tests, SCENARIOS[AFTER_LOAD])
    out = folder / "cachegrind.out"
    args = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--cachegrind-out-file={out}", *pytest_args(plugin)]
    done = subprocess.run(args, cwd=folder, env=pytest_env(folder), capture_output=True, text=True, check=False)
    if done.returncode != 0 or f"{tests} passed" not in done.stdout:
        raise SystemExit(
            f"pytest under cachegrind failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    text = out.read_text()
    events = re.search(r"^events: (.+)$", text, re.M)
    summary = re.search(r"^summary: (.+)$", text, re.M)
    assert events is not None and summary is not None, "no cachegrind totals"
    return dict(zip(events.group(1).split(), map(int, summary.group(1).split())))


def instructions() -> None:
    from concurrent.futures import ThreadPoolExecutor

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind on PATH")
    low, high = 200, 1200
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        warm = write_suite(
            Path(tmp) / "warm-up", TESTS, SCENARIOS[AFTER_LOAD]
        )  # fills the bytecode cache the counted runs share
        for plugin in (False, True):
            run(warm, plugin)
        runs = {(plugin, n): pool.submit(counted, Path(tmp) / f"{plugin}-{n}", plugin, n)
                for plugin in (False, True) for n in (low, high)}  # fmt: skip
        totals = {key: future.result() for key, future in runs.items()}

    def per_test(plugin: bool, event: str) -> float:
        return (totals[(plugin, high)][event] - totals[(plugin, low)][event]) / (high - low)

    print(f"after a model load, counted by cachegrind: ({high} tests - {low} tests) / {high - low}")
    for label, events in (("instructions", ("Ir",)), ("D1 misses", ("D1mr", "D1mw"))):
        base = sum(per_test(False, e) for e in events)
        with_plugin = sum(per_test(True, e) for e in events)
        print(
            f"  {label:12s} a test: -p no:modelpatch {base:12,.0f} | with plugin {with_plugin:12,.0f} | "
            f"ratio {with_plugin / base:.3f}x | +{with_plugin - base:,.0f}"
        )
    # the whole run, imports and collection included: the goal's ratio, counted instead of timed
    base, with_plugin = totals[(False, high)]["Ir"], totals[(True, high)]["Ir"]
    print(
        f"  instructions, the whole run of {high} tests: -p no:modelpatch {base:,} | with plugin {with_plugin:,} | "
        f"ratio {with_plugin / base:.3f}x (goal <= 1.02x)"
    )


def main() -> None:
    if "--instructions" in sys.argv[1:]:
        instructions()
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 5
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for k, (scenario, setup) in enumerate(SCENARIOS.items()):
            # a folder each, so no run compiles a test module another run changed
            folder = folders[scenario] = write_suite(Path(tmp) / f"scenario-{k}", TESTS, setup)
            for plugin in (False, True):
                run(folder, plugin)  # untimed: fills the bytecode cache
        results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
        for _ in range(rounds):
            for scenario, folder in folders.items():
                for plugin in (False, True):
                    results.setdefault((scenario, plugin), []).append(run(folder, plugin))
    print(f"{TESTS} trivial tests, best of {rounds} (module imports torch and modeling_llama)")
    for scenario in SCENARIOS:
        base, with_plugin = results[(scenario, False)], results[(scenario, True)]
        base_loop, base_wall = min(r[0] for r in base), min(r[1] for r in base)
        with_loop, with_wall = min(r[0] for r in with_plugin), min(r[1] for r in with_plugin)
        print(f"{scenario}")
        print(
            f"  test loop: -p no:modelpatch {base_loop:.3f} s | with plugin {with_loop:.3f} s | "
            f"ratio {with_loop / base_loop:.3f}x | {(with_loop - base_loop) / TESTS * 1e3:.3f} ms/test (goal: about 0.1 ms)"
        )
        print(
            f"  process:   -p no:modelpatch {base_wall:.3f} s | with plugin {with_wall:.3f} s | "
            f"ratio {with_wall / base_wall:.3f}x (goal <= 1.02x)"
        )


if __name__ == "__main__":
    main()
