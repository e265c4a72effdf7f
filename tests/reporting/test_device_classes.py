"""A row's device class (the GPU's name as torch reports it, or ``cpu``): derived, stamped on rows and the
header, and read back from reports written before there was one (schema version 2).

There is no GPU here: the GPU's name is passed in, as torch would report it; tests/models/test_gpu.py
checks it against torch on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_modelpatch.errors import ReportFileError
from pytest_modelpatch.reporting import session
from pytest_modelpatch.reporting.gate import Thresholds, evaluate
from pytest_modelpatch.reporting.records import CheckRecord, record_check, set_record_sink
from pytest_modelpatch.reporting.report import device_class, load_report, row_from_record
from pytest_modelpatch.reporting.session import CheckSink, report_header

A10, H100 = "NVIDIA A10G", "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("device", "names", "current", "expected"),
    [
        ("cpu", (), 0, "cpu"),
        ("", (), 0, "cpu"),  # a check with no device ran on the CPU
        ("cuda:1", (A10, H100), 0, H100),
        ("CUDA:0", (A10, H100), 0, A10),
        ("cuda", (A10, H100), 1, H100),  # bare cuda: the current device
        ("cuda:2", (A10, H100), 0, "cuda"),  # a GPU whose name is not known
        ("cuda:0", (), 0, "cuda"),
        ("mps", (), 0, "mps"),
        ("meta", (A10,), 0, "meta"),
    ],
)
def test_a_device_class_is_the_gpus_name_or_the_device_type(
    device: str, names: tuple[str, ...], current: int, expected: str
) -> None:
    assert device_class(device, names, current) == expected


def test_rows_of_cuda_checks_carry_the_name_torch_gives_their_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "gpu_names", lambda: (A10, H100))

    class Item:
        nodeid = "t.py::test_a"
        user_properties: list[tuple[str, Any]] = []
        stash = pytest.Stash()

    previous = set_record_sink(CheckSink(Item()))  # as the plugin does around a test
    try:
        record_check(CheckRecord(kind="equivalence", outcome="passed", device="cuda:1", max_abs_error=0.0))
        record_check(CheckRecord(kind="equivalence", outcome="passed", device="cpu", max_abs_error=0.0))
    finally:
        set_record_sink(previous)
    rows = [value for name, value in Item.user_properties if name == "modelpatch_check"]
    assert [(r["device"], r["device_class"]) for r in rows] == [("cuda:1", H100), ("cpu", "cpu")]
    assert row_from_record(CheckRecord(kind="roundtrip", outcome="passed"), "t.py::test_b", 1)["device_class"] == "cpu"


@pytest.mark.parametrize(("default", "names", "expected"), [
    ("cuda", (H100,), H100), ("auto", (H100,), H100), ("auto", (), "cpu"), ("cpu", (H100,), "cpu"),
])  # fmt: skip
def test_the_header_names_the_default_devices_class_and_every_class_the_rows_ran_on(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch, default: str, names: tuple[str, ...], expected: str
) -> None:
    monkeypatch.setattr(session, "gpu_names", lambda: names)
    roundtrip = row_from_record(CheckRecord(kind="roundtrip", outcome="passed", device="cpu"), "t.py::test_a", 1)
    header = report_header(pytestconfig, 0, [roundtrip], default)
    assert (header["default_device"], header["default_device_class"], header["accelerators"]) == (
        default,
        expected,
        list(names),
    )
    assert header["device_classes"] == (["cpu", H100] if expected == H100 else ["cpu"])


def _v2_report(path: Path, rows: list[dict[str, Any]], accelerators: list[str]) -> Path:
    """A report as version 2 wrote it: no device_class on rows, no device fields in the header."""
    for row in rows:
        del row["device_class"]
    header = {"format": 2, "accelerators": accelerators, "devices": sorted({r["device"] for r in rows})}
    path.write_text(json.dumps({"schema_version": 2, "header": header, "rows": rows}))
    return path


def _row(nodeid: str, error: float, device: str = "cpu", outcome: str = "passed") -> dict[str, Any]:
    record = CheckRecord(
        kind="equivalence", outcome=outcome, model="LlamaForCausalLM", device=device, max_abs_error=error
    )
    return row_from_record(record, nodeid, 1, (A10,) if device.startswith("cuda") else ())


def test_a_version_2_baseline_is_judged_as_the_devices_its_rows_name(tmp_path: Path) -> None:
    old = _v2_report(tmp_path / "base.json", [_row("a.py::t", 1e-6), _row("b.py::t", 0.5, "cuda:0")], [A10])
    baseline = load_report(old)["rows"]
    assert [r["device_class"] for r in baseline] == ["cpu", A10]
    # a CPU run: judged on the cpu row; the A10 row is another device's, not missing
    verdict = evaluate([_row("a.py::t", 1.5e-6)], Thresholds(), baseline, "base.json")
    assert verdict.passed, str(verdict)
    assert "1 baseline checks are outside this run, not judged: 1 on devices it did not run on" in verdict.notes
    worse = evaluate([_row("a.py::t", 1e-4)], Thresholds(), baseline, "base.json")
    assert worse.failures[0].startswith("a.py::t equivalence#1 (LlamaForCausalLM): max abs error grew from 1e-06")
    # rows with no accelerators to name them are the class "cuda": judged as no named GPU
    unnamed = load_report(_v2_report(tmp_path / "unnamed.json", [_row("b.py::t", 0.5, "cuda:0")], []))["rows"]
    assert unnamed[0]["device_class"] == "cuda"


def test_a_report_of_a_newer_schema_is_refused_naming_the_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"schema_version": 99, "header": {}, "rows": []}))
    with pytest.raises(
        ReportFileError, match=r"future.json: schema_version 99 is newer than this pytest-modelpatch reads \(4\)"
    ):
        load_report(path)
    path.write_text(json.dumps({"schema_version": "3", "header": {}, "rows": []}))
    with pytest.raises(
        ReportFileError, match='future.json: schema_version is "3", expected a whole number from 1 to 4'
    ):
        load_report(path)
