"""Pattern lint speed: cold full-library lint vs importing every modeling module, and warm lint.

Baseline (what a lint without an index must do): a fresh interpreter imports every
``transformers.models.*.modeling_*`` module and scans ``dir()`` of each for classes.
Cold lint: a fresh ``python -m pytest_modelpatch lint`` against an empty cache folder,
so it builds the scan index first. Warm lint: the same command again (five times: the
best and the median are printed), and the lint call in-process after reading the cached
index from disk. Goals: cold <= 0.5x, warm <= 0.5 s. Wall time and CPU time (children
included) are both printed: the machine may be shared.

Run: python benchmarks/bench_lint.py
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

KEYS = [".*Attention", ".*MLP", ".*Experts", ".*Layer"]

BASELINE = """
import glob, importlib, os, torch
torch.set_num_threads(1)
import transformers.models
root = transformers.models.__path__[0]
found = 0
for path in sorted(glob.glob(os.path.join(root, "*", "modeling_*.py"))):
    name = "transformers.models.%s.%s" % (os.path.basename(os.path.dirname(path)), os.path.basename(path)[:-3])
    try:
        module = importlib.import_module(name)
    except Exception:
        continue
    found += sum(isinstance(getattr(module, a, None), type) for a in dir(module))
print(found)
"""


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children) for one subprocess."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=False, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as cache:
        env["MODELPATCH_CACHE_DIR"] = cache
        lint = [sys.executable, "-m", "pytest_modelpatch", "lint", *KEYS, "--json"]
        base_wall, base_cpu = timed([sys.executable, "-c", BASELINE], env)
        cold_wall, cold_cpu = timed(lint, env)
        warm = sorted(timed(lint, env) for _ in range(5))
        (warm_wall, warm_cpu), warm_median = warm[0], warm[2][0]

        os.environ["MODELPATCH_CACHE_DIR"] = cache
        from pytest_modelpatch.lint.patterns import lint_patterns
        from pytest_modelpatch.lint.scan_index import load_index

        start, cpu_start = time.perf_counter(), time.process_time()
        index = load_index()
        lint_patterns(KEYS, index=index)
        in_process, in_process_cpu = time.perf_counter() - start, time.process_time() - cpu_start

    print(f"keys: {' '.join(KEYS)} (all families)")
    print(f"baseline: import every modeling module + dir()   wall {base_wall:6.2f} s   cpu {base_cpu:6.2f} s")
    print(f"cold lint (builds the index, CLI)              wall {cold_wall:6.2f} s   cpu {cold_cpu:6.2f} s")
    print(
        f"warm lint (CLI, cached index), best of 5       wall {warm_wall:6.2f} s   cpu {warm_cpu:6.2f} s"
        f"   (median {warm_median:.2f} s)"
    )
    print(f"warm lint in-process (read index + lint)       wall {in_process:6.2f} s   cpu {in_process_cpu:6.2f} s")
    print(f"cold / baseline: wall {cold_wall / base_wall:.2f}x, cpu {cold_cpu / base_cpu:.2f}x   (goal <= 0.5x)")
    print(
        f"warm: CLI {warm_wall:.2f} s (median {warm_median:.2f} s), in-process {in_process:.2f} s wall / {in_process_cpu:.2f} s cpu   (goal <= 0.5 s)"
    )


if __name__ == "__main__":
    main()
