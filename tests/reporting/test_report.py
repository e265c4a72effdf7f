"""The check report: rows attached to test reports, merged on the controller, one JSON file, a terminal table."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import Any

import pytest

from pytest_modelpatch.reporting.records import CheckRecord, record_check, set_record_sink
from pytest_modelpatch.reporting.report import row_from_record, sort_rows, summary_lines
from pytest_modelpatch.reporting.session import CheckSink

SUITE_EQUIVALENCE = """
import pytest
from transformers.models.llama.modeling_llama import LlamaMLP
from pytest_modelpatch import assert_equivalent, assert_module_equivalent


class SameMLP(LlamaMLP):
    pass


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": SameMLP})
def test_mlp(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert_module_equivalent(reference_model, patched_model, "model.layers.0.mlp")


def test_without_checks():
    pass
"""

SUITE_PROPERTY = """
import pytest
from pytest_modelpatch import check_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_property(reference_model, patched_model):
    check_equivalent(reference_model, patched_model, max_examples=3)
"""


def _rows_without_durations(path: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "duration_s"} for row in json.loads(path.read_text())["rows"]]


def test_report_rows_and_header_are_the_same_under_xdist_and_without(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_equivalence_suite=SUITE_EQUIVALENCE, test_property_suite=SUITE_PROPERTY)
    reports = {}
    for mode, args in {"xdist-2": ("-n", "2", "--dist", "loadfile"), "no-xdist": ("-p", "no:xdist")}.items():
        path = pytester.path / f"{mode}.json"
        result = pytester.runpytest(*args, "--modelpatch-report", str(path), "--modelpatch-seed", "7",
                                    f"--junitxml={mode}.xml")  # fmt: skip
        result.assert_outcomes(passed=3)
        result.stdout.fnmatch_lines(["*modelpatch: 3 checks, worst first*", "outcome*max abs*check*test"])
        header = json.loads(path.read_text())["header"]
        assert header["seed"] == 7
        assert set(header["versions"]) >= {"torch", "transformers", "hypothesis", "pytest"}
        assert header["versions"]["transformers"].startswith("5.")
        assert header["devices"] == ["cpu"] and header["python"]
        assert "--modelpatch-seed" in header["command_line"]
        reports[mode] = _rows_without_durations(path)
        # JUnit XML shows each check and its key figures as properties of the test case
        case = ET.parse(pytester.path / f"{mode}.xml").find(".//testcase[@name='test_mlp']")
        names = [p.get("name") for p in case.iter("property")]
        assert names.count("modelpatch_check") == 2 and "modelpatch_max_abs_error" in names
    assert reports["xdist-2"] == reports["no-xdist"]
    rows = reports["no-xdist"]
    assert [(r["nodeid"], r["check"]) for r in rows] == [
        ("test_equivalence_suite.py::test_mlp", "equivalence#1"),
        ("test_equivalence_suite.py::test_mlp", "module#1"),
        ("test_property_suite.py::test_property", "property#1"),
    ]
    equivalence = rows[0]
    assert equivalence["patch_keys"] == ["LlamaMLP"]
    assert equivalence["replacements"] == ["test_equivalence_suite.SameMLP"]
    assert (equivalence["outcome"], equivalence["max_abs_error"], equivalence["dtype"]) == ("passed", 0.0, "float32")
    assert rows[2]["examples"] == 3


def test_seed_reaches_the_report_header_line_and_is_validated(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmodelpatch_seed = 11\n")
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest("-p", "no:xdist")
    result.stdout.fnmatch_lines(["modelpatch: seed 11*"])
    result.stdout.no_fnmatch_line("*checks, worst first*")  # quiet when no check ran
    bad = pytester.runpytest("-p", "no:xdist", "--modelpatch-seed", "abc")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--modelpatch-seed 'abc': expected an integer*"])


def test_sink_stamps_the_node_id_numbers_checks_and_adds_key_figures(records: list[CheckRecord]) -> None:
    class Item:
        def __init__(self) -> None:
            self.nodeid = "tests/test_x.py::test_a"
            self.user_properties: list[tuple[str, Any]] = []
            self.stash = pytest.Stash()  # as every pytest item has

    item = Item()
    previous = set_record_sink(CheckSink(item))  # as the plugin does around a test
    try:
        record_check(CheckRecord(kind="equivalence", outcome="passed", max_abs_error=1e-7, max_rel_error=1e-6))
        record_check(CheckRecord(kind="equivalence", outcome="failed", max_abs_error=0.5))
    finally:
        set_record_sink(previous)
    record_check(CheckRecord(kind="roundtrip", outcome="passed"))  # after the test: the previous sink again
    assert [r.kind for r in records] == ["roundtrip"]
    rows = [value for name, value in item.user_properties if name == "modelpatch_check"]
    assert [(r["nodeid"], r["check"], r["outcome"]) for r in rows] == [
        ("tests/test_x.py::test_a", "equivalence#1", "passed"),
        ("tests/test_x.py::test_a", "equivalence#2", "failed"),
    ]
    assert ("modelpatch_max_abs_error", 0.5) in item.user_properties
    assert ("modelpatch_max_rel_error", 1e-6) in item.user_properties


def _row(nodeid: str, kind: str, error: float | None, index: int = 1) -> dict[str, Any]:
    return row_from_record(CheckRecord(kind=kind, outcome="passed", max_abs_error=error), nodeid, index)


def test_rows_sort_by_test_then_kind_then_order_within_the_test() -> None:
    rows = [
        _row("b.py::t", "module", 0.0),
        _row("a.py::t", "equivalence", 0.0, 10),
        _row("a.py::t", "equivalence", 0.0, 2),
    ]
    assert [(r["nodeid"], r["check"]) for r in sort_rows(rows)] == [
        ("a.py::t", "equivalence#2"), ("a.py::t", "equivalence#10"), ("b.py::t", "module#1"),
    ]  # fmt: skip


def test_summary_table_puts_the_worst_error_first_and_caps_its_length() -> None:
    rows = [_row("a.py::t", "equivalence", 1e-7), _row("b.py::t", "roundtrip", None), _row("c.py::t", "module", 0.25)]
    lines = summary_lines(rows, limit=2)
    assert lines[0].split()[:4] == ["outcome", "max", "abs", "max"]
    assert lines[1].split()[1] == "0.25" and lines[1].endswith("c.py::t")
    assert lines[2].split()[1] == "1e-07"
    assert lines[-1] == "... and 1 more (see --modelpatch-report)"


def test_summary_table_puts_failures_first_and_orders_figures_as_printed() -> None:
    failed = row_from_record(CheckRecord(kind="equivalence", outcome="failed", max_abs_error=1e-3), "d.py::t", 1)
    meant = row_from_record(
        CheckRecord(kind="equivalence", outcome="failed", max_abs_error=5.0, expected_failure=True), "e.py::t", 1
    )
    # 1.2301 and 1.2299 print alike (1.23): CPU round-off must not reorder them, their ids do
    rows = [_row("b.py::t", "equivalence", 1.2301), _row("a.py::t", "equivalence", 1.2299), failed, meant]
    order = [line.split()[-1] for line in summary_lines(rows)[1:]]
    assert order == ["d.py::t", "e.py::t", "a.py::t", "b.py::t"]
    swapped = [_row("b.py::t", "equivalence", 1.2299), _row("a.py::t", "equivalence", 1.2301), failed, meant]
    assert [line.split()[-1] for line in summary_lines(swapped)[1:]] == order


def test_divergence_profile_is_zero_before_the_changed_layer_and_drawn_as_html(tmp_path: Any) -> None:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pytest_modelpatch.compare._engine.divergence import divergence_profile, first_divergence
    from pytest_modelpatch.reporting.profile_html import write_profile_html

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)  # fmt: skip
    reference = LlamaForCausalLM(config).eval()
    patched = copy.deepcopy(reference)
    with torch.no_grad():
        patched.model.layers[1].mlp.down_proj.weight.add_(1e-3)
    inputs = {"input_ids": torch.tensor([[1, 5, 9, 2]])}
    profile = divergence_profile(reference, patched, inputs)
    names = [name for name, _ in profile]
    first = next(name for name, error in profile if error > 0)
    assert first == "model.layers.1.mlp.down_proj"
    assert all(error == 0 for name, error in profile[: names.index(first)])
    found = first_divergence(reference, patched, inputs)
    assert found is not None and found.blame is None  # no module was replaced: nothing to replay
    row = {"nodeid": "t.py::test_a", "check": "equivalence#1", "kind": "equivalence", "outcome": "failed",
           "max_abs_error": 0.01, "model": "LlamaForCausalLM", "detail": "logits: <differs>", "profile": profile,
           "first_diverging": found.name}  # fmt: skip
    write_profile_html(tmp_path / "p.html", [row])
    page = (tmp_path / "p.html").read_text()
    assert "<svg" in page and page.count("<rect") == len(profile)
    assert "first diverging module: <code>model.layers.1.mlp.down_proj</code>" in page
    assert "logits: &lt;differs&gt;" in page
