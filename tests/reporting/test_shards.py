"""One verdict from many shards and devices: real pytest runs write the reports, ``modelpatch gate`` merges them,
baselines are keyed by device class.

No GPU here: a GPU job's report is a real CPU report relabelled as the GPU job would write it (its rows'
device ``cuda:0``, their class the GPU's name), which is all the gate reads of it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_cli_gate import modelpatch

from pytest_modelpatch.reporting.report import load_report, write_report

H100, A10 = "NVIDIA H100 80GB HBM3", "NVIDIA A10G"

# Two real checks whose patches drift by $MODELPATCH_TEST_<NAME>_EPS (0: exact), within the tests' atol.
SUITE = """
import os
import pytest
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP
from pytest_modelpatch import assert_equivalent


def drift(name):
    return float(os.environ.get(f"MODELPATCH_TEST_{name}_EPS", "0"))


class DriftingAttention(LlamaAttention):
    def forward(self, *args, **kwargs):
        output, weights = super().forward(*args, **kwargs)
        return output + drift("ATTENTION"), weights


class DriftingMLP(LlamaMLP):
    def forward(self, x):
        return super().forward(x) + drift("MLP")


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaAttention": DriftingAttention})
@pytest.mark.tolerance(atol=0.5)
def test_attention(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": DriftingMLP})
@pytest.mark.tolerance(atol=0.5)
def test_mlp(reference_model, patched_model):
    if os.environ.get("MODELPATCH_TEST_MLP_GONE"):
        pytest.skip("the check is gone")
    assert_equivalent(reference_model, patched_model)
"""
ATTENTION, MLP = "test_suite.py::test_attention", "test_suite.py::test_mlp"


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def report(pytester: pytest.Pytester, path: str, *args: str) -> dict[str, Any]:
    """Run the suite with ``args``, writing ``--modelpatch-report path``; the report as ``load_report`` reads it."""
    result = pytester.runpytest(*args, "--modelpatch-report", path)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    return load_report(pytester.path / path)


def as_gpu_report(data: dict[str, Any], path: Path, name: str = H100, **changes: Any) -> Path:
    """``data`` as a job on the GPU ``name`` would have written it; ``changes`` set on every row."""
    header = {**data["header"], "accelerators": [name], "default_device": "cuda", "default_device_class": name,
              "device_classes": [name]}  # fmt: skip
    rows = [{**row, "device": "cuda:0", "device_class": name, **changes} for row in data["rows"]]
    write_report(path, header, rows, selection=data.get("selection"))
    return path


def test_two_k_shards_gated_together_pass_and_a_worse_check_in_either_fails(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = suite.runpytest("--modelpatch-baseline", "base.json", "--modelpatch-update-baseline")
    written.assert_outcomes(passed=2)

    # each shard judged in its own session against the full baseline: on its share only
    first = suite.runpytest("test_suite.py", "-n", "2", "-k", "attention", "--modelpatch-report", "shard-1.json",
                            "--modelpatch-baseline", "base.json")  # fmt: skip
    assert first.ret == pytest.ExitCode.OK, first.stdout.str()
    first.stdout.fnmatch_lines([
        "modelpatch gate PASSED: 1 checks against baseline base.json, 0 failures",
        "note 1 baseline checks are outside this run, not judged: 1 of tests it did not select",
    ])  # fmt: skip
    # under xdist the workers collect: the controller's report has their selection
    selection = load_report(suite.path / "shard-1.json")["selection"]
    assert selection == {"paths": ["test_suite.py"], "selected": [ATTENTION], "deselected": [MLP]}
    report(suite, "shard-2.json", "-p", "no:xdist", "-k", "mlp")

    def gate(*extra: str) -> Any:
        return modelpatch("gate", "shard-1.json", "shard-2.json", "--baseline", "base.json", *extra, cwd=suite.path)

    merged = gate("--markdown", "summary.md")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert merged.stdout.startswith(
        "modelpatch gate PASSED: 2 checks from 2 reports against baseline base.json, 0 failures\n"
    )
    assert "#### cpu: 2 checks, 0 failures\n" in (suite.path / "summary.md").read_text()

    for shard, name, test, args in (("shard-1.json", "ATTENTION", ATTENTION, ("-k", "attention")),
                                    ("shard-2.json", "MLP", MLP, ("-k", "mlp"))):  # fmt: skip
        monkeypatch.setenv(f"MODELPATCH_TEST_{name}_EPS", "1e-3")  # the test still passes: only the gate sees it
        report(suite, shard, *args)
        worse = gate()
        assert worse.returncode == 1, worse.stdout
        assert f"FAIL {test} equivalence#1 (LlamaForCausalLM, " in worse.stdout
        assert "max abs error grew from 0 (baseline) to 0.0" in worse.stdout  # 1e-3 in the layer, more in the logits
        monkeypatch.delenv(f"MODELPATCH_TEST_{name}_EPS")
        report(suite, shard, *args)

    # a check that ran in no report is missing from the merged verdict
    monkeypatch.setenv("MODELPATCH_TEST_MLP_GONE", "1")
    report(suite, "shard-2.json", "-k", "mlp")
    gone = gate()
    assert gone.returncode == 1
    assert re.search(rf"FAIL {MLP} equivalence#1 \(LlamaForCausalLM, [^)]+\): in the baseline \(max abs error 0\) but did not "
                     r"run in any of the 2 reports", gone.stdout)  # fmt: skip


def test_the_same_check_in_two_reports_from_one_device_is_refused_naming_both_files(suite: pytest.Pytester) -> None:
    full = report(suite, "full.json")
    shard = report(suite, "shard-1.json", "-k", "attention")
    refused = modelpatch("gate", "full.json", "shard-1.json", cwd=suite.path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith(
        f"modelpatch: error: {ATTENTION} equivalence#1 on cpu is in both full.json and shard-1.json, two reports from cpu: "
        "shards of one job must select disjoint tests"
    )
    twice = modelpatch("gate", "full.json", "full.json", cwd=suite.path)
    assert twice.returncode == 2 and "full.json is given twice" in twice.stderr
    # the same checks from two devices are a matrix: both judged
    as_gpu_report(shard, suite.path / "h100.json")
    matrix = modelpatch("gate", "full.json", "h100.json", "--markdown", "summary.md", cwd=suite.path)
    assert matrix.returncode == 0, matrix.stderr
    assert matrix.stdout.startswith("modelpatch gate PASSED: 3 checks from 2 reports, 0 failures")
    summary = (suite.path / "summary.md").read_text()
    assert summary.index("#### cpu: 2 checks, 0 failures") < summary.index(f"#### {H100}: 1 checks, 0 failures")
    assert full["header"]["device_classes"] == ["cpu"] and {r["device_class"] for r in full["rows"]} == {"cpu"}


def test_a_cpu_run_is_judged_on_the_cpu_rows_only_and_a_gpu_with_no_rows_is_new_device(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    exact = report(suite, "exact.json")
    monkeypatch.setenv("MODELPATCH_TEST_ATTENTION_EPS", "1e-3")
    drifted = report(suite, "drifted.json")
    # the report header and rows name the device: the CPU here
    assert (drifted["header"]["default_device"], drifted["header"]["default_device_class"]) == ("cpu", "cpu")
    assert [(r["device"], r["device_class"]) for r in drifted["rows"]] == [("cpu", "cpu"), ("cpu", "cpu")]

    # cpu rows as drifted, H100 rows exact: judged against the H100's figures the drift would fail
    h100_exact = load_report(as_gpu_report(exact, suite.path / "h100-exact.json"))["rows"]
    write_report(suite.path / "base.json", {}, drifted["rows"] + h100_exact)
    judged = suite.runpytest("--modelpatch-baseline", "base.json")
    assert judged.ret == pytest.ExitCode.OK, judged.stdout.str()
    judged.stdout.fnmatch_lines([
        "modelpatch gate PASSED: 2 checks against baseline base.json, 0 failures",
        "note 2 baseline checks are outside this run, not judged: 2 on devices it did not run on",
    ])  # fmt: skip
    # cpu rows exact, H100 rows drifted: the drifted CPU run fails on its own rows
    h100_drifted = load_report(as_gpu_report(drifted, suite.path / "h100-drifted.json"))["rows"]
    write_report(suite.path / "base-2.json", {}, exact["rows"] + h100_drifted)
    failed = modelpatch("gate", "drifted.json", "--baseline", "base-2.json", cwd=suite.path)
    assert failed.returncode == 1
    assert re.search(rf"FAIL {ATTENTION} equivalence#1 \(LlamaForCausalLM, [^)]+\): max abs error grew from 0 \(baseline\) "
                     r"to 0\.01", failed.stdout)  # fmt: skip

    # a GPU the baseline has no rows for: new, not failed, not judged against the CPU's figures
    write_report(suite.path / "cpu-base.json", {}, exact["rows"])
    new = modelpatch(
        "gate", "h100-drifted.json", "--baseline", "cpu-base.json", "--markdown", "summary.md", cwd=suite.path
    )
    assert new.returncode == 0, new.stdout
    assert f"note new device {H100}: 2 checks not judged against the baseline, which has no rows for it (it has cpu)" \
        in new.stdout  # fmt: skip
    summary = (suite.path / "summary.md").read_text()
    assert f"#### {H100}: 2 checks, 0 failures, new device: not judged against the baseline" in summary
    # its checks still face the thresholds and their own outcome
    assert modelpatch("gate", "h100-drifted.json", "--baseline", "cpu-base.json", "--max-abs-error", "1e-4",
                      cwd=suite.path).returncode == 1  # fmt: skip
    as_gpu_report(drifted, suite.path / "h100-failed.json", outcome="failed")
    failing = modelpatch("gate", "h100-failed.json", "--baseline", "cpu-base.json", cwd=suite.path)
    assert failing.returncode == 1 and re.search(
        rf"FAIL {ATTENTION} .* on |FAIL {ATTENTION} .*: the check failed", failing.stdout
    )


def test_updating_the_baseline_from_a_cpu_run_keeps_the_gpu_rows(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    exact = report(suite, "exact.json")
    gpu_rows = load_report(as_gpu_report(exact, suite.path / "h100.json", max_abs_error=0.25))["rows"]
    write_report(suite.path / "base.json", {}, exact["rows"] + gpu_rows)

    monkeypatch.setenv("MODELPATCH_TEST_ATTENTION_EPS", "1e-3")
    monkeypatch.setenv("MODELPATCH_TEST_MLP_EPS", "1e-3")
    updated = suite.runpytest("-k", "attention", "--modelpatch-baseline", "base.json", "--modelpatch-update-baseline")
    updated.assert_outcomes(passed=1, deselected=1)
    updated.stdout.fnmatch_lines([
        f"note baseline base.json rewritten with 1 checks; kept 3 of devices or tests this run did not cover "
        f"(1 on cpu, 2 on {H100})"
    ])  # fmt: skip
    rows = {(r["nodeid"], r["device_class"]): r for r in load_report(suite.path / "base.json")["rows"]}
    assert len(rows) == 4
    assert [rows[(test, H100)] for test in (ATTENTION, MLP)] == gpu_rows  # untouched
    assert rows[(ATTENTION, "cpu")]["max_abs_error"] > 1e-3  # this run's figure
    assert rows[(MLP, "cpu")]["max_abs_error"] == 0.0  # deselected: kept

    # modelpatch gate --update-baseline does the same with the reports of every shard
    report(suite, "drifted.json")
    cli = modelpatch("gate", "drifted.json", "--baseline", "base.json", "--update-baseline", cwd=suite.path)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert f"note baseline base.json rewritten with 2 checks; kept 2 of devices or tests this run did not cover (2 on {H100})" \
        in cli.stdout  # fmt: skip
    after = load_report(suite.path / "base.json")
    assert after["header"]["device_classes"] == ["cpu", H100]
    assert [r for r in after["rows"] if r["device_class"] == H100] == gpu_rows
    assert json.loads((suite.path / "base.json").read_text())["schema_version"] == 4
