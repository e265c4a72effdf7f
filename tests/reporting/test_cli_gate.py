"""``modelpatch gate`` through a real subprocess: verdict, markdown summary, exit codes 0/1/2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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
