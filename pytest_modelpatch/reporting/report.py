"""Check rows for CI: attached to each test's report, merged on the controller, written once as JSON.

During a test a record sink stamps every :class:`~pytest_modelpatch.reporting.records.CheckRecord`
with the test's node id and appends it to ``item.user_properties``; those travel on the
test report from xdist workers to the controller (and into JUnit XML as properties).
The controller's :class:`ReportSession` collects them, writes ``--modelpatch-report``,
prints the terminal table and runs the gate (:mod:`pytest_modelpatch.reporting.gate`).

Nothing here imports torch or transformers unless a report file is written.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.reporting.records import CheckRecord, set_record_sink

ROW_PROPERTY = "modelpatch_check"
# key figures as their own JUnit properties, so CI UIs show them without parsing the row
FIGURE_PROPERTIES = ("max_abs_error", "max_rel_error", "outcome")
REPORT_FORMAT = 1


# ---------------------------------------------------------------------------
# worker side: one sink per test
# ---------------------------------------------------------------------------


def _current_patches() -> tuple[list[str], list[str]]:
    """Keys and replacement classes registered with transformers now (empty if it is not imported)."""
    if "transformers.monkey_patching" not in sys.modules:
        return [], []
    mapping = dict(sys.modules["transformers.monkey_patching"].get_patch_mapping())
    return sorted(map(str, mapping)), sorted(f"{c.__module__}.{c.__qualname__}" for c in mapping.values())


def row_from_record(record: CheckRecord, nodeid: str, index: int) -> dict[str, Any]:
    """The JSON row of one record: node id stamped, patch keys filled in, ``check`` naming it in its test."""
    row = record.to_dict()
    row["nodeid"] = nodeid
    if not row["patch_keys"]:
        keys, classes = _current_patches()
        row["patch_keys"] = keys
        row["replacements"] = row["replacements"] or classes
    # equivalence rows may name the output that erred most; older records do not
    row.setdefault("output", getattr(record, "output", ""))
    row["check"] = f"{record.kind}#{index}"
    return row


@contextmanager
def attaching_checks(item: pytest.Item) -> Iterator[None]:
    """Attach every check recorded while this test runs (setup to teardown) to its ``user_properties``."""
    counts: dict[str, int] = {}

    def sink(record: CheckRecord) -> None:
        counts[record.kind] = counts.get(record.kind, 0) + 1
        row = row_from_record(record, item.nodeid, counts[record.kind])
        item.user_properties.append((ROW_PROPERTY, row))
        item.user_properties += [(f"modelpatch_{k}", row[k]) for k in FIGURE_PROPERTIES if row[k] is not None]

    previous = set_record_sink(sink)
    try:
        yield
    finally:
        set_record_sink(previous)


# ---------------------------------------------------------------------------
# seed: chosen on the controller, sent to workers in workerinput
# ---------------------------------------------------------------------------


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def session_seed(config: pytest.Config) -> int:
    """``--modelpatch-seed``, else ini ``modelpatch_seed``, else 0; on an xdist worker, the controller's."""
    if is_worker(config):
        return int(config.workerinput.get("modelpatch_seed", 0))  # type: ignore[attr-defined]
    value = config.getoption("modelpatch_seed")
    if value is not None:
        return int(value)
    text = str(config.getini("modelpatch_seed") or "0").strip()
    try:
        return int(text)
    except ValueError:
        raise PatchUsageError(f"ini modelpatch_seed = {text!r} is not an integer; use e.g. modelpatch_seed = 1234") from None


class XdistSeed:
    """xdist-only hooks (registered only when xdist is loaded): hand the seed to every worker."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["modelpatch_seed"] = self.seed


def configure(config: pytest.Config) -> None:
    """Set the session seed in this process; on the controller, register the report and xdist hooks."""
    seed = session_seed(config)
    from pytest_modelpatch.reporting import gate

    gate.validate_options(config)
    if seed:
        # properties imports torch and hypothesis: pay for it only when the seed is not the default 0
        from pytest_modelpatch.compare.property_checks import set_default_seed

        set_default_seed(seed)
    if is_worker(config):
        return
    config.pluginmanager.register(ReportSession(config, seed), "modelpatch-report")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistSeed(seed), "modelpatch-xdist-seed")


# ---------------------------------------------------------------------------
# controller side
# ---------------------------------------------------------------------------


def sort_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in a stable order: by node id, then kind, then their order within the test."""
    return sorted(rows, key=lambda r: (r["nodeid"], r["kind"], int(str(r.get("check", "#0")).rpartition("#")[2] or 0)))


def report_header(config: pytest.Config, seed: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything needed to reproduce the run: versions, devices, seed, command line, time."""
    versions = {}
    for dist in ("torch", "transformers", "hypothesis", "pytest", "pytest-xdist", "pytest-modelpatch", "safetensors"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "format": REPORT_FORMAT,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "devices": sorted({str(r["device"]) for r in rows if r.get("device")}),
        "accelerators": _accelerator_names(),
        "seed": seed,
        "command_line": ["pytest", *config.invocation_params.args],
        "workers": int(getattr(config.option, "numprocesses", 0) or 0),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _accelerator_names() -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def write_report(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, "rows": sort_rows(rows)}, indent=2) + "\n", encoding="utf-8")


def load_report(path: Path) -> dict[str, Any]:
    """A report (or baseline) file; a missing or malformed file is a usage error naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PatchUsageError(f"{path}: no such report; write one with pytest --modelpatch-report {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PatchUsageError(f"{path}: not a modelpatch JSON report ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise PatchUsageError(f"{path}: not a modelpatch JSON report (no 'rows' list); write one with --modelpatch-report")
    return data


def worst_first(row: dict[str, Any]) -> tuple[float, str, str]:
    """Sort key: largest max abs error first, then by node id and check."""
    return -(row.get("max_abs_error") or 0.0), row["nodeid"], row["check"]


def _figure(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def summary_lines(rows: list[dict[str, Any]], limit: int = 20) -> list[str]:
    """A compact table of checks, worst max abs error first."""
    ordered = sorted(rows, key=worst_first)
    table = [("outcome", "max abs", "max rel", "check", "model", "dtype@device", "test")]
    for r in ordered[:limit]:
        where = f"{r.get('dtype') or '-'}@{r.get('device') or '-'}"
        table.append((r["outcome"], _figure(r.get("max_abs_error")), _figure(r.get("max_rel_error")),
                      r["check"], r.get("model") or "-", where, r["nodeid"]))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in table]
    if len(ordered) > limit:
        lines.append(f"... and {len(ordered) - limit} more (see --modelpatch-report)")
    return lines


class ReportSession:
    """Controller-side hooks: collect rows from test reports, write the report, print the table, gate."""

    def __init__(self, config: pytest.Config, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.rows: list[dict[str, Any]] = []
        self.verdict: Any = None

    def pytest_report_header(self, config: pytest.Config) -> str:
        return f"modelpatch: seed {self.seed} (--modelpatch-seed)"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # the teardown report carries every property the test gathered (setup, call, teardown)
        if report.when == "teardown":
            self.rows += [value for name, value in report.user_properties if name == ROW_PROPERTY]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from pytest_modelpatch.reporting import gate

        config = self.config
        header = None
        if config.getoption("modelpatch_report") or config.getoption("modelpatch_update_baseline"):
            header = report_header(config, self.seed, self.rows)
        if config.getoption("modelpatch_report"):
            write_report(Path(config.getoption("modelpatch_report")), header or {}, self.rows)
        self.verdict = gate.session_verdict(config, self.rows, header)
        if self.verdict is not None and not self.verdict.passed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        html = config.getoption("modelpatch_html")
        if html:
            from pytest_modelpatch.reporting.profile_html import write_profile_html

            write_profile_html(Path(html), self.rows)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.rows:
            terminalreporter.write_sep("-", f"modelpatch: {len(self.rows)} check{'s' * (len(self.rows) != 1)}, worst first")
            for line in summary_lines(self.rows):
                terminalreporter.write_line(line)
        if self.verdict is not None:
            terminalreporter.write_sep("-", "modelpatch gate")
            for line in str(self.verdict).splitlines():
                terminalreporter.write_line(line, red=not self.verdict.passed, green=self.verdict.passed)
