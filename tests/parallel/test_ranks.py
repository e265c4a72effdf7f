"""Ranks that misbehave fail the test clearly, in bounded time, and leave no process behind; pools are reused."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

MISBEHAVING = """
import os
import time

import pytest
import torch
import torch.distributed as dist


def rank():
    return dist.get_rank()


@pytest.mark.parallel(timeout=20)
def test_1_raises_on_one_rank():
    if rank() == 1:
        raise ValueError("broken on rank 1 only")


@pytest.mark.parallel(timeout=4)
def test_2_raises_before_a_collective_the_other_rank_waits_in():
    if rank() == 1:
        raise ValueError("rank 1 never reaches the all_reduce")
    dist.all_reduce(torch.ones(1))


@pytest.mark.parallel(timeout=20)
def test_3_exits():
    if rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


@pytest.mark.parallel(timeout=4)
def test_4_hangs():
    if rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


@pytest.mark.parallel()
def test_5_skips_on_one_rank():
    if rank() == 1:
        pytest.skip("rank 1 decided alone")


@pytest.mark.parallel()
def test_6_runs_after_them_in_a_fresh_pool():
    tensor = torch.tensor([rank() + 1.0])
    dist.all_reduce(tensor)
    assert tensor.item() == 3.0


@pytest.mark.parallel()
def test_7_skips_on_every_rank():
    pytest.skip("every rank agrees")
"""


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and "pytest_modelpatch.parallel.rank" in cmdline:
                found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def test_a_rank_that_raises_exits_hangs_or_skips_alone_fails_the_test_in_bounded_time_with_no_rank_left(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_ranks=MISBEHAVING)
    start = time.monotonic()
    result = pytester.runpytest("-rs", "--durations=0")
    elapsed = time.monotonic() - start
    result.assert_outcomes(failed=5, passed=1, skipped=1)
    result.stdout.fnmatch_lines_random([
        # raising: that rank's own traceback and number
        "*parallel(None, world_size=2) on gloo: the ranks did not agree or did not all finish:",
        "*rank 0 passed",
        "*rank 1 failed",
        "*--- rank 1 (call) ---",
        "*ValueError: broken on rank 1 only",
        # raising before a collective: the waiting rank is stopped after a grace, with its stack
        "*rank 0 did not finish within 4 s after rank 1 failed",
        "*in test_2_raises_before_a_collective_the_other_rank_waits_in",
        # exiting: its exit code
        "*rank 1 exited with code 3 during the test",
        # hanging: every rank's stack, after the test's timeout
        "*rank 0 did not finish within the test's timeout of 4 s",
        "*rank 1 did not finish within the test's timeout of 4 s",
        "*in test_4_hangs",
        # skipping alone is a failure
        "*rank 1 skipped (rank 1 decided alone)",
        "*a rank must not decide on its own to skip*",
        "SKIPPED*every rank agrees*",
    ])  # fmt: skip
    assert elapsed < 120, f"misbehaving ranks took {elapsed:.0f} s to fail"
    leftovers = _processes_mentioning(str(pytester.path))
    assert not leftovers, f"rank processes outlived the session: {leftovers}"


TWO_FILES = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parallel()
@pytest.mark.parametrize("value", [1.0, 2.0])
def test_all_reduce(value):
    tensor = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    assert tensor.item() == 3 * value
"""


def test_xdist_workers_run_parallel_tests_at_once_each_with_its_own_pool(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_first=TWO_FILES, test_second=TWO_FILES)
    result = pytester.runpytest("-n", "2", "--dist", "loadfile")
    result.assert_outcomes(passed=4)
    assert not _processes_mentioning(str(pytester.path))
