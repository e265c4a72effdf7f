"""The rank pool stays healthy: a broken group restarts it, options reach the ranks, nothing is left behind.

A test that destroys the process group fails and the next parallel test passes; ``-o`` and
``--modelpatch-*`` options judge in the ranks as they do in one process; usage errors of a
tensor-parallel test are raised before any rank starts; Ctrl-C returns at once with no rank
left; a pool folder whose controller was killed is removed when the next pool starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_modelpatch.parallel.pool import FOLDER_PREFIX, OWNER_FILE, owner_identity, remove_abandoned
from pytest_modelpatch.parallel.session import CONTROLLER_ONLY, rank_arguments

REPO_ROOT = Path(__file__).resolve().parents[2]

HEALTH = """
import pytest
import torch
import torch.distributed as dist
from transformers.models.llama.modeling_llama import LlamaMLP
from fixtures.patches import llama_fused_qkv_tp as tp
from pytest_modelpatch import assert_equivalent


TYPO = {**tp.TP_PLAN, "layers.*.self_attn.qvk_proj": "colwise"}


class LlamaOnePercentOffMLP(LlamaMLP):
    def forward(self, x):
        return super().forward(x) * 1.01


@pytest.mark.model("llama")
@pytest.mark.parallel("tp", world_size=3)
def test_1_tp_world_size_that_does_not_divide_the_heads(reference_model, patched_model):
    pass


@pytest.mark.model("llama")
@pytest.mark.patch(tp.MAPPING, conversions=tp.CONVERSIONS, tp_plan=TYPO)
@pytest.mark.parallel("tp")
def test_2_tp_plan_typo(reference_model, patched_model):
    pass


@pytest.mark.parallel()
def test_3_destroys_the_group():
    dist.destroy_process_group()


@pytest.mark.parallel()
def test_4_next_parallel_test():
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    assert total.item() == 3.0


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": LlamaOnePercentOffMLP})
@pytest.mark.parallel()
def test_5_atol_in_the_ranks(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": LlamaOnePercentOffMLP})
def test_6_atol_in_one_process(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_a_broken_group_restarts_the_pool_options_reach_the_ranks_and_usage_errors_come_first(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_health=HEALTH)
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_atol=0.5", "--modelpatch-report=report.json")
    result.assert_outcomes(passed=3, failed=1, errors=2)
    result.stdout.fnmatch_lines([
        # raised here, as one paragraph, before a rank of 3 started: no rank's report, no traceback
        "*_ ERROR at setup of test_1_tp_world_size_that_does_not_divide_the_heads _*",
        "PatchUsageError: parallel('tp', world_size=3) cannot shard LlamaForCausalLM: tensor parallelism gives each "
        "rank an equal share of the attention heads, and its heads, 4 (num_attention_heads) and 4 "
        "(num_key_value_heads), do not divide by 3. Use a world size that divides both (2, 4), *",
        "*_ ERROR at setup of test_2_tp_plan_typo _*",
        "PatchUsageError: the tensor-parallel plan does not fit the patched model:",
        "  tp_plan entry 'layers.*.self_attn.qvk_proj' names no module or parameter of the patched model. "
        "Did you mean 'model.layers.*.self_attn.qkv_proj'?",
        "*_ test_3_destroys_the_group _*",
        "parallel(None, world_size=2) on gloo: the test broke the ranks' process group:",
        "  rank 0: the test destroyed the process group (torch.distributed.destroy_process_group())",
        "  rank 1: the test destroyed the process group (torch.distributed.destroy_process_group())",
        "  the ranks' process group belongs to the pool and serves every parallel test after this one: a test must "
        "not call destroy_process_group() or init_process_group(); *The ranks were restarted for the next test.",
    ])  # fmt: skip
    assert "world_size=3) on gloo" not in result.stdout.str()  # no pool of 3 ranks ran it
    rows = {r["nodeid"].rpartition("::")[2]: r for r in json.loads((pytester.path / "report.json").read_text())["rows"]}
    in_ranks, here = rows["test_5_atol_in_the_ranks"], rows["test_6_atol_in_one_process"]
    # off by 1%: over the default tolerance, within -o modelpatch_atol=0.5, in the ranks as in one process
    assert in_ranks["outcome"] == here["outcome"] == "passed" and in_ranks["parallel"]["kind"] is None
    assert in_ranks["max_abs_error"] == here["max_abs_error"] > 1e-3
    assert in_ranks["atol"] == here["atol"] == 0.5


def test_every_option_a_rank_judges_by_is_passed_to_it(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfig(
        "-o", "modelpatch_atol=0.5", "-o", "modelpatch_tolerance_policy=loose", "--modelpatch-device=cpu",
        "--modelpatch-timing", "--modelpatch-leaks=warn", "--modelpatch-report=r.json", "-W", "error::UserWarning",
    )  # fmt: skip
    args = rank_arguments(config, seed=7)
    pairs = list(zip(args, args[1:]))
    assert ("-o", "modelpatch_atol=0.5") in pairs and ("-o", "modelpatch_tolerance_policy=loose") in pairs
    assert ("-o", "addopts=") in pairs[pairs.index(("-o", "modelpatch_atol=0.5")) :]  # after the user's overrides
    expected = {"--modelpatch-device=cpu", "--modelpatch-timing", "--modelpatch-leaks=warn", "--modelpatch-seed=7"}
    assert expected <= set(args)
    assert ("-W", "error::UserWarning") in pairs
    # the session's outputs are written by the process that sends the tests, never by a rank
    assert not any(a.startswith("--modelpatch-report") for a in args)
    options = {name for name in vars(config.option) if name.startswith("modelpatch_")}
    assert CONTROLLER_ONLY <= options, "a controller-only option that no longer exists"


def test_a_pool_folder_is_removed_only_when_its_owner_is_dead(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folders = {name: tmp_path / f"{FOLDER_PREFIX}{name}" for name in ("dead", "alive", "unowned", "reused")}
    for folder in folders.values():
        folder.mkdir()
    (folders["dead"] / OWNER_FILE).write_text(f"{dead.pid} 1")
    (folders["alive"] / OWNER_FILE).write_text(owner_identity(os.getpid()))
    (folders["reused"] / OWNER_FILE).write_text(f"{os.getpid()} 1")  # our pid, another start time: a dead owner's
    assert sorted(remove_abandoned(tmp_path)) == sorted([folders["dead"], folders["reused"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{FOLDER_PREFIX}alive", f"{FOLDER_PREFIX}unowned"]


# torch is not imported here: the controller's own exit, with torch loaded, takes seconds on a loaded machine
SLEEPS = """
import os
import time

import pytest


@pytest.mark.parallel()
def test_sleeps():
    if os.environ["RANK"] == "0":
        open(os.environ["MODELPATCH_TEST_STARTED"], "w").close()
    time.sleep(300)
"""


def _controller(path: Path, started: Path) -> subprocess.Popen[bytes]:
    # hypothesis' own plugin imports hypothesis in its terminal summary (seconds on a loaded machine): not ours to time
    plugins = ["-p", "no:randomly", "-p", "no:hypothesispytest", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", *plugins, "-q", "test_sleeps.py"]
    # a temporary folder of their own: a pool another test starts meanwhile removes dead controllers' folders too
    (path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "MODELPATCH_TEST_STARTED": str(started), "TMPDIR": str(path / "tmp"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    # Ctrl-C as a terminal sends it: a child inherits an ignored SIGINT (an xdist worker's, on some Pythons),
    # and Python then installs no KeyboardInterrupt handler
    return subprocess.Popen(
        command, cwd=path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def _wait_for(started: Path, controller: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 240
    while not started.exists():
        assert controller.poll() is None, controller.communicate()[0].decode(errors="replace")
        assert time.monotonic() < deadline, "the ranks never started the test"
        time.sleep(0.2)


def _ranks_of(controller: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pytest_modelpatch.parallel.rank" in cmdline and b"--parent" in cmdline:
            if cmdline[cmdline.index(b"--parent") + 1] == str(controller).encode():
                found.append(int(entry.name))
    return found


def _pool_folder(path: Path, controller: int) -> Path:
    for folder in (path / "tmp").glob(f"{FOLDER_PREFIX}*"):
        try:
            if (folder / OWNER_FILE).read_text().split()[0] == str(controller):
                return folder
        except (OSError, IndexError):
            continue
    raise AssertionError(f"no pool folder of process {controller}")


def test_ctrl_c_returns_at_once_and_a_killed_controllers_folder_goes_with_the_next_pool(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_sleeps=SLEEPS)
    started = pytester.path / "started"
    controllers: list[subprocess.Popen[bytes]] = []
    try:
        killed = _controller(pytester.path, started)
        controllers.append(killed)
        _wait_for(started, killed)
        left = _pool_folder(pytester.path, killed.pid)
        killed.kill()  # SIGKILL: no teardown runs; its ranks die with it, its folder stays
        killed.communicate()
        deadline = time.monotonic() + 20
        while _ranks_of(killed.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _ranks_of(killed.pid), "the ranks outlived their killed controller"
        assert left.exists()

        started.unlink()
        interrupted = _controller(pytester.path, started)
        controllers.append(interrupted)
        _wait_for(started, interrupted)
        assert not left.exists(), "the next pool did not remove the folder of a dead controller"
        own = _pool_folder(pytester.path, interrupted.pid)
        start = time.monotonic()
        interrupted.send_signal(signal.SIGINT)
        output = interrupted.communicate(timeout=60)[0].decode(errors="replace")
        elapsed = time.monotonic() - start
        assert "KeyboardInterrupt" in output, output
        # the ranks die at once; the controller's own exit (its terminal summary, interpreter shutdown) takes
        # 1-2 s alone and up to 9 s on a loaded 2-core machine: the bound catches a wait on the ranks (30 s) and
        # no timing of a busy CI host
        assert elapsed < 20, f"Ctrl-C took {elapsed:.1f} s to return"
        assert not _ranks_of(interrupted.pid) and not own.exists()
    finally:  # a failed assertion leaves no controller (its ranks die with it) behind
        for controller in controllers:
            if controller.poll() is None:
                controller.kill()
                controller.communicate()
