"""The gate: thresholds and baselines judge a run's checks, and a failing gate fails the session."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pytest_modelpatch.reporting.gate import Thresholds, evaluate
from pytest_modelpatch.reporting.records import CheckRecord
from pytest_modelpatch.reporting.report import row_from_record

# A real replacement whose attention output drifts by $MODELPATCH_TEST_EPS: 0 is exact.
SUITE = """
import os
import pytest
from transformers.models.llama.modeling_llama import LlamaAttention
from pytest_modelpatch import assert_equivalent


class DriftingAttention(LlamaAttention):
    def forward(self, *args, **kwargs):
        output, weights = super().forward(*args, **kwargs)
        return output + float(os.environ.get("MODELPATCH_TEST_EPS", "0")), weights


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaAttention": DriftingAttention})
@pytest.mark.tolerance(atol=0.5)
def test_attention(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""

SECOND = """
import pytest
from pytest_modelpatch import assert_module_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_mlp(reference_model, patched_model):
    assert_module_equivalent(reference_model, patched_model, "model.layers.0.mlp")
"""


def test_baseline_passes_then_fails_when_the_patch_drifts_or_a_check_is_removed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_attention_suite=SUITE, test_mlp_suite=SECOND)
    baseline = ["--modelpatch-baseline", "base.json"]
    written = pytester.runpytest("-n", "2", *baseline, "--modelpatch-update-baseline")
    written.assert_outcomes(passed=2)
    written.stdout.fnmatch_lines(["note baseline base.json rewritten with 2 checks"])

    same = pytester.runpytest("-p", "no:xdist", *baseline)
    assert same.ret == pytest.ExitCode.OK
    same.stdout.fnmatch_lines(["modelpatch gate PASSED: 2 checks against baseline base.json, 0 failures"])

    monkeypatch.setenv("MODELPATCH_TEST_EPS", "1e-3")  # still within the test's atol: the test passes
    worse = pytester.runpytest("-n", "2", *baseline)
    worse.assert_outcomes(passed=2)
    assert worse.ret == pytest.ExitCode.TESTS_FAILED
    worse.stdout.fnmatch_lines([
        "modelpatch gate FAILED: 2 checks against baseline base.json, 1 failures",
        (
            "FAIL test_attention_suite.py::test_attention equivalence#1 (LlamaForCausalLM, *): "
            "max abs error grew from 0 (baseline) to *, more than allowed 1e-06 (modelpatch_baseline_factor = 2, *"
        ),
    ])  # fmt: skip

    monkeypatch.delenv("MODELPATCH_TEST_EPS")
    (pytester.path / "test_mlp_suite.py").unlink()
    removed = pytester.runpytest("-p", "no:xdist", *baseline)
    assert removed.ret == pytest.ExitCode.TESTS_FAILED
    removed.stdout.fnmatch_lines(
        ["FAIL test_mlp_suite.py::test_mlp module#1 (*): in the baseline * but did not run; *"]
    )


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("modelpatch_baseline_factor = twice", "'twice': expected a finite, non-negative number"),
        ("modelpatch_baseline_floor = inf", "'inf': expected a finite, non-negative number"),  # any growth would pass
        ("modelpatch_max_abs_error = nan", "'nan': expected a finite, non-negative number"),
        ("modelpatch_max_speedup_drop = 1.5", "'1.5': expected a fraction in [0, 1)"),
    ],
)
def test_bad_gate_settings_are_usage_errors_at_startup(pytester: pytest.Pytester, setting: str, expected: str) -> None:
    pytester.makeini(f"[pytest]\n{setting}\n")
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest("-p", "no:xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: ini {setting.partition(' = ')[0]} = {expected}*"])


@pytest.mark.parametrize(
    "error, expected",
    [
        ('"abc"', 'base.json: rows[0] (test_a.py::test_a): max_abs_error is "abc", expected a number 0 or more'),
        ('"inf"', 'base.json: rows[0] (test_a.py::test_a): max_abs_error is "inf", expected a finite number'),
    ],
    ids=["not a number", "infinite"],
)
def test_a_malformed_or_infinite_baseline_is_a_usage_error_before_any_test_runs(
    pytester: pytest.Pytester, error: str, expected: str
) -> None:
    row = '{"nodeid": "test_a.py::test_a", "check": "equivalence#1", "kind": "equivalence", "outcome": "passed"'
    pytester.path.joinpath("base.json").write_text(f'{{"header": {{}}, "rows": [{row}, "max_abs_error": {error}}}]}}')
    pytester.makepyfile(test_a="def test_a():\n    pass\n")
    result = pytester.runpytest("-p", "no:xdist", "--modelpatch-baseline", "base.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {expected}" in result.stderr.str()  # [0] is no fnmatch pattern
    assert "passed" not in result.stdout.str()  # refused at startup, not after the run


def _row(nodeid: str, error: float | None, outcome: str = "passed", kind: str = "equivalence") -> dict[str, Any]:
    record = CheckRecord(kind=kind, outcome=outcome, model="LlamaForCausalLM", max_abs_error=error, max_rel_error=error)
    return row_from_record(record, nodeid, 1)


def test_growth_within_the_factor_or_the_floor_passes() -> None:
    baseline = [_row("a.py::t", 1e-6), _row("b.py::t", 0.0)]
    verdict = evaluate([_row("a.py::t", 1.9e-6), _row("b.py::t", 1e-9)], Thresholds(), baseline, "base.json")
    assert verdict.passed, str(verdict)


def test_growth_beyond_the_factor_names_the_check_and_both_numbers() -> None:
    verdict = evaluate([_row("a.py::t", 5e-5)], Thresholds(factor=3.0, floor=0.0), [_row("a.py::t", 1e-5)])
    assert verdict.failures == [
        (
            "a.py::t equivalence#1 (LlamaForCausalLM): max abs error grew from 1e-05 (baseline) to 5e-05, "
            "more than allowed 3e-05 (modelpatch_baseline_factor = 3, modelpatch_baseline_floor = 0)"
        )
    ]


def test_thresholds_and_failed_checks_fail_without_a_baseline() -> None:
    rows = [_row("a.py::t", 2e-3), _row("b.py::t", 1e-7, outcome="failed")]
    verdict = evaluate(rows, Thresholds(max_abs_error=1e-3))
    assert not verdict.passed
    assert "a.py::t equivalence#1 (LlamaForCausalLM): max abs error 0.002 exceeds modelpatch_max_abs_error = 0.001" in (
        verdict.failures
    )
    assert any(f.startswith("b.py::t equivalence#1 (LlamaForCausalLM): the check failed") for f in verdict.failures)


def test_new_checks_are_noted_not_failed_and_markdown_shows_the_verdict() -> None:
    verdict = evaluate([_row("a.py::t", 0.0), _row("new.py::t", 0.1)], Thresholds(), [_row("a.py::t", 0.0)], "b.json")
    assert verdict.passed and verdict.notes == [
        "1 checks not in the baseline (e.g. new.py::t equivalence#1 (LlamaForCausalLM))"
    ]
    markdown = verdict.markdown([_row("a.py::t", 0.0), _row("new.py::t", 0.1)])
    assert markdown.startswith("### :white_check_mark: modelpatch gate passed\n")
    table = [line for line in markdown.splitlines() if line.startswith("| passed")]
    assert table[0].endswith("`new.py::t` |") and "| 0.1 |" in table[0]


H100 = "NVIDIA H100 80GB HBM3"


def _on(device_class: str, nodeid: str, error: float, check: str = "equivalence") -> dict[str, Any]:
    row = _row(nodeid, error, kind=check)
    return {**row, "device": "cpu" if device_class == "cpu" else "cuda:0", "device_class": device_class}


def test_a_check_is_compared_with_the_baseline_row_of_its_own_device() -> None:
    baseline = [_on("cpu", "a.py::t", 1e-6), _on(H100, "a.py::t", 1e-3)]
    # the H100 may err 1e-3, the CPU 1e-6: a CPU figure of 1e-4 fails though the H100's is larger
    verdict = evaluate([_on("cpu", "a.py::t", 1e-4), _on(H100, "a.py::t", 1.5e-3)], Thresholds(), baseline)
    assert verdict.failures == [
        "a.py::t equivalence#1 (LlamaForCausalLM) on cpu: max abs error grew from 1e-06 (baseline) to 0.0001, "
        "more than allowed 2e-06 (modelpatch_baseline_factor = 2, modelpatch_baseline_floor = 1e-06)"
    ]
    markdown = verdict.markdown([_on("cpu", "a.py::t", 1e-4), _on(H100, "a.py::t", 1.5e-3)])
    sections = [line for line in markdown.splitlines() if line.startswith("#### ")]
    assert sections == ["#### cpu: 1 checks, 1 failures", f"#### {H100}: 1 checks, 0 failures"]


def test_a_scope_expects_a_baseline_row_only_from_tests_it_selected_on_devices_it_ran() -> None:
    from pytest_modelpatch.reporting.shards import merge_reports

    selection = {"paths": ["tests/a"], "selected": ["tests/a/test_x.py::t"], "deselected": ["tests/a/test_x.py::u"]}
    rows = [_on(H100, "tests/a/test_x.py::t", 0.0), _on("cpu", "tests/a/test_x.py::t", 0.0, check="roundtrip")]
    run = merge_reports(
        [("h100.json", {"header": {"default_device_class": H100}, "rows": rows, "selection": selection})]
    )
    assert run.device_classes == {H100, "cpu"}
    # a check that ran here on the GPU is not expected on the CPU, though its test's round trip ran there
    assert run.not_expected(("tests/a/test_x.py::t", "equivalence#1", "cpu")) == "that ran on other devices"
    assert run.expects(("tests/a/test_x.py::t", "equivalence#2", H100))  # vanished where its test ran: missing
    assert run.not_expected(("tests/a/test_x.py::u", "equivalence#1", H100)) == "of tests it did not select"
    assert run.expects(("tests/a/test_gone.py::t", "equivalence#1", H100))  # under its paths, not deselected: removed?
    assert run.not_expected(("tests/b/test_y.py::t", "equivalence#1", H100)) == "of tests it did not select"
    assert run.not_expected(("tests/a/test_x.py::t", "equivalence#1", "NVIDIA A10G")) == "on devices it did not run on"


def test_shards_of_one_device_on_different_versions_warn_and_other_devices_only_show() -> None:
    from pytest_modelpatch.reporting.shards import merge_reports

    def shard(name: str, device: str, torch: str, nodeid: str) -> tuple[str, dict[str, Any]]:
        header = {"default_device_class": device, "versions": {"torch": torch, "transformers": "5.24.0"}}
        return name, {"header": header, "rows": [_on(device, nodeid, 0.0)]}

    run = merge_reports(
        [shard("cpu-1.json", "cpu", "2.13.0+cpu", "a.py::t"), shard("h100.json", H100, "2.13.0+cu128", "a.py::t")]
    )
    assert run.notes == ["versions differ between reports: torch 2.13.0+cpu (cpu-1.json), 2.13.0+cu128 (h100.json)"]
    assert run.warnings == []
    run = merge_reports(
        [shard("cpu-1.json", "cpu", "2.13.0", "a.py::t"), shard("cpu-2.json", "cpu", "2.12.0", "b.py::t")]
    )
    assert run.warnings == [
        "reports cpu-1.json, cpu-2.json ran on cpu with different versions: torch 2.13.0 (cpu-1.json), 2.12.0 (cpu-2.json); "
        "their figures may differ by version, not by patch: run every shard of one device on the same versions"
    ]
    verdict = evaluate(run.rows, Thresholds(), run=run)
    assert verdict.passed and str(verdict).splitlines()[1].startswith(
        "WARNING reports cpu-1.json, cpu-2.json ran on cpu"
    )


def test_a_check_two_jobs_ran_on_one_device_keeps_the_row_of_the_job_for_that_device() -> None:
    from pytest_modelpatch.reporting.shards import merge_reports, updated_baseline

    cpu_job = ("cpu.json", {"header": {"default_device_class": "cpu"}, "rows": [_on("cpu", "a.py::t", 1e-7)]})
    gpu_job = (
        "h100.json",
        {"header": {"default_device_class": H100}, "rows": [_on("cpu", "a.py::t", 3e-7), _on(H100, "b.py::t", 0.0)]},
    )
    run = merge_reports([gpu_job, cpu_job])  # the GPU job ran a.py::t on the CPU too (a test marked cpu): a matrix
    assert len(run.rows) == 3 and evaluate(run.rows, Thresholds(), [_on("cpu", "a.py::t", 1e-7)], run=run).checks == 3
    rows, kept = updated_baseline([_on("cpu", "old.py::t", 0.5), _on("NVIDIA A10G", "a.py::t", 0.5)], run)
    # the run took in every test (no selection recorded): old.py::t ran no check, so it leaves the baseline;
    # the A10's row stays, no job ran there
    assert [(r["nodeid"], r["device_class"], r["max_abs_error"]) for r in rows] == [
        ("a.py::t", "cpu", 1e-7), ("b.py::t", H100, 0.0), ("a.py::t", "NVIDIA A10G", 0.5),
    ]  # fmt: skip
    assert kept == [_on("NVIDIA A10G", "a.py::t", 0.5)]


def test_an_infinite_baseline_figure_given_to_evaluate_fails_the_check_instead_of_passing_it() -> None:
    verdict = evaluate([_row("a.py::t", 5.0)], Thresholds(), [_row("a.py::t", math.inf)], "base.json")
    assert verdict.failures == [
        "a.py::t equivalence#1 (LlamaForCausalLM): the baseline's max abs error is inf, against which no growth can be "
        "judged; write the baseline again from a run where the check passes"
    ]


@pytest.mark.parametrize("limit", [{"floor": math.inf}, {"factor": math.nan}, {"max_abs_error": -1.0},
                                   {"max_speedup_drop": 1.0}])  # fmt: skip
def test_thresholds_refuse_a_limit_that_is_no_limit(limit: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=rf"Thresholds\({next(iter(limit))}="):
        Thresholds(**limit)


def test_evaluate_fails_a_run_that_judged_nothing_only_when_asked() -> None:
    from pytest_modelpatch.reporting.shards import merge_reports

    run = merge_reports([("empty.json", {"header": {}, "rows": [], "tests": {}})])
    assert evaluate([], Thresholds(), run=run).passed  # the pytest side: pytest itself says when nothing ran
    verdict = evaluate([], Thresholds(), run=run, allow_empty=False)
    assert verdict.failures == [
        "nothing was judged: empty.json holds no checks (no test ran), so no threshold or baseline judged anything; "
        "if nothing was to be checked here, pass --allow-empty"
    ]
