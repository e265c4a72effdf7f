"""CI's lanes (.ci/lanes.sh, which .ci/run and .ci/gpu source): every lane runs, the summary names the ones that failed;
the GPU lane stops at once where there is no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
LANES = REPO_ROOT / ".ci" / "lanes.sh"


def run_lanes(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "run"
    script.write_text(f"source {LANES}\n{body}\n")
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_a_failing_lane_does_not_stop_the_ones_after_it_and_the_run_fails_naming_it(tmp_path: Path) -> None:
    done = run_lanes(
        tmp_path,
        """
two_steps() { false; echo "after the failing step"; }
lane "first: passes" true
lane "second: fails in its first step" two_steps
lane "third: still runs" touch ran
""",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert (tmp_path / "ran").exists()  # the lane after the failing one ran
    assert "after the failing step" not in done.stdout  # a lane stops at its own first failure
    summary = done.stdout[done.stdout.index("== lane times") :].splitlines()
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


def run_gpu_lane(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    # CUDA_VISIBLE_DEVICES="": no GPU, even on a machine that has one
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MODELPATCH_GPU_PYTHON": python}
    return subprocess.run(
        ["bash", str(REPO_ROOT / ".ci" / "gpu"), *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_gpu_lane_without_a_gpu_stops_before_any_lane_saying_it_needs_one() -> None:
    start = time.monotonic()
    done = run_gpu_lane()
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(".ci/gpu needs a CUDA GPU, and torch.cuda.is_available() is False here (torch ")
    assert "Run it on a GPU machine with a CUDA build of torch (MODELPATCH_GPU_PYTHON)" in done.stderr
    assert done.stdout == ""  # no lane started, no report written, no summary
    assert time.monotonic() - start < 60  # the time to import torch once
    wrong = run_gpu_lane("--update-baselines")
    assert wrong.returncode == 2 and "usage: .ci/gpu [--update-baseline]" in wrong.stderr
    nowhere = run_gpu_lane(python="/nonexistent/python")
    assert nowhere.returncode == 2 and ".ci/gpu: no python at /nonexistent/python" in nowhere.stderr


def test_the_committed_baseline_names_only_tests_that_still_exist() -> None:
    # the GPU lane and CI's shards lane gate against it; a renamed test would leave a row no run gives
    from pytest_modelpatch.reporting.report import load_report

    baseline = load_report(REPO_ROOT / "tests" / "modelpatch-baseline.json")
    tests = {
        (path, name.partition("[")[0]) for path, name in (row["nodeid"].split("::")[:2] for row in baseline["rows"])
    }
    assert baseline["schema_version"] == 3 and len(tests) > 10
    assert {path for path, _ in tests} == {"docs/examples/test_verify_examples.py", "tests/models/test_gpu.py"}
    assert not [(path, test) for path, test in tests if f"def {test}(" not in (REPO_ROOT / path).read_text()]
    assert {row["device_class"] for row in baseline["rows"]} == set(baseline["header"]["device_classes"])


def consumer_project() -> ModuleType:
    """.ci/consumer_project.py as a module (it lives beside the CI scripts, not in a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("consumer_project", REPO_ROOT / ".ci" / "consumer_project.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_consumer_project_is_the_quickstart_page_block_for_block(tmp_path: Path) -> None:
    from test_docs import DOC_FILES, QUICKSTART, code_blocks

    project = consumer_project()
    # the lane reads every page as tests/test_docs.py does: the same blocks, lines and directives
    for page in DOC_FILES:
        blocks = [b for b in code_blocks(page) if b.language in ("python", "py")]
        ours = [(b.line, b.code, b.directive, b.directive_arg) for b in blocks]
        assert project.python_blocks(page) == ours, page
    expected = project.write_project(QUICKSTART, tmp_path)
    written = {path.name: path.read_text() for path in tmp_path.iterdir() if path.name != "expected.json"}
    page = [b for b in code_blocks(QUICKSTART) if b.language == "python" and b.directive != "skip"]
    assert len(written) == len(page) >= 6
    for block in page:
        if block.directive == "file":
            assert written[block.directive_arg] == block.code
        elif block.is_test_module:
            planted = block.directive == "expect-fail"
            mark = project.xfail_mark(block.directive_arg) if planted else ""
            assert written[f"{block.module_name}.py"] == block.code + mark
            outcome = "xfailed" if planted else "passed"
            assert expected["tests"][block.module_name] == {"outcome": outcome, "text": block.directive_arg}
        else:
            assert written[f"script_quickstart_L{block.line}.py"] == block.code
    assert "xfailed" in [want["outcome"] for want in expected["tests"].values()] and expected["scripts"]


PAGE = """
<!-- doc: file: norm.py -->
```python
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)
```

```python
import pytest
from norm import RMSNorm
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama", num_hidden_layers=1)
@pytest.mark.patch({"LlamaRMSNorm": RMSNorm})
def test_norm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
```

<!-- doc: expect-fail: first diverging module: model.layers.0.input_layernorm -->
```python
import pytest
from norm import RMSNorm
from pytest_modelpatch import assert_equivalent


class NoWeight(RMSNorm):
    def forward(self, x):
        return super().forward(x) / self.weight


@pytest.mark.model("llama", num_hidden_layers=1)
@pytest.mark.patch({"LlamaRMSNorm": NoWeight})
def test_norm_without_its_weight(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
```

<!-- doc: expect-fail: first diverging module -->
```python
import pytest
from norm import RMSNorm
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama", num_hidden_layers=1)
@pytest.mark.patch({"LlamaRMSNorm": RMSNorm})
def test_said_to_be_broken_but_right(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
```
"""


def test_the_consumer_check_passes_a_caught_bug_and_fails_a_planted_bug_that_passes(tmp_path: Path) -> None:
    project = consumer_project()
    (tmp_path / "page.md").write_text(PAGE)
    out = tmp_path / "project"
    expected = project.write_project(tmp_path / "page.md", out)
    assert sorted(want["outcome"] for want in expected["tests"].values()) == ["passed", "xfailed", "xfailed"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "--junitxml=junit.xml",
         "--modelpatch-report", "report.json"],
        cwd=out, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:]  # the right norm said to be broken: XPASS(strict)
    assert "1 failed, 1 passed, 1 xfailed" in done.stdout, done.stdout[-3000:]
    said_broken = max(expected["tests"], key=lambda module: int(module.rpartition("_L")[2]))
    assert project.check_run(out) == [
        f"{said_broken}: failure, where the page says xfailed",
        f"{said_broken}: no check of it failed saying 'first diverging module', as the page says it does",
    ]


def test_the_lowest_lane_installs_the_floors_pyproject_declares() -> None:
    # a floor raised in pyproject.toml and not in .ci/floors.txt (or the other way) would leave the claim untested
    # tomllib is Python 3.11: the dependencies are read as the one list of quoted strings they are
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    assert dependencies is not None
    declared = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)[^"]*"', dependencies.group(1)))
    assert len(declared) == 5, declared
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (REPO_ROOT / ".ci" / "floors.txt").read_text(), re.M)
    tested = {name.lower(): version for name, version in pins}
    assert set(tested) == set(declared), "every requirement of the package has its floor in .ci/floors.txt"
    for name, floor in declared.items():
        assert tested[name].split(".")[: len(floor.split("."))] == floor.split("."), (name, floor, tested[name])
    assert 'requires-python = ">=3.10"' in pyproject
    run = (REPO_ROOT / ".ci" / "run").read_text()
    assert 'prebuild .venv-lowest 3.10 "" lowest' in run and "prebuild .venv-py310 3.10" in run
    assert "prebuild .venv-py313 3.13" in run and 'lane "lint: ruff check and format' in run
    for venv in (".venv-lowest", ".venv-py310", ".venv-py313"):  # each lane runs in the venv built for it
        assert f"  prebuilt {venv}\n" in run, venv
