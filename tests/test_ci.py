"""CI's lanes (.ci/lanes.sh, which .ci/run sources): every lane runs, the summary names the ones that failed."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LANES = REPO_ROOT / ".ci" / "lanes.sh"


def run_lanes(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "run"
    script.write_text(f"source {LANES}\n{body}\n")
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_a_failing_lane_does_not_stop_the_ones_after_it_and_the_run_fails_naming_it(tmp_path: Path) -> None:
    done = run_lanes(tmp_path, """
two_steps() { false; echo "after the failing step"; }
lane "first: passes" true
lane "second: fails in its first step" two_steps
lane "third: still runs" touch ran
""")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (tmp_path / "ran").exists()  # the lane after the failing one ran
    assert "after the failing step" not in done.stdout  # a lane stops at its own first failure
    summary = done.stdout[done.stdout.index("== lane times"):].splitlines()
    assert "ok" in summary[1] and summary[1].endswith("first: passes")
    assert "FAILED (exit 1)" in summary[2] and summary[2].endswith("second: fails in its first step")
    assert "ok" in summary[3] and summary[3].endswith("third: still runs")
    assert summary[-2:] == ["1 of 3 lanes failed:", "  second: fails in its first step"]


def test_a_run_whose_lanes_all_pass_exits_zero(tmp_path: Path) -> None:
    done = run_lanes(tmp_path, 'lane "one" true\nlane "two" echo hello')
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("all 2 lanes passed")
    assert "== two\nhello" in done.stdout


def test_ci_run_lists_its_lanes_through_lanes_sh() -> None:
    run = (REPO_ROOT / ".ci" / "run").read_text()
    assert "source .ci/lanes.sh" in run and "set -e" not in run.replace("set -euo pipefail; ", "")
    assert 'lane "test suite' in run and "ATEN_CPU_CAPABILITY=$capability" in run
