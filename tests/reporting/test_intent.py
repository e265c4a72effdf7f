"""Checks in tests meant to fail (strict xfail, a caught AssertionError) are recorded as such and not gated."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

HEADER = """
import pytest
from fixtures.patches import llama_fused_qkv_noncausal as broken
from pytest_modelpatch import assert_equivalent

BROKEN = pytest.mark.patch(broken.MAPPING, conversions=broken.CONVERSIONS)
"""

MEANT_TO_FAIL = (
    HEADER
    + """

@pytest.mark.xfail(strict=True, reason="non-causal attention")
@pytest.mark.model("llama")
@BROKEN
def test_strict_xfail(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@BROKEN
def test_caught(reference_model, patched_model):
    with pytest.raises(AssertionError, match="first diverging module"):
        assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_good(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""
)

REAL_FAILURE = (
    HEADER
    + """

@pytest.mark.model("llama")
@BROKEN
def test_not_meant_to_fail(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""
)


def gate(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``modelpatch gate`` of this checkout (not an installed copy) in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest_modelpatch", "gate", *args],
                          capture_output=True, text=True, cwd=cwd, env=env, check=False)  # fmt: skip


def _rows(path: Path) -> dict[str, dict[str, Any]]:
    return {row["nodeid"].rpartition("::")[2]: row for row in json.loads(path.read_text())["rows"]}


def test_strict_xfail_and_caught_failures_pass_pytest_and_the_gate(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_meant=MEANT_TO_FAIL)
    pytester.makeini("[pytest]\nmodelpatch_max_abs_error = 1e-3\n")  # the in-session gate runs too
    result = pytester.runpytest("-p", "no:randomly", "--modelpatch-report", "r.json")
    result.assert_outcomes(passed=2, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "*modelpatch: 3 checks (2 in tests meant to fail), worst first*",
        "xfailed *equivalence#1*test_meant.py::test_caught",
        "xfailed *equivalence#1*test_meant.py::test_strict_xfail",
        "modelpatch gate PASSED: 3 checks, 0 failures",
    ])  # fmt: skip
    rows = _rows(pytester.path / "r.json")
    assert (rows["test_strict_xfail"]["outcome"], rows["test_strict_xfail"]["expected_failure"]) == ("failed", True)
    assert rows["test_strict_xfail"]["intent"] == "xfail: non-causal attention"
    assert rows["test_caught"]["expected_failure"] and rows["test_caught"]["intent"].startswith("caught:")
    assert not rows["test_good"]["expected_failure"]
    checked = gate("r.json", cwd=pytester.path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (
        "note 2 checks in tests meant to fail (xfail or a caught AssertionError), not gated: 2 xfailed"
        in checked.stdout
    )
    assert re.search(r"\| xfailed \| \d[\d.e+-]* \|", checked.stdout), checked.stdout  # its real, nonzero error


def test_an_uncaught_failing_check_still_fails_pytest_and_the_gate(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_real=REAL_FAILURE)
    result = pytester.runpytest("-p", "no:randomly", "--modelpatch-report", "r.json")
    result.assert_outcomes(failed=1)
    row = _rows(pytester.path / "r.json")["test_not_meant_to_fail"]
    assert (row["outcome"], row["expected_failure"], row["intent"]) == ("failed", False, "")
    checked = gate("r.json", cwd=pytester.path)
    assert checked.returncode == 1
    assert re.search(
        r"FAIL test_real.py::test_not_meant_to_fail equivalence#1 \(LlamaForCausalLM, [^)]+\): the check failed",
        checked.stdout,
    )


def test_baseline_tracks_expected_failures_without_gating_their_figures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_meant=MEANT_TO_FAIL)
    args = ("-p", "no:randomly", "--modelpatch-baseline", "base.json")
    pytester.runpytest(*args, "--modelpatch-update-baseline").assert_outcomes(passed=2, xfailed=1)
    assert sum(r["expected_failure"] for r in _rows(pytester.path / "base.json").values()) == 2
    again = pytester.runpytest(*args)
    assert again.ret == pytest.ExitCode.OK
    again.stdout.fnmatch_lines(["modelpatch gate PASSED: 3 checks against baseline base.json, 0 failures"])
    # an xfail check that stops running is still missed by the baseline
    pytester.makepyfile(test_meant=MEANT_TO_FAIL.replace("def test_strict_xfail", "def _gone"))
    missing = pytester.runpytest(*args)
    assert missing.ret == pytest.ExitCode.TESTS_FAILED
    missing.stdout.fnmatch_lines(["FAIL test_meant.py::test_strict_xfail equivalence#1 *in the baseline*did not run*"])
