"""The --modelpatch-html page from a real failing check: the first diverging module, the chart's axes and a table of
every module call in order, read from the page as a parser and as headless Chromium see it."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

# A fused gate/up MLP kernel, right and with one planted bug (the halves swapped): the bug's first diverging
# module is layer 0's MLP, and the calls inside it (act_fn, down_proj) finish, and differ, before it.
KERNELS = """
import pytest
from torch import nn
from transformers.activations import ACT2FN
from transformers.core_model_loading import Concatenate, WeightConverter

from pytest_modelpatch import assert_equivalent


class FusedGateUpMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class SwappedGateUpMLP(FusedGateUpMLP):
    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


FUSE = {"llama": [WeightConverter(["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight",
                                  operations=[Concatenate(dim=0)])]}


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": FusedGateUpMLP}, conversions=FUSE)
def test_right(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": SwappedGateUpMLP}, conversions=FUSE)
def test_swapped(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


Run = tuple[Path, dict[str, Any]]  # the page's path and the failing check's report row


class PageText(HTMLParser):
    """What a reader sees: the text of each element by class, the table's rows (cells and class), the headings."""

    def __init__(self) -> None:
        super().__init__()
        self.by_class: dict[str, list[str]] = {}
        self.rows: list[tuple[str, list[str]]] = []
        self.sections = 0
        self._open: list[tuple[str, str]] = []  # (tag, class) of the elements we are inside
        self._text: dict[int, list[str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        css = dict(attrs).get("class") or ""
        self.sections += tag == "section"
        if tag == "tr":
            self.rows.append((css, []))
        if tag == "td" and self.rows:
            self.rows[-1][1].append("")
        self._open.append((tag, css))
        self._text[len(self._open)] = []

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            depth = len(self._open)
            opened, css = self._open.pop()
            text = "".join(self._text.pop(depth, []))
            if self._open:
                self._text[len(self._open)].append(text)
            if css:
                self.by_class.setdefault(css, []).append(text)
            if opened == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._open:
            self._text[len(self._open)].append(data)
        if any(tag == "td" for tag, _ in self._open) and self.rows and self.rows[-1][1]:
            self.rows[-1][1][-1] += data


def read_page(text: str) -> PageText:
    page = PageText()
    page.feed(text)
    return page


@pytest.fixture
def failing_run(pytester: pytest.Pytester) -> Run:
    pytester.makepyfile(test_kernels=KERNELS)
    page, report = pytester.path / "page.html", pytester.path / "report.json"
    result = pytester.runpytest("-p", "no:randomly", "--modelpatch-html", str(page), "--modelpatch-report", str(report))
    result.assert_outcomes(passed=1, failed=1)
    (row,) = [r for r in json.loads(report.read_text())["rows"] if r["outcome"] == "failed"]
    assert row["nodeid"] == "test_kernels.py::test_swapped"
    return page, row


def assert_reads_well(page: PageText, row: dict[str, Any]) -> None:
    __tracebackhide__ = True
    assert page.sections == 1  # the failing check only; the right kernel's check passed
    assert page.by_class.get("first") == ["first diverging module: model.layers.0.mlp"]
    # the replacement the check's text blames comes first, as the text names it
    blamed = "replaced module whose own output differs: model.layers.0.mlp, model.layers.1.mlp"
    assert page.by_class.get("blamed") == [blamed]
    assert page.by_class.get("first-label") == ["first diverging module: model.layers.0.mlp"]  # on the chart
    assert page.by_class.get("y-label") == ["max abs error (log scale)"]
    calls = len(row["profile"])
    x_label = f"module calls in forward order (1 to {calls}, as the table below lists them)"
    assert page.by_class.get("x-label") == [x_label]
    assert page.by_class.get("y-tick") and all(tick.startswith("1e") for tick in page.by_class.get("y-tick"))
    # the table: every call of the check's profile, in its order, with its error; the blamed call marked
    body = [(css, cells) for css, cells in page.rows if cells]
    assert [int(cells[0]) for _, cells in body] == list(range(1, len(row["profile"]) + 1))
    assert [cells[1] for _, cells in body] == [name for name, _ in row["profile"]]
    assert [float(cells[2]) for _, cells in body] == pytest.approx([error for _, error in row["profile"]], rel=1e-2)
    marked = [cells[1] for css, cells in body if css == "first-diverging"]
    assert marked == ["model.layers.0.mlp"]
    before = [cells for css, cells in body][: [cells[1] for _, cells in body].index("model.layers.0.mlp")]
    assert [cells[1] for cells in before if cells[3] == "agrees"][:2] == ["model.embed_tokens", "model.rotary_emb"]
    assert "model.layers.0.mlp.act_fn" in [cells[1] for cells in before]  # inside the MLP: listed before it


def test_the_page_names_the_first_diverging_module_labels_its_axes_and_lists_every_call(failing_run: Run) -> None:
    path, row = failing_run
    assert_reads_well(read_page(path.read_text()), row)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_headless_chromium_shows_the_labels_and_the_table(failing_run: Run) -> None:
    path, row = failing_run
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert_reads_well(read_page(done.stdout), row)


def test_a_page_without_the_check_text_marks_the_first_call_that_differs(tmp_path: Path) -> None:
    from pytest_modelpatch.reporting.profile_html import write_profile_html

    profile = [["embed", 0.0], ["layers.0.attn", 0.0], ["layers.0.mlp", 2.5e-3], ["lm_head", float("inf")]]
    row = {"nodeid": "t.py::t", "check": "equivalence#1", "kind": "equivalence", "outcome": "failed",
           "profile": profile}  # fmt: skip
    write_profile_html(tmp_path / "p.html", [row])
    page = read_page((tmp_path / "p.html").read_text())
    assert page.by_class.get("first") == ["first diverging module: layers.0.mlp"]
    assert [(css, cells[1], cells[2]) for css, cells in page.rows if cells] == [
        ("agrees", "embed", "0"), ("agrees", "layers.0.attn", "0"), ("first-diverging", "layers.0.mlp", "0.0025"),
        ("differs", "lm_head", "inf"),
    ]  # fmt: skip
