"""Reports from shards and jobs judged as one run: what each set out to check, and where they disagree.

A CI matrix splits one suite across jobs (pytest-split, ``-k``) and device types. Each report
records its selection (the paths it was given, the tests it ran, those it deselected) and its
device classes, so a baseline check is expected only from a report that selected its test and
ran on its device: a shard is judged on its share, a CPU job on the baseline's ``cpu`` rows, and
a check missing from every report is missing. The same check from the same device in two
reports is refused, naming both files; from two devices it is a matrix.

Pure data work, like ``report.py`` and ``gate.py``: ``modelpatch gate`` merges reports without
pytest or torch.

Example::

    run = merge_reports([(name, load_report(name)) for name in ("shard-1.json", "shard-2.json")])
    run.expects(("tests/test_attn.py::test_fused", "equivalence#1", "cpu"))  # True when either shard selected it
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_modelpatch.errors import ReportMergeError
from pytest_modelpatch.reporting.report import class_of, device_order, load_report, write_report
from pytest_modelpatch.reporting.schema import FAILING_OUTCOMES

CheckKey = tuple[str, str, str]  # node id, check ("equivalence#1"), device class


def check_key(row: Mapping[str, Any]) -> CheckKey:
    """How a baseline matches a row: its test, its check within the test, and the device class it ran on."""
    return str(row["nodeid"]), str(row["check"]), class_of(row)


def covers(path: str, nodeid: str) -> bool:
    """Whether the collection argument ``path`` (a node-id prefix, ``""`` for the rootdir) takes in ``nodeid``."""
    return not path or nodeid == path or nodeid.startswith((f"{path}/", f"{path}::", f"{path}["))


@dataclass(frozen=True)
class ReportScope:
    """What one report set out to check: which tests, on which devices (a baseline row outside it is not expected)."""

    name: str
    device: str  # the class of the device its session ran tests on by default (--modelpatch-device)
    device_classes: frozenset[str]  # that one and every class its rows ran on
    paths: tuple[str, ...] | None  # its collection arguments as node-id prefixes; None: every test
    selected: frozenset[str] = frozenset()
    deselected: frozenset[str] = frozenset()
    # (test, check) and (test, "") -> the device classes that check, and any check of that test, ran on
    ran_on: Mapping[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    versions: Mapping[str, Any] = field(default_factory=dict)  # package -> version, and "python"
    checks: int = 0  # its rows
    tests_ran: int | None = None  # its tests that ran (any outcome but skipped); None: it records none (before 4)

    def selects(self, nodeid: str) -> bool:
        """The test was this report's to run: selected, or under its paths and not deselected (-k, -m, pytest-split)."""
        if nodeid in self.selected:
            return True
        if nodeid in self.deselected:
            return False
        return self.paths is None or any(covers(path, nodeid) for path in self.paths)

    def expects(self, key: CheckKey) -> bool:
        """Whether the baseline row of this check (test, check, device class) should be in this report.

        A check that ran here on other devices moved with the job's device (a GPU job runs on the
        GPU what a CPU job runs on the CPU, a test's round-trip check on the CPU in both); a check
        that did not run here is expected where its test ran checks, or, for a test that ran none
        at all, on every device of the report.
        """
        nodeid, check, device_class = key
        if device_class not in self.device_classes or not self.selects(nodeid):
            return False
        ran = self.ran_on.get((nodeid, check)) or self.ran_on.get((nodeid, ""))
        return not ran or device_class in ran


def report_scope(name: str, data: Mapping[str, Any]) -> ReportScope:
    """What the report ``data`` (as ``load_report`` reads it) set out to check.

    A report without a selection (written before version 3, or by hand) selected every test; one
    without ``default_device_class`` ran by default on the class most of its rows ran on, or the CPU.
    """
    header = data.get("header") or {}
    rows = data["rows"]
    classes = Counter(class_of(row) for row in rows)
    device = str(header.get("default_device_class") or (classes.most_common(1)[0][0] if classes else "cpu"))
    ran_on: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        nodeid, check, device_class = check_key(row)
        ran_on.setdefault((nodeid, ""), set()).add(device_class)
        ran_on.setdefault((nodeid, check), set()).add(device_class)
    selection = data.get("selection")
    versions = {**(header.get("versions") or {}), **({"python": header["python"]} if header.get("python") else {})}
    tests = data.get("tests")
    ran = None if tests is None else sum(entry.get("outcome") != "skipped" for entry in tests.values())
    return ReportScope(
        name, device, frozenset({device, *classes, *header.get("device_classes", ())}),
        paths=None if selection is None else tuple(selection.get("paths", [""])),
        selected=frozenset(selection.get("selected", ())) if selection else frozenset(),
        deselected=frozenset(selection.get("deselected", ())) if selection else frozenset(),
        ran_on={test: frozenset(found) for test, found in ran_on.items()}, versions=versions,
        checks=len(rows), tests_ran=ran,
    )  # fmt: skip


@dataclass
class Run:
    """The rows of one or more reports judged as one, with what each report set out to check."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    scopes: list[ReportScope] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # per row: the device class of the report it came from
    notes: list[str] = field(default_factory=list)  # versions that differ between reports of different devices
    warnings: list[str] = field(default_factory=list)  # versions that differ between reports of one device
    # node id -> its outcome entry (outcome, when, detail) and the report it came from; a failure wins over a pass
    tests: dict[str, dict[str, str]] = field(default_factory=dict)
    unfinished: list[tuple[str, str]] = field(default_factory=list)  # (report, node id): selected, with no outcome
    sweeps: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (swept test, family, its entry)

    @property
    def device_classes(self) -> set[str]:
        """Every device class a report of this run ran on."""
        return {device for scope in self.scopes for device in scope.device_classes}

    def expects(self, key: CheckKey) -> bool:
        """Whether some report of this run was to give the baseline row of this check (see ``ReportScope.expects``)."""
        return any(scope.expects(key) for scope in self.scopes)

    def not_expected(self, key: CheckKey) -> str:
        """Why no report of this run was to give the baseline row of this check ("" when one was)."""
        if self.expects(key):
            return ""
        on_device = [scope for scope in self.scopes if key[2] in scope.device_classes]
        if not on_device:
            return "on devices it did not run on"
        if not any(scope.selects(key[0]) for scope in on_device):
            return "of tests it did not select"
        return "that ran on other devices"

    def baseline_rows(self) -> list[dict[str, Any]]:
        """Each check once, as a baseline holds it.

        Two jobs of a matrix may run one check on one device class (a GPU job runs the tests marked
        ``cpu`` too): the row of the job whose device that is wins, else the first.
        """
        chosen: dict[CheckKey, tuple[dict[str, Any], bool]] = {}
        for row, origin in zip(self.rows, self.origins):
            key = check_key(row)
            own = origin == key[2]
            if key not in chosen or (own and not chosen[key][1]):
                chosen[key] = (row, own)
        return [row for row, _ in chosen.values()]


def merge_reports(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> Run:
    """One run from the reports of shards and jobs, each given as ``(file name, data as load_report reads it)``.

    Raises :class:`~pytest_modelpatch.errors.ReportMergeError` when a file is given twice, or two
    reports from the same device hold the same check (overlapping shards), naming both files.
    """
    run = Run()
    first: dict[tuple[CheckKey, str], str] = {}
    given: set[str] = set()
    for name, data in reports:
        if name and name in given:
            raise ReportMergeError(f"{name} is given twice: each report counts once")
        given.add(name)
        scope = report_scope(name, data)
        run.scopes.append(scope)
        for row in data["rows"]:
            key = check_key(row)
            earlier = first.setdefault((key, scope.device), name)
            if earlier != name:
                raise ReportMergeError(_overlap(key, scope.device, earlier, name))
            run.rows.append(row)
            run.origins.append(scope.device)
        _merge_outcomes(run, name, data)
    run.notes, run.warnings = compare_versions(run.scopes)
    return run


def _merge_outcomes(run: Run, name: str, data: Mapping[str, Any]) -> None:
    """The report's test outcomes and sweep entries into ``run``; its selected tests with no outcome as unfinished.

    A report before version 4 has no outcomes: nothing is said of its tests beyond their rows.
    """
    for test, families in sorted((data.get("sweeps") or {}).items()):
        run.sweeps += [(test, family, dict(entry)) for family, entry in sorted(families.items())]
    tests = data.get("tests")
    if tests is None:
        return
    for nodeid, entry in tests.items():
        known = run.tests.get(nodeid)
        if known is None or (entry.get("outcome") in FAILING_OUTCOMES and known["outcome"] not in FAILING_OUTCOMES):
            run.tests[nodeid] = {**entry, "report": name}
    selection = data.get("selection") or {}
    run.unfinished += [(name, nodeid) for nodeid in selection.get("selected", ()) if nodeid not in tests]


def _overlap(key: CheckKey, device: str, earlier: str, later: str) -> str:
    nodeid, check, device_class = key
    return (
        f"{nodeid} {check} on {device_class} is in both {earlier} and {later}, two reports from {device}: shards of "
        "one job must select disjoint tests (pytest-split --splits N --group K, or complementary -k expressions); "
        "for a rerun, gate the new report without the old one"
    )


def compare_versions(scopes: Sequence[ReportScope]) -> tuple[list[str], list[str]]:
    """Notes on versions that differ between reports, and warnings where reports of one device differ.

    Reports of different devices often differ (a CUDA build of torch beside a CPU one): shown, not
    warned. Two shards of one device that differ were not one run, so their figures may differ by
    version, not by patch.
    """
    notes: list[str] = []
    warnings: list[str] = []
    differing = _differing(scopes)
    if differing:
        notes.append("versions differ between reports: " + "; ".join(differing))
    for device in sorted({scope.device for scope in scopes}):
        same_device = [scope for scope in scopes if scope.device == device]
        differing = _differing(same_device)
        if differing:
            names = ", ".join(scope.name for scope in same_device)
            warnings.append(
                f"reports {names} ran on {device} with different versions: {'; '.join(differing)}; "
                "their figures may differ by version, not by patch: run every shard of one device on the same versions"
            )
    return notes, warnings


def _differing(scopes: Sequence[ReportScope]) -> list[str]:
    """``torch 2.13.0 (a.json), 2.12.0 (b.json)`` for each package whose version differs between ``scopes``."""
    if len(scopes) < 2:
        return []
    out = []
    for package in sorted({package for scope in scopes for package in scope.versions}):
        by_value: dict[str, list[str]] = {}
        for scope in scopes:
            by_value.setdefault(str(scope.versions.get(package) or "none"), []).append(scope.name)
        if len(by_value) > 1:
            out.append(f"{package} " + ", ".join(f"{value} ({', '.join(names)})" for value, names in by_value.items()))
    return out


def updated_baseline(
    baseline: Sequence[Mapping[str, Any]], run: Run
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of a baseline that ``run`` updated, and those it kept.

    The run's checks replace the baseline's rows of the tests it selected on the devices it ran
    on; the rows of other devices and of tests it did not select are kept as they were.
    """
    fresh = run.baseline_rows()
    replaced = {check_key(row) for row in fresh}
    kept = [dict(row) for row in baseline if check_key(row) not in replaced and not run.expects(check_key(row))]
    return fresh + kept, kept


def rewrite_baseline(path: Path, run: Run, header: Mapping[str, Any]) -> str:
    """Write ``run``'s checks into the baseline at ``path``, keeping the rows it did not cover; returns a note saying so.

    The baseline is created when there is none. ``header``: the run's (its versions and machine).
    """
    earlier = load_report(path)["rows"] if Path(path).exists() else []
    rows, kept = updated_baseline(earlier, run)
    write_report(Path(path), {**header, "device_classes": device_order(class_of(row) for row in rows)}, rows)
    note = f"baseline {path} rewritten with {len(rows) - len(kept)} checks"
    if kept:
        by_device = Counter(class_of(row) for row in kept)
        listed = ", ".join(f"{by_device[device]} on {device}" for device in device_order(by_device))
        note += f"; kept {len(kept)} of devices or tests this run did not cover ({listed})"
    return note
