"""The composition grid: every check, where it runs, at each dtype, on what it checks, in one real pytest session.

A user runs the checks together, sharded, in low precision, on a kernel: each capability passing
its own tests says little about their product (torch's OpInfo tests cross ops with dtypes and
devices for that reason). The axes:

- the check: ``assert_equivalent``, ``assert_backward_equivalent``, ``assert_trains_equivalent``,
  ``assert_decodes_equivalent``, ``check_equivalent``, and three in a row inside one test
  (equivalent, then trains, then equivalent: what the first leaves behind is what the next sees);
- where: one process, ``parallel("tp")``, ``parallel("fsdp")``, ``parallel("fsdp", layout="per_module")``
  (``lm_head`` and the embeddings units of their own), ``parallel("ddp")``;
- the dtype: float32 and bfloat16;
- what: the stock model, a correct kernel, and its broken twin. The kernel is one that makes sense
  sharded that way: the custom-autograd SwiGLU MLP (its twin drops the up projection's gradient,
  so only the backward and training checks can see it) in one process and under FSDP2 and DDP;
  the fused QKV attention with its tensor-parallel plan (its twin the packed plan, wrong in every
  output) under TP; under the per-module FSDP layout a fused linear-cross-entropy computed in
  ``lm_head``'s forward (its twin holds ``lm_head``'s weight from patch time, a tensor the sharded
  model no longer trains). In every place also a patch whose replacement never runs (a decoder
  layer that computes the MLP inline): its outputs agree, so only the checks' count of the
  replacements that ran can fail it, and each must.

Every cell must give the right verdict (the right code passes; the broken twin fails with its
check's report, no rank crashed) or be a refusal the plugin itself makes: a skip saying why. The
run writes ``grid.json`` (cell -> verdict) and ``grid.md`` (the tables), and the tables in
``docs/distributed.md`` and ``docs/training.md`` must be what it prints for the cells it ran.

Every parallel cell runs in the same pytest session, so in the same pool of ranks: the pool
restarts only after a rank crashed or hung, which the test checks by the ranks' process ids.

By default only the one-process cells run (seconds). ``MODELPATCH_GRID=all`` runs every cell, as
CI's grid lane does; ``MODELPATCH_GRID=tp,fsdp`` a few places. ``MODELPATCH_GRID_OUT=DIR`` keeps
``grid.json`` and ``grid.md`` there.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = {"distributed": REPO_ROOT / "docs" / "distributed.md", "training": REPO_ROOT / "docs" / "training.md"}
SELECTED = os.environ.get("MODELPATCH_GRID", "")
STEPS = 3  # training steps: a dropped gradient shows at step 0, a crash at the first restore
EXAMPLES = 3  # check_equivalent's drawn inputs

CHECKS = {
    "equivalent": "`assert_equivalent`",
    "backward": "`assert_backward_equivalent`",
    "trains": "`assert_trains_equivalent`",
    "decodes": "`assert_decodes_equivalent`",
    "property": "`check_equivalent`",
    "sequence": "equivalent, trains, equivalent",
}
TRAINING_CHECKS = ("backward", "trains", "sequence")  # the columns docs/training.md shows
WHERE = {"one": "one process", "tp": "`tp`", "fsdp": "`fsdp`", "fsdp_per_module": "`fsdp`, per module", "ddp": "`ddp`"}
PARALLEL = {"tp": '"tp"', "fsdp": '"fsdp"', "fsdp_per_module": '"fsdp", layout="per_module"', "ddp": '"ddp"'}
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Subject:
    """What a row of the grid checks: its name in the table, its patch marker, and what it must fail."""

    label: str
    patch: str  # the decorator line
    fails: tuple[str, ...] = ()  # the checks that must catch it


_SWIGLU = "@pytest.mark.patch(swiglu.MAPPING)"
_QKV = "@pytest.mark.patch(qkv.MAPPING, conversions=qkv.CONVERSIONS, tp_plan=qkv.{})"
STOCK = Subject(
    "stock model", "@pytest.mark.patch(unpatched=True)"
)  # a baseline on purpose (where the sharding is no patch)
SUBJECTS: dict[str, dict[str, Subject]] = {
    where: {
        "stock": STOCK,
        "kernel": Subject("fused SwiGLU MLP", _SWIGLU),
        "broken": Subject(
            "its twin without the up gradient",
            _SWIGLU.replace("swiglu.", "swiglu_broken."),
            fails=("backward", "trains", "sequence"),
        ),
    }  # fmt: skip
    for where in ("one", "fsdp", "ddp")
}
SUBJECTS["tp"] = {
    "stock": STOCK,
    "kernel": Subject("fused QKV, colwise plan", _QKV.format("TP_PLAN")),
    "broken": Subject("its twin with the packed plan", _QKV.format("TP_PLAN_PACKED"), fails=tuple(CHECKS)),
}
SUBJECTS["fsdp_per_module"] = {
    "stock": STOCK,
    "kernel": Subject(
        "fused loss in `lm_head`", "@pytest.mark.patch(transform=transforms.fused_linear_cross_entropy_in_head)"
    ),
    "broken": Subject(
        "its twin holding `lm_head.weight`",
        "@pytest.mark.patch(transform=transforms.fused_linear_cross_entropy_captured_head)",
        fails=("backward", "trains", "sequence"),
    ),
}
for _subjects in SUBJECTS.values():
    _subjects["unused"] = Subject(
        "a replacement that never runs",
        '@pytest.mark.patch(UNUSED, allow={"LlamaDecoderLayer": ["CONTAINER"]})',
        fails=tuple(CHECKS),
    )

INNER_HEAD = f"""
import os
from pathlib import Path

import pytest
from fixtures.patches import llama_fused_qkv_tp as qkv
from fixtures.patches import llama_swiglu_autograd as swiglu
from fixtures.patches import llama_swiglu_autograd_broken as swiglu_broken
from fixtures.patches import training_transforms as transforms
from pytest_modelpatch import (
    assert_backward_equivalent, assert_equivalent, assert_decodes_equivalent, assert_trains_equivalent,
    check_equivalent,
)
from fixtures.patches._inline_mlp_layer import InlineMLPLayer
from transformers.models.llama.modeling_llama import LlamaMLP

CHECKS = {list(CHECKS)!r}


class NeverRunMLP(LlamaMLP):  # the replacement a check must see run: InlineMLPLayer never calls it
    pass


UNUSED = {{"LlamaDecoderLayer": InlineMLPLayer, "LlamaMLP": NeverRunMLP}}


def run(check, reference, patched, nodeid):
    if os.environ.get("MODELPATCH_RANK") == "0":  # which pool ran it: the ranks' process ids
        with (Path(__file__).parent / "rank0-pids.txt").open("a") as out:
            out.write(f"{{nodeid}} {{os.getpid()}}\\n")
    if check == "equivalent":
        assert_equivalent(reference, patched)
    elif check == "backward":
        assert_backward_equivalent(reference, patched)
    elif check == "trains":
        assert_trains_equivalent(reference, patched, steps={STEPS})
    elif check == "decodes":
        assert_decodes_equivalent(reference, patched)
    elif check == "property":
        check_equivalent(reference, patched, max_examples={EXAMPLES})
    else:
        assert_equivalent(reference, patched)
        assert_trains_equivalent(reference, patched, steps={STEPS})
        assert_equivalent(reference, patched)
"""

INNER_TEST = """

@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", {dtypes!r}, indirect=True)
@pytest.mark.model("llama")
{patch}
{parallel}
def test_{what}_{where}(reference_model, patched_model, check, request):
    run(check, reference_model, patched_model, request.node.nodeid)
"""

# the controller's reports, one JSON line each (the ranks' own sessions write nothing)
INNER_CONFTEST = """
import json
import os
from pathlib import Path


def pytest_runtest_logreport(report):
    if os.environ.get("MODELPATCH_RANK") is not None:
        return
    skipped = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
    row = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": report.longreprtext,
           "skip": str(skipped).removeprefix("Skipped: ")}
    with (Path(__file__).parent / "reports.jsonl").open("a") as out:
        out.write(json.dumps(row) + "\\n")
"""


def places() -> list[str]:
    """The places this run covers: every one under ``MODELPATCH_GRID=all``, one process by default."""
    if SELECTED == "all":
        return list(WHERE)
    chosen = [p.strip() for p in SELECTED.split(",") if p.strip()] or ["one"]
    unknown = sorted(set(chosen) - set(WHERE))
    if unknown:
        raise pytest.UsageError(f"MODELPATCH_GRID={SELECTED!r}: no place {unknown}; use 'all' or some of {list(WHERE)}")
    return chosen


def inner_module(wheres: Iterable[str]) -> str:
    """The grid's test file: one test function per (where, what), parametrized by dtype and check."""
    tests = [
        INNER_TEST.format(dtypes=DTYPES, patch=subject.patch, what=what, where=where,
                          parallel="" if where == "one" else f"@pytest.mark.parallel({PARALLEL[where]})")
        for where in wheres for what, subject in SUBJECTS[where].items()
    ]  # fmt: skip
    return INNER_HEAD + "".join(tests)


@dataclass
class Cell:
    """One cell of the grid and what became of it."""

    where: str
    what: str
    dtype: str
    check: str
    outcome: str = "missing"  # passed, failed, skipped: the test's
    verdict: str = ""  # pass, caught, refused, missed, false alarm, crash, error
    detail: str = ""  # the skip's reason, the crash, the error or the false alarm's first line

    def __str__(self) -> str:
        return f"  {self.where} / {self.what} / {self.dtype} / {self.check}: {self.verdict}" + (
            f": {self.detail}" if self.detail else ""
        )

    @property
    def expected_to_fail(self) -> bool:
        return self.check in SUBJECTS[self.where][self.what].fails

    @property
    def right(self) -> bool:
        return self.verdict in ("pass", "caught", "refused")


_NODE = re.compile(r"::test_(\w+?)_(\w+)\[(\w+)-(\w+)\]$")
_CRASH = "the ranks did not agree or did not all finish:"
# a check's report starts so: the one-input checks' "patched ... differs", a property's "check_equivalent(seed=..."
_REPORT = re.compile(r"^E\s+AssertionError: (patched .*|check_\w+\(seed=.*)$", re.M)
_RAISED = re.compile(r"^E\s+(\w+(?:Error|Exception|Interrupt)\b.*)$", re.M)


def collect_cells(rows: list[dict[str, Any]], wheres: Iterable[str]) -> list[Cell]:
    """Every cell of ``wheres``, judged from the controller's reports."""
    cells = {
        (where, what, dtype, check): Cell(where, what, dtype, check)
        for where in wheres for what in SUBJECTS[where] for dtype in DTYPES for check in CHECKS
    }  # fmt: skip
    by_node: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_node.setdefault(row["nodeid"], []).append(row)
    for nodeid, reports in by_node.items():
        match = _NODE.search(nodeid)
        assert match, f"a test the grid did not generate: {nodeid}"
        what, where, dtype, check = match.groups()
        judge(cells[(where, what, dtype, check)], reports)
    return list(cells.values())


def judge(cell: Cell, reports: list[dict[str, Any]]) -> None:
    """The cell's verdict from its test's reports (setup, call, teardown)."""
    failed = next((r for r in reports if r["outcome"] == "failed"), None)
    skipped = next((r for r in reports if r["outcome"] == "skipped"), None)
    if failed is None and skipped is not None:
        cell.outcome, cell.verdict, cell.detail = "skipped", "refused", skipped["skip"]
        return
    if failed is None:
        cell.outcome = "passed"
        cell.verdict = "missed" if cell.expected_to_fail else "pass"
        return
    cell.outcome, text = "failed", failed["text"]
    report = _REPORT.search(text)
    if _CRASH in text:
        summary = text.split(_CRASH, 1)[1].split("\n--- ", 1)[0]  # a line a rank, then each rank's details
        cell.verdict, cell.detail = "crash", "; ".join(line.strip() for line in summary.splitlines() if line.strip())
    elif report is not None and failed["when"] == "call":
        cell.verdict = "caught" if cell.expected_to_fail else "false alarm"
        cell.detail = "" if cell.expected_to_fail else report.group(1)
    else:
        raised = _RAISED.search(text)
        cell.verdict = "error"
        cell.detail = f"in {failed['when']}: " + (raised.group(1) if raised else text.strip().splitlines()[-1])


def table(cells: list[Cell], checks: Iterable[str]) -> str:
    """The markdown table: a row per (where, what, dtype), a column per check, and the refusals' reasons."""
    checks = list(checks)
    lines = ["| where | what | dtype | " + " | ".join(CHECKS[c] for c in checks) + " |",
             "|---|---|---|" + "---|" * len(checks)]  # fmt: skip
    reasons: list[str] = []
    by_row: dict[tuple[str, str, str], dict[str, Cell]] = {}
    for cell in cells:
        by_row.setdefault((cell.where, cell.what, cell.dtype), {})[cell.check] = cell
    for (where, what, dtype), row in by_row.items():
        shown = []
        for check in checks:
            cell = row[check]
            text = cell.verdict or cell.outcome
            if cell.verdict == "refused":
                if cell.detail not in reasons:
                    reasons.append(cell.detail)
                text = f"refused ({reasons.index(cell.detail) + 1})"
            elif not cell.right:
                text = f"**{text}**"
            shown.append(text)
        lines.append(f"| {WHERE[where]} | {SUBJECTS[where][what].label} | {dtype} | " + " | ".join(shown) + " |")
    lines += [""] + [f"({n}) {reason}" for n, reason in enumerate(reasons, 1)] if reasons else []
    return "\n".join(lines)


def tables(cells: list[Cell]) -> dict[str, str]:
    """What each doc shows: distributed.md every check, training.md the training ones."""
    return {"distributed": table(cells, CHECKS), "training": table(cells, TRAINING_CHECKS)}


def documented(doc: str) -> str:
    text = DOCS[doc].read_text(encoding="utf-8")
    match = re.search(r"<!-- grid:begin -->\n(.*?)\n<!-- grid:end -->", text, flags=re.S)
    assert match, f"docs/{doc}.md has no <!-- grid:begin --> ... <!-- grid:end --> block"
    return match.group(1).strip()


def documented_rows(doc: str) -> dict[tuple[str, str, str], str]:
    """The docs table's rows by (where, what, dtype): a row of a partial run is checked against its own."""
    rows = {}
    for line in documented(doc).splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 3 and not line.startswith(("| where", "|---")):
            rows[tuple(cells[:3])] = line
    return rows


def run_grid(pytester: pytest.Pytester, wheres: list[str]) -> tuple[list[Cell], float, list[str]]:
    """Run the grid's cells in one pytest session: the cells, the seconds it took, rank 0's process ids."""
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_grid=inner_module(wheres))
    started = time.monotonic()
    result = pytester.runpytest("-p", "no:randomly", "-q", "-rs")
    seconds = time.monotonic() - started
    reports = pytester.path / "reports.jsonl"
    assert reports.exists(), "the grid's session logged no report:\n" + "\n".join(result.outlines[-40:])
    rows = [json.loads(line) for line in reports.read_text().splitlines()]
    pids_file = pytester.path / "rank0-pids.txt"
    pids = [line.split()[-1] for line in pids_file.read_text().splitlines()] if pids_file.exists() else []
    return collect_cells(rows, wheres), seconds, pids


def write_out(cells: list[Cell], seconds: float, directory: Path, reports: Path) -> None:
    """``grid.json`` (cell -> verdict, with the run's seconds), ``grid.md`` (the docs' tables), the raw reports."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "reports.jsonl").write_bytes(reports.read_bytes())
    data = {"seconds": round(seconds, 1), "cells": [asdict(c) for c in cells]}
    (directory / "grid.json").write_text(json.dumps(data, indent=1) + "\n")
    blocks = tables(cells)
    (directory / "grid.md").write_text("".join(f"docs/{doc}.md:\n\n{block}\n\n" for doc, block in blocks.items()))


def test_every_cell_of_the_grid_gives_the_right_verdict_or_a_refusal(pytester: pytest.Pytester, tmp_path: Path) -> None:
    wheres = places()
    cells, seconds, pids = run_grid(pytester, wheres)
    out = Path(os.environ.get("MODELPATCH_GRID_OUT") or tmp_path)
    write_out(cells, seconds, out, pytester.path / "reports.jsonl")
    missing = [c for c in cells if c.outcome == "missing"]
    assert not missing, f"cells that never ran: {[(c.where, c.what, c.dtype, c.check) for c in missing]}"
    # one session, one pool of ranks: it starts again only after a rank crashed or hung
    crashes = sum(c.verdict == "crash" for c in cells)
    assert pids or wheres == ["one"], "no parallel cell said which ranks ran it"
    assert len(set(pids)) <= 1 + crashes, f"the parallel cells ran in {len(set(pids))} pools, after {crashes} crashes"
    wrong = [c for c in cells if not c.right]
    assert not wrong, f"{len(wrong)} of {len(cells)} cells wrong ({seconds:.0f} s):\n" + "\n".join(map(str, wrong))
    for doc, block in tables(cells).items():
        quoted = documented_rows(doc)
        for line in block.splitlines()[2:]:
            key = tuple(c.strip() for c in line.strip("|").split("|")[:3])
            assert quoted.get(key) == line, (
                f"docs/{doc}.md's grid row for {key} is stale:\n  docs: {quoted.get(key)}\n  run:  {line}\n"
                f"paste the table of a full run (MODELPATCH_GRID=all MODELPATCH_GRID_OUT=DIR, DIR/grid.md)"
            )
        if wheres == list(WHERE):
            assert documented(doc) == block, f"docs/{doc}.md's grid table is not the full run's (DIR/grid.md)"


def _report(nodeid: str, outcome: str = "failed", text: str = "", when: str = "call", skip: str = "") -> dict[str, Any]:
    return {"nodeid": f"test_grid.py::{nodeid}", "when": when, "outcome": outcome, "text": text, "skip": skip}


def test_a_cell_is_judged_by_its_report_not_by_its_outcome_alone() -> None:
    killed = "  rank 0 was killed by SIGSEGV during the test\n  rank 1 was killed by SIGSEGV during the test\n"
    report = "E       AssertionError: patched FSDPLlamaForCausalLM differs from reference LlamaForCausalLM"
    rows = [
        _report("test_stock_fsdp[float32-sequence]", text=f"parallel('fsdp'): {_CRASH}\n{killed}--- rank 0 ---\n"),
        _report("test_broken_fsdp[float32-backward]", text=report),
        _report("test_kernel_fsdp[float32-backward]", text=report),
        _report("test_broken_tp[float32-property]", text="E   AssertionError: check_equivalent(seed=0, max_examples=3"),
        _report("test_stock_tp[float32-trains]", text="E   RuntimeError: got mixed torch.Tensor and DTensor\nx.py:1"),
        _report("test_broken_tp[bfloat16-equivalent]", outcome="passed"),
        _report("test_stock_tp[bfloat16-decodes]", outcome="skipped", when="setup", skip="cannot do that sharded"),
    ]
    cells = {(c.where, c.what, c.dtype, c.check): c for c in collect_cells(rows, WHERE)}
    crash = cells["fsdp", "stock", "float32", "sequence"]
    assert (crash.verdict, crash.detail) == ("crash", "; ".join(line.strip() for line in killed.splitlines()))
    assert cells["fsdp", "broken", "float32", "backward"].verdict == "caught"
    assert cells["tp", "broken", "float32", "property"].verdict == "caught"
    assert cells["fsdp", "kernel", "float32", "backward"].verdict == "false alarm"
    error = cells["tp", "stock", "float32", "trains"]
    assert (error.verdict, error.detail) == ("error", "in call: RuntimeError: got mixed torch.Tensor and DTensor")
    assert cells["tp", "broken", "bfloat16", "equivalent"].verdict == "missed"
    assert cells["tp", "stock", "bfloat16", "decodes"].verdict == "refused"
    shown = table(list(cells.values()), CHECKS).splitlines()
    gap = "**missing** | " * 3  # the cells of the row these reports leave out
    assert f"| `tp` | stock model | bfloat16 | {gap}refused (1) | **missing** | **missing** |" in shown
    assert shown[-1] == "(1) cannot do that sharded"
    assert f"| `fsdp` | stock model | float32 | {gap}**missing** | **missing** | **crash** |" in shown
