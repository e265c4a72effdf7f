"""What a ``@pytest.mark.parallel("tp")`` test costs against a bare 2-rank script doing the same work.

The plugin's side: one pytest session running ``TESTS`` tests, each ``assert_equivalent`` of the
tiny Llama's patched model sharded by tensor parallelism against its whole reference (the default
``@pytest.mark.model("llama")`` sizes). Each test's time is read in the controller, from its start
to its end (a conftest hook): the first includes starting the pool of ranks; the rest reuse it.

The baseline: a bare script whose 2 ranks, started and joined once (``torch.multiprocessing``,
gloo, as transformers' own ``TensorParallelTesterMixin`` runs), repeat what a test needs: load the
same checkpoint sharded (``DistributedConfig(tp_plan="auto")``) and whole, run both forwards on the
same inputs and compare the logits. Its first iteration includes its start (imports, the group).

Printed: the median of the tests after the first and of the script's iterations after the first,
and their ratio (goal: at most 1.3x); and each whole run less its later tests (process start,
pool or rank start, the first test or iteration, shutdown): the plugin's against the script's
(goal: at most 2 s more). Runs alternate, ``ROUNDS`` of each; medians of the rounds.

Run: python benchmarks/bench_parallel.py [ROUNDS] [TESTS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
TESTS = int(sys.argv[2]) if len(sys.argv) > 2 else 8

TEST_MODULE = """
import pytest
from pytest_modelpatch import assert_equivalent


def make():
    @pytest.mark.model("llama")
    @pytest.mark.parallel("tp")
    def test(reference_model, patched_model):
        assert_equivalent(reference_model, patched_model)
    return test


for i in range({tests}):
    globals()[f"test_{{i}}"] = make()
"""

CONFTEST = """
import json, os, time

TIMES = {}


def pytest_runtest_logstart(nodeid, location):
    TIMES[nodeid] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    TIMES[nodeid] = time.perf_counter() - TIMES[nodeid]


def pytest_sessionfinish(session):
    with open(os.environ["BENCH_OUT"], "w") as handle:
        json.dump(list(TIMES.values()), handle)
"""

BARE = """
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, world, store, path, iterations, out):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(iterations):
        dist.barrier()
        start = time.perf_counter()
        sharded = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto")).eval()
        whole = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            difference = (sharded(ids).logits - whole(ids).logits).abs().max().item()
        assert difference < 1e-4, difference
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(times[1:], handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    path, iterations, out, store = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mp.spawn(rank_main, args=(2, store, path, iterations, out), nprocs=2)
"""


def run_plugin(workdir: Path) -> tuple[float, list[float]]:
    """(the run less its tests after the first: process start, pool start and the first test; the later tests)."""
    out = workdir / "times.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "BENCH_OUT": str(out)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-x",
                    f"--basetemp={workdir / 'tmp'}", str(workdir / "test_bench.py")],
                   cwd=workdir, env=env, check=True, capture_output=True)  # fmt: skip
    total = time.perf_counter() - start
    rest = json.loads(out.read_text())[1:]
    return total - sum(rest), rest


def run_bare(workdir: Path, checkpoint: str) -> tuple[float, list[float]]:
    """(the run less its iterations after the first: process and rank start, the first iteration; the later ones)."""
    out, store = workdir / "bare.json", workdir / f"store-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, str(workdir / "bare.py"), checkpoint, str(TESTS), str(out), str(store)],
                   cwd=workdir, env=env, check=True, capture_output=True)  # fmt: skip
    total = time.perf_counter() - start
    rest = json.loads(out.read_text())
    return total - sum(rest), rest


def main() -> None:
    sys.path.insert(0, str(REPO))
    from pytest_modelpatch.families.catalog import tiny_config
    from pytest_modelpatch.models.checkpoints import cached_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as name:
        workdir = Path(name)
        (workdir / "test_bench.py").write_text(TEST_MODULE.format(tests=TESTS))
        (workdir / "conftest.py").write_text(CONFTEST)
        (workdir / "bare.py").write_text(BARE)
        checkpoint = str(cached_checkpoint(tiny_config("llama"), cache_dir=workdir / "checkpoints"))
        plugin_first, plugin_rest, bare_first, bare_rest = [], [], [], []
        for _ in range(ROUNDS):
            first, rest = run_plugin(workdir)
            plugin_first.append(first)
            plugin_rest.append(statistics.median(rest))
            first, rest = run_bare(workdir, checkpoint)
            bare_first.append(first)
            bare_rest.append(statistics.median(rest))
    test, bare = statistics.median(plugin_rest), statistics.median(bare_rest)
    first, start = statistics.median(plugin_first), statistics.median(bare_first)
    print(f"parallel('tp') assert_equivalent, tiny llama, 2 gloo ranks, {TESTS} tests, median of {ROUNDS} rounds")
    print(
        f"  per test after the first: plugin {test * 1000:.0f} ms, bare script {bare * 1000:.0f} ms: {test / bare:.2f}x (goal <= 1.3x)"
    )
    print(f"  start and first test (pytest, the pool of ranks): {first:.2f} s; the bare script's start and first "
          f"iteration: {start:.2f} s; {first - start:+.2f} s (goal <= +2 s)")  # fmt: skip


if __name__ == "__main__":
    main()
