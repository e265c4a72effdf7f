"""pytest run by torchrun: the plugin joins the launcher's ranks instead of starting a pool; real torchrun runs.

Each run is ``python -m torch.distributed.run ... -m pytest`` in a subprocess of its own process
group, killed whole when it overstays; ports come from binding port 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.parallel.launcher import LaunchedRank, launched_rank

REPOSITORY = Path(__file__).resolve().parents[2]  # fixtures.patches, and this tree's pytest_modelpatch
RUN_TIMEOUT = 300.0

RIGHT_AND_WRONG = """
import pytest
from fixtures.patches import llama_fused_qkv_tp as fused
from fixtures.patches import llama_swiglu_autograd_broken as broken
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(fused.MAPPING, conversions=fused.CONVERSIONS, tp_plan=fused.TP_PLAN)
@pytest.mark.parallel("tp")
def test_right_patch_under_tp(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(broken.MAPPING)
@pytest.mark.parallel("fsdp")
def test_wrong_patch_under_fsdp(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)  # its autograd drops the up projection's gradient
"""

# what torchrun's rank 0 prints with -rA: each verdict, and the session's, once across every rank's output
VERDICTS = [
    "PASSED test_x.py::test_right_patch_under_tp",
    "FAILED test_x.py::test_wrong_patch_under_fsdp",
    "AssertionError: patched FSDPLlamaForCausalLM differs from reference LlamaForCausalLM in training",
    "parallel('fsdp', world_size=2) on gloo: failed on rank 0 of 2 (the report above is its); rank 1 failed",
    " 1 failed, 1 passed",
]

RANKS_APART = """
import os
import pytest
import torch
import torch.distributed as dist


def test_single_process():
    open(f"ran-on-rank-{os.environ['RANK']}", "w").close()


@pytest.mark.parallel()
def test_rank_1_disagrees():
    assert dist.get_rank() == 0, "rank 1 sees something else"


@pytest.mark.parallel()
def test_collectives_in_lockstep():
    tensor = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(tensor)
    assert tensor.item() == 3.0


@pytest.mark.parallel(world_size=4)
def test_four_ranks():
    pass
"""

A_RANK_DIES = """
import os
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parallel()
def test_before():
    pass


@pytest.mark.parallel()
def test_dies_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))
"""

A_RANK_HANGS = """
import time
import pytest
import torch.distributed as dist


@pytest.mark.parallel(timeout=3)
def test_hangs_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(120)


@pytest.mark.parallel()
def test_never_reached():
    pass
"""

A_TEST_DESTROYS_THE_GROUP = """
import pytest
import torch.distributed as dist


@pytest.mark.parallel()
def test_destroys_the_group():
    dist.destroy_process_group()


@pytest.mark.parallel()
def test_never_reached():
    pass
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _environment(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TORCHELASTIC_", "MODELPATCH_"))}
    # on CI pytest writes each failure's whole message into the short summary too, which would
    # count a verdict twice; the ranks' output is judged as a developer's terminal shows it
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CI", "BUILD_NUMBER")
    for name in names:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPOSITORY), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTEST_DEBUG_TEMPROOT"] = str(folder)  # each rank's numbered basetemp stays inside this test's folder
    env["OMP_NUM_THREADS"] = "1"
    return env


def _torchrun(folder: Path, launcher_args: list[str], pytest_args: list[str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "pytest", *pytest_args,
               "-p", "no:randomly", "-p", "no:cacheprovider"]  # fmt: skip
    return subprocess.Popen(
        command, cwd=folder, env=_environment(folder), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: killed whole, ranks included, if it overstays
    )  # fmt: skip


def _finish(processes: list[subprocess.Popen[str]], timeout: float = RUN_TIMEOUT) -> list[tuple[int, str]]:
    """Each run's exit status and output; a run that overstays is killed with everything it started."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((process.returncode, output))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return results


def _one_node(pytester: pytest.Pytester, *pytest_args: str) -> tuple[int, str]:
    launcher = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", f"--master-port={_free_port()}"]
    (result,) = _finish([_torchrun(pytester.path, launcher, list(pytest_args))])
    return result


def test_torchrun_ranks_pass_the_right_patch_fail_the_wrong_one_and_print_one_verdict(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_x=RIGHT_AND_WRONG)
    code, output = _one_node(pytester, "test_x.py", "-rA", "--modelpatch-report=report.json")
    assert code != 0, output
    for line in VERDICTS:
        assert output.count(line) == 1, f"{line!r} printed {output.count(line)} times:\n{output}"
    import json

    rows = json.loads((pytester.path / "report.json").read_text())["rows"]  # written by rank 0 alone
    outcome = {(r["nodeid"].rpartition("::")[2], r["kind"]): (r["outcome"], r["parallel"]) for r in rows}
    assert outcome == {
        ("test_right_patch_under_tp", "equivalence"): ("passed", {"kind": "tp", "world_size": 2, "rank": 0}),
        ("test_wrong_patch_under_fsdp", "backward"): ("failed", {"kind": "fsdp", "world_size": 2, "rank": 0}),
    }


def test_two_nodes_meeting_over_c10d_give_the_same_verdicts(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x=RIGHT_AND_WRONG)
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        _torchrun(
            pytester.path,
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "modelpatch",
            ],
            ["test_x.py", "-rA"],
        )  # fmt: skip
        for node in (0, 1)
    ]
    results = _finish(nodes)
    output = "\n".join(f"--- node {node} ---\n{text}" for node, (_, text) in enumerate(results))
    for line in VERDICTS:
        assert output.count(line) == 1, f"{line!r} printed {output.count(line)} times:\n{output}"
    # every rank exits with rank 0's status, so each node's torchrun ends with the verdict
    assert [code for code, _ in results] == [1, 1], output


def test_ranks_that_disagree_are_reported_by_rank_0_and_single_process_tests_run_there_alone(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_apart=RANKS_APART)
    code, output = _one_node(pytester, "test_apart.py", "-rs")
    assert code == 1, output
    assert output.count("1 failed, 2 passed, 1 skipped") == 1, output
    for line in [
        "parallel(None, world_size=2) on gloo: the ranks did not agree or did not all finish:",
        "  rank 0 passed",
        "  rank 1 failed",
        "E       AssertionError: rank 1 sees something else",
        "SKIPPED [1] test_apart.py:23: parallel(None, world_size=4) needs 4 ranks and the launcher started 2 "
        "(WORLD_SIZE=2): run it under a launcher of 4 ranks, or without a launcher (the plugin starts its own)",
    ]:
        assert output.count(line) == 1, f"{line!r} printed {output.count(line)} times:\n{output}"
    assert sorted(p.name for p in pytester.path.glob("ran-on-rank-*")) == ["ran-on-rank-0"]


def test_a_rank_that_dies_is_named_with_its_test_by_torchrun(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_dies=A_RANK_DIES)
    code, output = _one_node(pytester, "test_dies.py")
    assert code != 0, output
    assert "exitcode  : 3" in output, output
    assert "traceback : rank 1 of 2 ended while it ran test_dies.py::test_dies_on_rank_1" in output, output
    assert "ran test_dies.py::test_before" not in output, output


def test_a_rank_that_hangs_fails_its_test_after_the_timeout_and_stops_the_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_hangs=A_RANK_HANGS)
    start = time.monotonic()
    code, output = _one_node(pytester, "test_hangs.py")
    elapsed = time.monotonic() - start
    assert code != 0, output
    assert output.count("1 failed in") == 1, output
    assert "  rank 1 did not finish within the test's timeout of 3 s" in output, output
    assert "Interrupted: a rank did not finish test_hangs.py::test_hangs_on_rank_1 within its timeout of 3 s" in output
    assert "test_never_reached" not in output, output
    assert elapsed < 90, f"the hang took {elapsed:.0f} s to fail"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "0"},
            LaunchedRank(1, 2, 0),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, LaunchedRank(1, 2, 1)),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, None),  # no address to meet at: not a launcher
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "MODELPATCH_RANK": "1"}, None),
    ],
    ids=["torchrun", "srun", "no-master", "own-pool"],
)
def test_a_launcher_is_recognised_by_its_environment(environ: dict[str, str], expected: LaunchedRank | None) -> None:
    assert launched_rank(environ) == expected


def test_a_wrong_launcher_environment_is_a_usage_error() -> None:
    with pytest.raises(PatchUsageError, match=r"RANK=2 is outside WORLD_SIZE=2"):
        launched_rank({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_xdist_under_a_launcher_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MODELPATCH_RANK", raising=False)
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = pytester.runpytest("-n", "2", "-p", "no:randomly")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*-n 2 under a launcher (rank 0 of 2): each of the launcher's processes is one rank*"])


def test_a_test_that_destroys_the_group_fails_naming_it_and_stops_the_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_destroys=A_TEST_DESTROYS_THE_GROUP)
    code, output = _one_node(pytester, "test_destroys.py")
    assert code != 0, output
    assert output.count("1 failed in") == 1, output
    assert "  rank 0: the test destroyed the process group (torch.distributed.destroy_process_group())" in output
    assert "make a group of its own with dist.new_group(...)" in output, output
    assert "test_never_reached" not in output, output
