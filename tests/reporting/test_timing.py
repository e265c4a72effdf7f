"""--modelpatch-timing: both models' forwards timed apart from the check, a speedup column, a speed gate."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_modelpatch.compare.forward.timing import (
    ModelTiming,
    clock_for,
    cuda_event_seconds,
    peak_bytes,
    time_models,
    wall_seconds,
)
from pytest_modelpatch.reporting.gate import Thresholds, evaluate
from pytest_modelpatch.reporting.report import speedup_cell, summary_lines, write_report
from tests.reporting.test_cli_gate import modelpatch
from tests.reporting.test_schema import assert_valid_report

SUITE = """
import time

import pytest
from transformers.models.llama.modeling_llama import LlamaMLP
from pytest_modelpatch import assert_equivalent, check_equivalent


class SlowMLP(LlamaMLP):
    def forward(self, x):
        time.sleep(0.05)  # a kernel that lost its speed: same numbers, much later
        return super().forward(x)


class SameMLP(LlamaMLP):
    pass


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": SlowMLP})
def test_slow(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    check_equivalent(reference_model, patched_model, max_examples=3)


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": SameMLP})
def test_neutral(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def _rows(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["nodeid"].rpartition("::")[2], r["check"]): r for r in json.loads(path.read_text())["rows"]}


# ---------------------------------------------------------------------------
# the clock and the figures
# ---------------------------------------------------------------------------


def test_cuda_models_are_timed_with_cuda_events_and_all_others_by_the_host_clock() -> None:
    assert clock_for(torch.device("cuda", 0)) is cuda_event_seconds
    assert clock_for(torch.device("cuda")) is cuda_event_seconds
    assert clock_for(torch.device("cpu")) is wall_seconds
    assert clock_for(torch.device("meta")) is wall_seconds


def test_the_host_clock_measures_the_call_and_cpu_peak_memory_is_unknown() -> None:
    assert 0.02 <= wall_seconds(lambda: time.sleep(0.02)) < 1.0
    assert peak_bytes(lambda: torch.ones(1000), torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_the_kernels_and_peak_memory_counts_the_forwards_working_memory() -> None:
    device = torch.device("cuda")
    x = torch.randn(2048, 2048, device=device)
    assert cuda_event_seconds(lambda: x @ x) > 0
    assert peak_bytes(lambda: x @ x, device) >= 2048 * 2048 * 4  # the product is allocated during the call


def test_speedup_is_reference_over_patched_seconds() -> None:
    timing = ModelTiming(reference_s=0.002, patched_s=0.001)
    assert timing.speedup == 2.0
    assert timing.to_dict() == {"reference_s": 0.002, "patched_s": 0.001, "speedup": 2.0,
                                "reference_peak_bytes": None, "patched_peak_bytes": None}  # fmt: skip


def test_time_models_tells_the_slower_model(tiny_pair: Any) -> None:
    reference, patched = tiny_pair
    slow = patched.model.layers[0].mlp
    slow.register_forward_pre_hook(lambda module, args: time.sleep(0.005))
    timing = time_models(reference, patched, {"input_ids": torch.tensor([[1, 2, 3]])}, warmup=1, repeats=3)
    assert timing.patched_s >= 0.005 and timing.speedup < 1
    assert timing.measurable and "no measurable difference" not in str(timing)


def test_one_model_timed_against_itself_shows_no_measurable_difference(tiny_pair: Any) -> None:
    # the same code on both sides: whatever the ratio of the medians, it is the noise of the repeats
    model, _ = tiny_pair
    timing = time_models(model, model, {"input_ids": torch.tensor([[1, 2, 3]])}, warmup=1, repeats=9)
    assert not timing.measurable, timing
    assert str(timing).startswith("no measurable difference: reference ") and "within the spread" in str(timing)
    row = timing.to_dict()
    low, high = row["reference_spread_s"]
    assert low <= row["reference_s"] <= high and row["measurable"] is False
    assert speedup_cell({"timing": row}).startswith("~")


def test_a_difference_within_the_spread_is_no_measurable_difference_outside_it_a_speedup() -> None:
    noise = ModelTiming(0.0030, 0.0011, reference_spread_s=(0.0010, 0.0031), patched_spread_s=(0.0010, 0.0030))
    assert not noise.measurable and speedup_cell({"timing": noise.to_dict()}) == "~2.73x"
    lines = summary_lines([{"nodeid": "t.py::t", "check": "equivalence#1", "outcome": "passed", "max_abs_error": 0.0,
                            "timing": noise.to_dict()}])  # fmt: skip
    assert "~2.73x" in lines[1] and lines[-1].startswith("~ no measurable difference")
    real = ModelTiming(0.0020, 0.0010, reference_spread_s=(0.0019, 0.0021), patched_spread_s=(0.0009, 0.0011))
    assert real.measurable and speedup_cell({"timing": real.to_dict()}) == "2.00x"
    assert str(real) == "reference 2 ms (1.9-2.1), patched 1 ms (0.9-1.1), speedup 2.00x"


@pytest.fixture
def tiny_pair() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)  # fmt: skip
    reference = LlamaForCausalLM(config)
    patched = LlamaForCausalLM(config)
    patched.load_state_dict(reference.state_dict())
    return reference, patched


# ---------------------------------------------------------------------------
# real runs
# ---------------------------------------------------------------------------


def test_a_slowed_patch_reports_speedup_below_one_and_fails_a_min_speedup_gate(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "no:randomly", "--modelpatch-timing", "--modelpatch-report", "report.json",
                                "-o", "modelpatch_min_speedup=0.25")  # fmt: skip
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the gate, not a test
    result.stdout.fnmatch_lines(["outcome*max abs*max rel*speedup*check*model*", "*modelpatch gate FAILED*"])
    result.stdout.fnmatch_lines(["FAIL test_suite.py::test_slow equivalence#1 (LlamaForCausalLM, logits): speedup 0.*x is below min speedup 0.25x"])  # fmt: skip
    assert "FAIL test_suite.py::test_neutral" not in result.stdout.str()
    report = assert_valid_report(pytester.path / "report.json")
    rows = _rows(pytester.path / "report.json")
    assert len(report["rows"]) == 3
    slow = rows["test_slow", "equivalence#1"]["timing"]
    assert set(slow) == {
        "reference_s",
        "patched_s",
        "speedup",
        "reference_peak_bytes",
        "patched_peak_bytes",
        "reference_spread_s",
        "patched_spread_s",
        "measurable",
    }
    assert slow["measurable"] is True  # 100 ms of sleep is far outside the spread of the repeats
    # two sleeping MLPs per forward: at least 100 ms, against a tiny reference far below that even on a loaded machine
    # (the gate's bar is 0.25x: far above the slow patch's ~0.1x, far below what load does to the neutral one)
    assert slow["patched_s"] >= 0.1 and slow["speedup"] < 0.25
    assert slow["speedup"] == pytest.approx(slow["reference_s"] / slow["patched_s"])
    assert slow["reference_peak_bytes"] is None and slow["patched_peak_bytes"] is None  # CPU: torch counts nothing
    assert rows["test_slow", "property#1"]["timing"]["speedup"] < 0.25  # its worst example, timed the same way
    # the timing forwards are not the check's: its duration stays far below 9 sleeping forwards each
    assert rows["test_slow", "equivalence#1"]["duration_s"] < 9 * slow["patched_s"]

    # modelpatch gate on the same rows: the slow test's report fails --min-speedup, the neutral one's passes
    data = json.loads((pytester.path / "report.json").read_text())
    for name in ("slow", "neutral"):
        mine = [r for r in data["rows"] if r["nodeid"].endswith(f"::test_{name}")]
        write_report(pytester.path / f"{name}.json", data["header"], mine)
    slow_gate = modelpatch("gate", "slow.json", "--min-speedup", "0.25", cwd=pytester.path)
    assert slow_gate.returncode == 1, slow_gate.stdout + slow_gate.stderr
    assert "is below min speedup 0.25x" in slow_gate.stdout and "| speedup |" in slow_gate.stdout
    neutral_gate = modelpatch("gate", "neutral.json", "--min-speedup", "0.25", cwd=pytester.path)
    assert neutral_gate.returncode == 0, neutral_gate.stdout + neutral_gate.stderr


def test_without_the_option_no_extra_forwards_and_no_timing_keys(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "no:randomly", "--modelpatch-report", "report.json")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
    assert all("timing" not in row for row in json.loads((pytester.path / "report.json").read_text())["rows"])
    assert "speedup" not in result.stdout.str()
    # a speed gate on an untimed report says how to time it instead of passing on nothing
    gate = modelpatch("gate", "report.json", "--min-speedup", "0.5", cwd=pytester.path)
    assert gate.returncode == 1 and "run pytest with --modelpatch-timing" in gate.stdout


def test_a_speedup_that_fell_below_the_baseline_fails_only_when_asked() -> None:
    def row(speedup: float) -> dict[str, Any]:
        timing = {"reference_s": 1.0, "patched_s": 1.0 / speedup, "speedup": speedup,
                  "reference_peak_bytes": None, "patched_peak_bytes": None}  # fmt: skip
        return {"nodeid": "t.py::test_kernel", "check": "equivalence#1", "kind": "equivalence", "outcome": "passed",
                "max_abs_error": 0.0, "timing": timing}  # fmt: skip

    baseline = [row(2.0)]
    assert evaluate([row(1.5)], Thresholds(), baseline).passed  # opt-in: no drop limit, no speed verdict
    assert evaluate([row(1.7)], Thresholds(max_speedup_drop=0.2), baseline).passed
    verdict = evaluate([row(1.5)], Thresholds(max_speedup_drop=0.2), baseline)
    assert verdict.failures == [
        "t.py::test_kernel equivalence#1: speedup fell from 2.00x (baseline) to 1.50x, below the allowed 1.60x "
        "(max speedup drop 0.2)"
    ]
