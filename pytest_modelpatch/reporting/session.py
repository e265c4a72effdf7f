"""The pytest side of reporting: rows on test reports, merged on the controller, the report, the gate.

During a test a record sink stamps every :class:`~pytest_modelpatch.reporting.records.CheckRecord`
with the test's node id and appends it to ``item.user_properties``; those travel on the
test report from xdist workers to the controller (and into JUnit XML as properties).
The controller's :class:`ReportSession` collects them, writes ``--modelpatch-report``,
prints the terminal table and runs the gate (:mod:`pytest_modelpatch.reporting.gate`).
``plugin.py`` registers these hooks; nothing here imports torch or transformers unless
a report file is written or a baseline read (the header names the GPUs), or a check ran on CUDA.
"""

from __future__ import annotations

import datetime
import functools
import math
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from pytest_modelpatch.errors import PatchUsageError, ReportFileError
from pytest_modelpatch.reporting.gate import (
    DEFAULT_FACTOR,
    DEFAULT_FLOOR,
    GateVerdict,
    Thresholds,
    evaluate,
    load_baseline,
)
from pytest_modelpatch.reporting.records import CheckRecord
from pytest_modelpatch.reporting.report import (
    REPORT_FORMAT,
    class_of,
    device_class,
    device_order,
    load_report,
    report_data,
    row_from_record,
    summary_lines,
    sweep_lines,
    write_report,
)
from pytest_modelpatch.reporting.schema import FAILING_OUTCOMES
from pytest_modelpatch.reporting.selection import SelectionRecorder, XdistSelection
from pytest_modelpatch.reporting.shards import Run, merge_reports, rewrite_baseline
from pytest_modelpatch.settings import implementations_of

ROW_PROPERTY = "modelpatch_check"
# key figures as their own JUnit properties, so CI UIs show them without parsing the row
FIGURE_PROPERTIES = ("max_abs_error", "max_rel_error", "outcome")
SWEEP_PROPERTY = "modelpatch_family"  # on each report of a test a family sweep made: its model type
_LOCATED = r"(?:replaced module whose own output differs[^:\n]*|first diverging module): [^\n]*"
# on the skip of a swept test whose family transformers refuses what it asks: transformers' reason
NOT_APPLICABLE_PROPERTY = "modelpatch_not_applicable"
# side ("reference"/"patched") -> axis ("attention"/"experts") -> the implementation the fixture's model loaded with
IMPLEMENTATIONS = pytest.StashKey[dict[str, dict[str, str]]]()


# ---------------------------------------------------------------------------
# worker side: one sink per test
# ---------------------------------------------------------------------------


class CheckSink:
    """Receives every check recorded while one test runs (setup to teardown): rows on its ``user_properties``.

    Installed with :func:`~pytest_modelpatch.reporting.records.set_record_sink` around each test.
    """

    __slots__ = ("counts", "item")

    def __init__(self, item: pytest.Item) -> None:
        self.item = item
        self.counts: dict[str, int] = {}

    def __call__(self, record: CheckRecord) -> None:
        counts = self.counts
        counts[record.kind] = counts.get(record.kind, 0) + 1
        # the GPU's name is asked of torch only for a check that ran on CUDA (torch is loaded then)
        names = gpu_names() if str(record.device).startswith("cuda") else ()
        row = row_from_record(record, self.item.nodeid, counts[record.kind], names)
        implementations = self.item.stash.get(IMPLEMENTATIONS, None)
        if implementations:
            row["implementations"] = {side: dict(axes) for side, axes in implementations.items()}
        self.item.user_properties.append((ROW_PROPERTY, row))
        self.item.user_properties += [(f"modelpatch_{k}", row[k]) for k in FIGURE_PROPERTIES if row[k] is not None]


def note_implementations(item: pytest.Item, side: str, model: Any) -> None:
    """Keep the attention and experts implementations ``model`` loaded with, for the test's report rows."""
    if axes := implementations_of(model):
        item.stash.setdefault(IMPLEMENTATIONS, {})[side] = axes


CAUGHT = "caught: the check raised AssertionError and the test caught it and passed (e.g. pytest.raises)"


def stamp_intent(item: pytest.Item, report: pytest.TestReport) -> None:
    """Mark the test's rows as expected failures when its report says the test meant them to fail.

    Runs on the worker, on the final report of each phase (after pytest's xfail handling), so the
    rows carry the intent to the controller. An ``xfail`` test that xfailed or xpassed marks every
    row; a passing test marks its failed rows, because every check raises AssertionError right
    after recording a failure: the test went on only because it caught that error.
    """
    rows = _property_values(item.user_properties, ROW_PROPERTY)
    if hasattr(report, "wasxfail"):
        reason = f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
        marked = [r for r in rows if not r.get("expected_failure")]
    elif report.when == "call" and report.passed:
        reason = CAUGHT
        marked = [r for r in rows if r["outcome"] == "failed" and not r.get("expected_failure")]
    else:
        return
    for row in marked:
        row["expected_failure"], row["intent"] = True, reason


# ---------------------------------------------------------------------------
# seed and timing: the seed chosen on the controller, sent to workers in workerinput
# ---------------------------------------------------------------------------


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _property_values(properties: list[tuple[str, object]], name: str) -> list[Any]:
    """The values of the user properties called ``name``: this plugin wrote them, so their type is known."""
    return [value for key, value in properties if key == name]


def session_seed(config: pytest.Config) -> int:
    """``--modelpatch-seed``, else ini ``modelpatch_seed``, else 0; on an xdist worker, the controller's."""
    if is_worker(config):
        # xdist sets workerinput on a worker's config; pytest's Config declares no such attribute
        return int(config.workerinput.get("modelpatch_seed", 0))  # type: ignore[attr-defined]
    value = config.getoption("modelpatch_seed")
    if value is not None:
        return int(value)
    text = str(config.getini("modelpatch_seed") or "0").strip()
    try:
        return int(text)
    except ValueError:
        raise PatchUsageError(
            f"ini modelpatch_seed = {text!r} is not an integer; use e.g. modelpatch_seed = 1234"
        ) from None


class XdistSeed:
    """xdist-only hooks (registered only when xdist is loaded): hand the seed to every worker."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["modelpatch_seed"] = self.seed


def configure(config: pytest.Config, default_device: str = "cpu") -> None:
    """Validate the report options; on the controller, register the report and xdist hooks.

    Each xdist worker runs this too. The session seed and timing are ``settings.SETTINGS``, which
    ``plugin.py`` sets. ``default_device``: the session's ``--modelpatch-device`` (validated by the
    plugin), for the report header.
    """
    seed = session_seed(config)
    validate_options(config)
    recorder = SelectionRecorder(config)
    config.pluginmanager.register(recorder, "modelpatch-selection")
    if is_worker(config):
        return
    config.pluginmanager.register(ReportSession(config, seed, default_device, recorder), "modelpatch-report")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistSeed(seed), "modelpatch-xdist-seed")
        config.pluginmanager.register(XdistSelection(recorder), "modelpatch-xdist-selection")


# ---------------------------------------------------------------------------
# controller side
# ---------------------------------------------------------------------------


def report_header(
    config: pytest.Config, seed: int, rows: list[dict[str, Any]], default_device: str = "cpu"
) -> dict[str, Any]:
    """Everything needed to reproduce the run: versions, devices and their names, seed, command line, time."""
    versions: dict[str, str | None] = {}
    for dist in ("torch", "transformers", "hypothesis", "pytest", "pytest-xdist", "pytest-modelpatch", "safetensors"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    accelerators = list(gpu_names())
    resolved = ("cuda" if accelerators else "cpu") if default_device == "auto" else default_device
    default_class = device_class(resolved, accelerators)
    return {
        "format": REPORT_FORMAT,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "devices": sorted({str(r["device"]) for r in rows if r.get("device")}),
        "accelerators": accelerators,
        # the device tests run on unless marked otherwise, by its class: what this report's job is for
        "default_device": default_device,
        "default_device_class": default_class,
        "device_classes": device_order([default_class, *(class_of(r) for r in rows)]),
        "seed": seed,
        "command_line": ["pytest", *config.invocation_params.args],
        "workers": int(getattr(config.option, "numprocesses", 0) or 0),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@functools.cache
def gpu_names() -> tuple[str, ...]:
    """This machine's CUDA GPUs by index, named as torch names them (``NVIDIA H100 80GB HBM3``); empty without CUDA."""
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def _ini_float(config: pytest.Config, name: str, default: float | None, below: float = math.inf) -> float | None:
    """A gate limit from the ini file: finite, 0 or more and under ``below`` (an ``inf`` floor would pass any growth)."""
    text = str(config.getini(name) or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value < below):
        expected = "a fraction in [0, 1)" if below == 1 else "a finite, non-negative number"
        raise PatchUsageError(
            f"ini {name} = {text!r}: expected {expected}, e.g. {name} = {'0.2' if below == 1 else '1e-4'}"
        )
    return value


def thresholds_from_ini(config: pytest.Config) -> Thresholds:
    """``modelpatch_max_abs_error``, ``modelpatch_max_rel_error``, ``modelpatch_baseline_factor/_floor``."""
    return Thresholds(
        max_abs_error=_ini_float(config, "modelpatch_max_abs_error", None),
        max_rel_error=_ini_float(config, "modelpatch_max_rel_error", None),
        factor=_ini_float(config, "modelpatch_baseline_factor", DEFAULT_FACTOR) or DEFAULT_FACTOR,
        floor=_ini_float(config, "modelpatch_baseline_floor", DEFAULT_FLOOR) or 0.0,
        min_speedup=_ini_float(config, "modelpatch_min_speedup", None),
        max_speedup_drop=_ini_float(config, "modelpatch_max_speedup_drop", None, below=1),
    )


def validate_options(config: pytest.Config) -> None:
    """Fail at startup, not after the run, on a bad ini value or option combination, or a malformed baseline."""
    thresholds = thresholds_from_ini(config)
    path = config.getoption("modelpatch_baseline")
    if config.getoption("modelpatch_update_baseline") and not path:
        raise PatchUsageError("--modelpatch-update-baseline needs --modelpatch-baseline PATH: the file to rewrite")
    if path and not is_worker(config):
        try:  # the baseline to rewrite may not exist yet; the one to compare with must, and must be readable
            if not config.getoption("modelpatch_update_baseline"):
                load_baseline(Path(path), thresholds)
            elif Path(path).exists():
                load_report(Path(path))
        except ReportFileError as exc:
            raise PatchUsageError(str(exc)) from None


def gate_requested(config: pytest.Config) -> bool:
    return bool(
        config.getoption("modelpatch_baseline")
        or config.getini("modelpatch_max_abs_error")
        or config.getini("modelpatch_max_rel_error")
        or config.getini("modelpatch_min_speedup")
    )


def session_verdict(config: pytest.Config, run: Run, header: dict[str, Any] | None) -> GateVerdict | None:
    """The gate for this session (``None`` when no threshold or baseline is set); rewrites the baseline if asked.

    ``run``: this session's rows and what it set out to check (its selection and device classes),
    so a shard is judged on its share and a rewrite replaces only the rows of what it ran.
    """
    path = config.getoption("modelpatch_baseline")
    try:
        if config.getoption("modelpatch_update_baseline"):
            note = rewrite_baseline(Path(path), run, header or {})
            verdict = evaluate(run.rows, thresholds_from_ini(config), run=run)
            verdict.notes.append(note)
            return verdict
        if not gate_requested(config):
            return None
        baseline = load_baseline(Path(path), thresholds_from_ini(config)) if path else None
    except ReportFileError as exc:
        raise PatchUsageError(str(exc)) from None
    return evaluate(run.rows, thresholds_from_ini(config), baseline, str(path or ""), run)


def phase_outcome(report: pytest.TestReport) -> str | None:
    """What one phase's report says of its test (``TEST_OUTCOMES``); ``None`` for a setup or teardown that passed."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    if report.skipped:
        return "skipped"
    return "passed" if report.when == "call" else None


def tally_outcome(tests: dict[str, dict[str, str]], report: pytest.TestReport) -> None:
    """Fold one phase into its test's entry: the first failure or error stands, else the latest outcome."""
    outcome = phase_outcome(report)
    if outcome is None:  # a test whose call never reported (a crash, an interrupt) has no outcome: the gate sees it
        return
    entry = tests.get(report.nodeid)
    if entry is not None and entry["outcome"] in FAILING_OUTCOMES:
        return
    tests[report.nodeid] = {"outcome": outcome, "when": report.when}
    if outcome in FAILING_OUTCOMES:
        tests[report.nodeid]["detail"] = failure_line(report)


def failure_line(report: pytest.TestReport) -> str:
    """The one line that says why a test failed: pytest's crash message, else the report's last line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(getattr(crash, "message", "") or "") or report.longreprtext.strip().rpartition("\n")[2]
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 300 else line[:297] + "..."


class ReportSession:
    """Controller-side hooks: collect rows from test reports, write the report, print the table, gate."""

    def __init__(self, config: pytest.Config, seed: int, default_device: str, recorder: SelectionRecorder) -> None:
        self.config = config
        self.seed = seed
        self.default_device = default_device
        self.recorder = recorder
        self.rows: list[dict[str, Any]] = []
        self.verdict: Any = None
        # swept test -> family -> (outcome, the first diverging module of a failure or the refusal of a family not applicable)
        self.sweeps: dict[str, dict[str, tuple[str, str]]] = {}
        self.tests: dict[str, dict[str, str]] = {}  # node id -> its outcome, the phase it ended in, why it did not pass

    def pytest_report_header(self, config: pytest.Config) -> str:
        return f"modelpatch: seed {self.seed} (--modelpatch-seed)"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # the teardown report carries every property the test gathered (setup, call, teardown)
        if report.when == "teardown":
            self.rows += _property_values(report.user_properties, ROW_PROPERTY)
        tally_outcome(self.tests, report)
        family = next(iter(_property_values(report.user_properties, SWEEP_PROPERTY)), None)
        if family is not None:
            self._tally_sweep(report, family)

    def _tally_sweep(self, report: pytest.TestReport, family: str) -> None:
        test = report.nodeid.rpartition("[")[0] or report.nodeid
        families = self.sweeps.setdefault(test, {})
        refused = next(iter(_property_values(report.user_properties, NOT_APPLICABLE_PROPERTY)), None)
        if report.skipped and refused is not None:
            families[family] = ("not applicable", refused)
            return
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.failed or report.skipped:
            outcome = report.outcome
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        if families.get(family, ("passed", ""))[0] in ("passed", "xpassed") or outcome == "failed":
            # the blamed replacement when the check found one (it comes first), else the first diverging module
            found = re.search(_LOCATED, report.longreprtext) if outcome == "failed" else None
            families[family] = (outcome, found.group(0) if found else "")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = self.config
        header = None
        report = config.getoption("modelpatch_report")
        if report or config.getoption("modelpatch_baseline"):
            header = report_header(config, self.seed, self.rows, self.default_device)
        selection = self.recorder.selection()
        data = report_data(header or {}, self.rows, self.sweeps, selection, self.tests)
        if report:
            write_report(Path(report), header or {}, self.rows, self.sweeps, selection, self.tests)
        run = merge_reports([("this run", data)])
        self.verdict = session_verdict(config, run, header)
        if self.verdict is not None and not self.verdict.passed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        html = config.getoption("modelpatch_html")
        if html:
            from pytest_modelpatch.reporting.profile_html import write_profile_html

            write_profile_html(Path(html), self.rows)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.rows:
            expected = sum(bool(r.get("expected_failure")) for r in self.rows)
            meant = f" ({expected} in tests meant to fail)" if expected else ""
            title = f"modelpatch: {len(self.rows)} check{'s' * (len(self.rows) != 1)}{meant}, worst first"
            terminalreporter.write_sep("-", title)
            for line in summary_lines(self.rows):
                terminalreporter.write_line(line)
        if self.sweeps:
            terminalreporter.write_sep("-", "modelpatch sweeps: each swept test by family")
            for line in sweep_lines(self.sweeps):
                terminalreporter.write_line(line)
        if self.verdict is not None:
            terminalreporter.write_sep("-", "modelpatch gate")
            for line in str(self.verdict).splitlines():
                terminalreporter.write_line(line, red=not self.verdict.passed, green=self.verdict.passed)
