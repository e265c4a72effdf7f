"""The report records every selected test's outcome, and the gate fails on a test that failed or errored
whether or not it wrote a row, on a failed sweep entry, and on a selected test with no outcome."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _support.runs import IN_ORDER

from pytest_modelpatch.reporting.gate import Thresholds, evaluate
from pytest_modelpatch.reporting.report import load_report, write_report
from pytest_modelpatch.reporting.shards import merge_reports
from tests.reporting.test_cli_gate import modelpatch

SUITE = """
import pytest
from transformers.models.llama.modeling_llama import LlamaMLP
from pytest_modelpatch import assert_equivalent


class SameMLP(LlamaMLP):
    pass


@pytest.fixture
def broken_fixture():
    raise RuntimeError("the fixture broke before any check ran")


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": SameMLP})
def test_check(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


def test_errors_in_setup(broken_fixture):
    pass


def test_skipped():
    pytest.skip("not here")


@pytest.mark.xfail(reason="known")
def test_known():
    assert False
"""


def test_a_setup_error_without_a_row_fails_the_gate_and_a_clean_report_passes(
    pytester: pytest.Pytester, xdist_args: tuple[str, ...]
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "no:randomly", *xdist_args, "--modelpatch-report", "all.json")
    result.assert_outcomes(passed=1, errors=1, skipped=1, xfailed=1)
    report = load_report(pytester.path / "all.json")
    assert len(report["rows"]) == 1  # the erroring test wrote none
    assert {nodeid: entry["outcome"] for nodeid, entry in report["tests"].items()} == {
        "test_suite.py::test_check": "passed", "test_suite.py::test_errors_in_setup": "error",
        "test_suite.py::test_skipped": "skipped", "test_suite.py::test_known": "xfailed",
    }  # fmt: skip
    gate = modelpatch("gate", "all.json", cwd=pytester.path)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert "FAIL test_suite.py::test_errors_in_setup: the test errored in setup: RuntimeError: the fixture broke" \
        in gate.stdout  # fmt: skip
    assert "- :x: test_suite.py::test_errors_in_setup: the test errored in setup" in gate.stdout  # the markdown
    assert "4 tests: 1 error, 1 passed, 1 skipped, 1 xfailed" in gate.stdout

    clean = pytester.runpytest(
        "-p", "no:randomly", *xdist_args, "-k", "not errors", "--modelpatch-report", "clean.json"
    )
    clean.assert_outcomes(passed=1, skipped=1, xfailed=1)
    passed = modelpatch("gate", "clean.json", cwd=pytester.path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.startswith("modelpatch gate PASSED: 1 checks, 0 failures\n")


def test_the_session_gate_names_a_failing_test_that_wrote_no_row(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini("[pytest]\nmodelpatch_max_abs_error = 1e-3\n")
    result = pytester.runpytest(*IN_ORDER)
    result.stdout.fnmatch_lines(["modelpatch gate FAILED: 1 checks, 1 failures",
                                 "FAIL test_suite.py::test_errors_in_setup: the test errored in setup: RuntimeError*"])  # fmt: skip


def _report(path: Path, tests: dict[str, Any], selected: list[str], sweeps: Any = None, version: int = 4) -> Path:
    write_report(path, {"seed": 0}, [], sweeps, {"paths": [""], "selected": selected, "deselected": []}, tests)
    if version < 4:  # a report written before outcomes were recorded
        data = json.loads(path.read_text())
        data["schema_version"] = version
        del data["tests"]
        path.write_text(json.dumps(data))
    return path


def test_a_shard_that_lists_selected_tests_with_no_outcome_fails_naming_them(tmp_path: Path) -> None:
    done = {"t.py::a": {"outcome": "passed", "when": "call"}}
    _report(tmp_path / "one.json", done, ["t.py::a"])
    _report(tmp_path / "two.json", {}, ["t.py::b", "t.py::c"])
    run = merge_reports([(name, load_report(tmp_path / name)) for name in ("one.json", "two.json")])
    verdict = evaluate(run.rows, Thresholds(), run=run)
    assert not verdict.passed
    assert verdict.failures == [
        "2 selected tests have no outcome: t.py::b (two.json), t.py::c (two.json); the session stopped before they ran "
        "(-x, --maxfail, a crash or an interrupt): run them again"
    ]
    alone = merge_reports([("one.json", load_report(tmp_path / "one.json"))])
    assert evaluate(alone.rows, Thresholds(), run=alone).passed


def test_a_failed_sweep_entry_fails_the_gate_even_in_a_report_without_outcomes(tmp_path: Path) -> None:
    sweeps = {"t.py::test_norm": {"llama": ("passed", ""), "gemma": ("failed", "first diverging module: norm")}}
    _report(tmp_path / "old.json", {}, [], sweeps, version=3)
    data = load_report(tmp_path / "old.json")
    assert "tests" not in data and data["schema_version"] == 3
    run = merge_reports([("old.json", data)])
    verdict = evaluate(run.rows, Thresholds(), run=run)
    assert verdict.failures == ["t.py::test_norm: the sweep failed on family gemma (first diverging module: norm)"]
    # the same family's test failing is named once, as a test
    failed = {"t.py::test_norm[gemma]": {"outcome": "failed", "when": "call", "detail": "AssertionError: norm"}}
    _report(tmp_path / "new.json", failed, ["t.py::test_norm[gemma]"], sweeps)
    run = merge_reports([("new.json", load_report(tmp_path / "new.json"))])
    assert evaluate(run.rows, Thresholds(), run=run).failures == [
        "t.py::test_norm[gemma]: the test failed: AssertionError: norm"
    ]


def test_the_committed_baseline_still_reads_and_gates(tmp_path: Path) -> None:
    baseline = Path(__file__).resolve().parents[1] / "modelpatch-baseline.json"
    data = load_report(baseline)
    run = merge_reports([("base", data)])
    assert evaluate(run.rows, Thresholds(), data["rows"], "base", run).passed
