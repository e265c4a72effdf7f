"""``modelpatch gate`` through a real subprocess: verdict, markdown summary, exit codes 0/1/2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_modelpatch.reporting.records import CheckRecord
from pytest_modelpatch.reporting.report import row_from_record, write_report

REPO_ROOT = Path(__file__).resolve().parents[2]


def modelpatch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: run this checkout's package, not whichever copy is installed
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest_modelpatch", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, check=False)  # fmt: skip


def _report(path: Path, **errors: float) -> Path:
    records = {name: CheckRecord(kind="equivalence", outcome="passed", model="LlamaForCausalLM", max_abs_error=e)
               for name, e in errors.items()}  # fmt: skip
    rows: list[dict[str, Any]] = [row_from_record(r, f"tests/test_patches.py::{n}", 1) for n, r in records.items()]
    write_report(path, {"seed": 0}, rows)
    return path


def test_gate_passes_and_appends_a_markdown_summary(tmp_path: Path) -> None:
    _report(tmp_path / "base.json", test_attn=1e-6, test_mlp=0.0)
    _report(tmp_path / "report.json", test_attn=1.5e-6, test_mlp=0.0)
    (tmp_path / "summary.md").write_text("earlier step\n")
    result = modelpatch("gate", "report.json", "--baseline", "base.json", "--markdown", "summary.md", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("modelpatch gate PASSED: 2 checks against baseline base.json, 0 failures\n")
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("earlier step\n### :white_check_mark: modelpatch gate passed\n")
    assert (
        "| passed | 1.5e-06 | - | equivalence#1 | LlamaForCausalLM | -@- | `tests/test_patches.py::test_attn` |"
        in summary
    )


def test_gate_exits_1_naming_a_grown_and_a_missing_check(tmp_path: Path) -> None:
    _report(tmp_path / "base.json", test_attn=1e-6, test_mlp=0.0)
    _report(tmp_path / "report.json", test_attn=1e-4)
    result = modelpatch("gate", "report.json", "--baseline", "base.json", cwd=tmp_path)
    assert result.returncode == 1
    assert "FAIL tests/test_patches.py::test_attn equivalence#1 (LlamaForCausalLM): max abs error grew from 1e-06 " \
        "(baseline) to 0.0001" in result.stdout  # fmt: skip
    assert "FAIL tests/test_patches.py::test_mlp equivalence#1 (LlamaForCausalLM): in the baseline" in result.stdout
    assert "### :x: modelpatch gate failed" in result.stdout


def test_gate_threshold_without_baseline(tmp_path: Path) -> None:
    _report(tmp_path / "report.json", test_attn=1e-4)
    assert modelpatch("gate", "report.json", "--max-abs-error", "1e-3", cwd=tmp_path).returncode == 0
    failing = modelpatch("gate", "report.json", "--max-abs-error", "1e-5", cwd=tmp_path)
    assert failing.returncode == 1 and "exceeds modelpatch_max_abs_error = 1e-05" in failing.stdout


def test_gate_usage_errors_exit_2(tmp_path: Path) -> None:
    missing = modelpatch("gate", "nope.json", cwd=tmp_path)
    assert missing.returncode == 2
    assert "nope.json: no such report; write one with pytest --modelpatch-report nope.json" in missing.stderr
    (tmp_path / "other.json").write_text(json.dumps({"findings": []}))
    assert modelpatch("gate", "other.json", cwd=tmp_path).returncode == 2
    assert modelpatch("gate", cwd=tmp_path).returncode == 2  # argparse: REPORT.json is required


# ---------------------------------------------------------------------------
# never blind, never a traceback: what the gate cannot judge is refused (2) or fails (1), up front
# ---------------------------------------------------------------------------

ROW = {"nodeid": "t.py::test_a", "check": "equivalence#1", "kind": "equivalence", "outcome": "passed",
       "max_abs_error": 1e-7, "max_rel_error": 1e-6}  # fmt: skip
ROW_B = {**ROW, "nodeid": "t.py::test_b"}
PASSED = {"outcome": "passed", "when": "call"}


def _json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def _v4(rows: list[Any], **fields: Any) -> dict[str, Any]:
    """A report as the plugin writes it (version 4, with outcomes), its rows and fields as given."""
    return {"schema_version": 4, "header": {}, "rows": rows, "tests": {"t.py::test_a": PASSED}, **fields}


MALFORMED = {
    "invalid JSON": ("{not json", "bad.json: not a modelpatch JSON report (Expecting property name"),
    "not UTF-8": (b"\xff\xfe{", "bad.json: not a modelpatch JSON report ('utf-8' codec can't decode"),
    "a list, not an object": ([ROW], 'bad.json: not a modelpatch JSON report ([{"nodeid": '),
    "rows not a list": ({"rows": {"0": ROW}}, "bad.json: not a modelpatch JSON report (no 'rows' list)"),
    "header not an object": ({"header": ["x"], "rows": [ROW]}, 'bad.json: header is ["x"], expected an object'),
    "header field": (_v4([ROW], header={"accelerators": "H100"}), 'bad.json: header: accelerators is "H100", expected'),
    "schema_version a bool": (_v4([ROW], schema_version=True), "bad.json: schema_version is true, expected a whole"),
    "schema_version a string": (_v4([ROW], schema_version="4"), 'bad.json: schema_version is "4", expected a whole'),
    "schema_version 0": (_v4([ROW], schema_version=0), "bad.json: schema_version is 0, expected a whole number from 1"),
    "row not an object": (_v4([ROW_B, 3]), "bad.json: rows[1] is 3, expected an object"),
    "nodeid missing": (_v4([{k: v for k, v in ROW.items() if k != "nodeid"}]), "bad.json: rows[0]: nodeid is missing"),
    "nodeid not a string": (_v4([{**ROW, "nodeid": 7}]), "bad.json: rows[0]: nodeid is 7, expected a test's node id"),
    "check not KIND#N": (_v4([{**ROW, "check": "equivalence"}]), 'bad.json: rows[0] (t.py::test_a): check is "equivalence", expected KIND#N'),
    "figure not a number": (_v4([ROW_B, {**ROW, "max_abs_error": "abc"}]),
                            'bad.json: rows[1] (t.py::test_a): max_abs_error is "abc", expected a number 0 or more'),
    "figure a bool": (_v4([{**ROW, "max_abs_error": True}]), "bad.json: rows[0] (t.py::test_a): max_abs_error is true, expected"),
    "error -inf": (_v4([{**ROW, "max_rel_error": "-inf"}]), 'bad.json: rows[0] (t.py::test_a): max_rel_error is "-inf", expected'),
    "error below 0": (_v4([{**ROW, "max_abs_error": -0.5}]), "bad.json: rows[0] (t.py::test_a): max_abs_error is -0.5, expected"),
    "outcome unknown": (_v4([{**ROW, "outcome": "ok"}]), 'bad.json: rows[0] (t.py::test_a): outcome is "ok", expected one of'),
    "outcome missing": (_v4([{k: v for k, v in ROW.items() if k != "outcome"}]), "bad.json: rows[0] (t.py::test_a): outcome is missing"),
    "expected_failure a string": (_v4([{**ROW, "expected_failure": "yes"}]), 'bad.json: rows[0] (t.py::test_a): expected_failure is "yes", expected true'),
    "count a bool": (_v4([{**ROW, "examples": False}]), "bad.json: rows[0] (t.py::test_a): examples is false, expected a whole"),
    "speedup not a number": (_v4([{**ROW, "timing": {"speedup": "fast"}}]),
                             'bad.json: rows[0] (t.py::test_a) timing: speedup is "fast", expected a number'),
    "profile not pairs": (_v4([{**ROW, "profile": [["model.layers.0"]]}]), "bad.json: rows[0] (t.py::test_a): profile is [[\"model.layers.0\"]], expected a list"),
    "tests not an object": (_v4([ROW], tests=["t.py::test_a"]), 'bad.json: tests is ["t.py::test_a"], expected an'),
    "test outcome unknown": (_v4([ROW], tests={"t.py::test_a": {"outcome": "weird"}}),
                             'bad.json: tests["t.py::test_a"]: outcome is "weird", expected one of failed, error'),
    "selection not lists": (_v4([ROW], selection={"paths": [""], "selected": "t.py", "deselected": []}),
                            'bad.json: selection: selected is "t.py", expected a list of strings'),
    "sweep outcome unknown": (_v4([ROW], sweeps={"t.py::test_s": {"llama": {"outcome": 3, "divergence": ""}}}),
                              'bad.json: sweeps["t.py::test_s"]["llama"]: outcome is 3, expected one of'),
    "the same check twice": (_v4([ROW, ROW_B, ROW]),
                             "bad.json: rows[0] and rows[2] are the same check, t.py::test_a equivalence#1 on cpu"),
}  # fmt: skip


def _write(path: Path, content: Any) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        _json(path, content)
    return path


def _refused(result: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit 2, one line on stderr that says ``message``, no verdict printed and no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("modelpatch: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("content, message", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_report_is_refused_naming_the_file_row_and_field(
    tmp_path: Path, content: Any, message: str
) -> None:
    _write(tmp_path / "bad.json", content)
    _refused(modelpatch("gate", "bad.json", cwd=tmp_path), f"modelpatch: error: {message}")


@pytest.mark.parametrize("name", ["figure not a number", "row not an object", "the same check twice"])
def test_a_malformed_baseline_is_refused_before_any_verdict(tmp_path: Path, name: str) -> None:
    _json(tmp_path / "report.json", _v4([ROW]))
    before = _write(tmp_path / "bad.json", MALFORMED[name][0]).read_text()
    _refused(modelpatch("gate", "report.json", "--baseline", "bad.json", cwd=tmp_path), MALFORMED[name][1])
    rewrite = modelpatch("gate", "report.json", "--baseline", "bad.json", "--update-baseline", cwd=tmp_path)
    _refused(rewrite, MALFORMED[name][1])  # the rows it would keep are malformed: refused, the file left as it was
    assert (tmp_path / "bad.json").read_text() == before


def test_a_missing_report_among_others_is_refused_naming_it(tmp_path: Path) -> None:
    _json(tmp_path / "shard-1.json", _v4([ROW]))
    result = modelpatch("gate", "shard-1.json", "shard-2.json", cwd=tmp_path)
    _refused(result, "shard-2.json: no such report; write one with pytest --modelpatch-report shard-2.json")


@pytest.mark.parametrize("error", ["inf", "nan"])
def test_a_non_finite_baseline_figure_is_refused_naming_the_row(tmp_path: Path, error: str) -> None:
    _json(tmp_path / "report.json", _v4([{**ROW, "max_abs_error": 5.0}]))
    _json(tmp_path / "base.json", {"schema_version": 4, "header": {}, "rows": [ROW_B, {**ROW, "max_abs_error": error}]})
    result = modelpatch("gate", "report.json", "--baseline", "base.json", cwd=tmp_path)
    _refused(result, f'base.json: rows[1] (t.py::test_a): max_abs_error is "{error}", expected a finite number')


def test_a_baseline_speedup_counts_only_with_a_speedup_drop_limit(tmp_path: Path) -> None:
    timed = {**ROW, "timing": {"speedup": 2.0}}
    _json(tmp_path / "report.json", _v4([timed]))
    _json(
        tmp_path / "base.json", {"schema_version": 4, "header": {}, "rows": [{**timed, "timing": {"speedup": "inf"}}]}
    )
    assert modelpatch("gate", "report.json", "--baseline", "base.json", cwd=tmp_path).returncode == 0
    result = modelpatch("gate", "report.json", "--baseline", "base.json", "--max-speedup-drop", "0.2", cwd=tmp_path)
    _refused(result, 'base.json: rows[0] (t.py::test_a): timing speedup is "inf", expected a finite number')


def test_a_baseline_row_meant_to_fail_may_be_infinite_and_judges_nothing(tmp_path: Path) -> None:
    # an xfail patch that outputs NaN writes "inf": the plugin's own baselines hold such rows
    xfailed = {**ROW, "outcome": "failed", "max_abs_error": "inf", "expected_failure": True, "intent": "xfail"}
    _json(tmp_path / "base.json", {"schema_version": 4, "header": {}, "rows": [xfailed]})
    _json(tmp_path / "report.json", _v4([ROW]))
    result = modelpatch("gate", "report.json", "--baseline", "base.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "note t.py::test_a equivalence#1: not judged against the baseline's inf, of a check meant to fail" in (
        result.stdout
    )


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--floor", "inf", "a finite number, 0 or more, e.g. 1e-6"),
        ("--factor", "nan", "a finite number, 0 or more, e.g. 2"),
        ("--max-abs-error", "inf", "a finite number, 0 or more, e.g. 1e-3"),
        ("--max-rel-error", "-1", "a finite number, 0 or more, e.g. 1e-2"),
        ("--min-speedup", "abc", "a finite number, 0 or more, e.g. 1.1"),
        ("--max-speedup-drop", "1", "a fraction in [0, 1), e.g. 0.2"),
    ],
)
def test_a_non_finite_or_negative_limit_is_refused_naming_the_option(
    tmp_path: Path, option: str, value: str, expected: str
) -> None:
    _report(tmp_path / "base.json", test_attn=1e-6)
    _report(tmp_path / "report.json", test_attn=1.0)  # grown a million times: a blind limit would pass it
    result = modelpatch("gate", "report.json", "--baseline", "base.json", f"{option}={value}", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert f"modelpatch gate: error: argument {option}: {value!r}: expected {expected}" in result.stderr


def test_a_report_with_no_checks_and_no_tests_fails_unless_allowed(tmp_path: Path) -> None:
    _json(tmp_path / "empty.json", {"schema_version": 4, "header": {}, "rows": [], "tests": {}})
    result = modelpatch("gate", "empty.json", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith(
        "modelpatch gate FAILED: 0 checks, 1 failures\n"
        "FAIL nothing was judged: empty.json holds no checks (no test ran), so no threshold or baseline judged "
        "anything; if nothing was to be checked here, pass --allow-empty\n"
    )
    allowed = modelpatch("gate", "empty.json", "--allow-empty", cwd=tmp_path)
    assert allowed.returncode == 0 and allowed.stdout.startswith("modelpatch gate PASSED: 0 checks, 0 failures\n")


def test_tests_that_ran_without_recording_a_check_judge_nothing(tmp_path: Path) -> None:
    tests = {"t.py::test_a": PASSED, "t.py::test_b": PASSED, "t.py::test_c": {"outcome": "skipped", "when": "setup"}}
    _json(tmp_path / "nochecks.json", {"schema_version": 4, "header": {}, "rows": [], "tests": tests})
    result = modelpatch("gate", "nochecks.json", "--max-abs-error", "1e-3", cwd=tmp_path)
    assert result.returncode == 1
    assert (
        "FAIL nothing was judged: nochecks.json holds no checks (2 tests ran, none recorded a check)" in result.stdout
    )


def test_a_shard_that_judged_nothing_fails_beside_one_that_did(tmp_path: Path) -> None:
    _json(tmp_path / "shard-1.json", _v4([ROW]))
    skipped = {"t.py::test_b": {"outcome": "skipped", "when": "setup"}}
    _json(tmp_path / "shard-2.json", {"schema_version": 4, "header": {}, "rows": [], "tests": skipped})
    result = modelpatch("gate", "shard-1.json", "shard-2.json", cwd=tmp_path)
    assert result.returncode == 1
    assert "FAIL nothing was judged in shard-2.json: it holds no checks and no test ran there; if nothing was to " \
        "be checked here, pass --allow-empty" in result.stdout  # fmt: skip
    assert modelpatch("gate", "shard-1.json", "shard-2.json", "--allow-empty", cwd=tmp_path).returncode == 0


def test_updating_a_baseline_from_a_run_that_judged_nothing_keeps_it(tmp_path: Path) -> None:
    _report(tmp_path / "base.json", test_attn=1e-6)
    before = (tmp_path / "base.json").read_text()
    _json(tmp_path / "empty.json", {"schema_version": 4, "header": {}, "rows": [], "tests": {}})
    result = modelpatch("gate", "empty.json", "--baseline", "base.json", "--update-baseline", cwd=tmp_path)
    assert result.returncode == 1
    assert "note baseline base.json not rewritten: nothing was judged" in result.stdout
    assert (tmp_path / "base.json").read_text() == before


def test_markdown_into_a_missing_folder_is_written_there(tmp_path: Path) -> None:
    _report(tmp_path / "report.json", test_attn=1e-6)
    result = modelpatch("gate", "report.json", "--markdown", "out/summaries/gate.md", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("modelpatch gate PASSED: 1 checks, 0 failures\n")
    assert (
        (tmp_path / "out/summaries/gate.md").read_text().startswith("### :white_check_mark: modelpatch gate passed\n")
    )


def test_markdown_that_cannot_be_written_is_refused_before_the_verdict(tmp_path: Path) -> None:
    _report(tmp_path / "report.json", test_attn=1e-6)
    (tmp_path / "summary.md").mkdir()  # a folder where the file should be
    result = modelpatch("gate", "report.json", "--markdown", "summary.md", cwd=tmp_path)
    _refused(result, "modelpatch: error: --markdown summary.md: cannot write it (Is a directory)")
