"""The CI gate: judge a run's check rows against thresholds and a baseline report.

A check is named by its test's node id and ``kind#n`` (the n-th check of that kind in
the test), and compared with the baseline's row of the same device class (the GPU's name, or
``cpu``). The gate fails when a check failed (unless the test meant it to: an
``expected_failure`` row, from an xfail test or a caught AssertionError, is only noted), when its max error passes an ini
threshold, when its max abs error grew beyond ``factor`` times the baseline's (and by
more than ``floor``, so 0 -> 1e-9 noise passes), or when a baseline check the run was expected to
run did not (one of a test it selected, on a device it ran on: ``reporting.shards``). A device
with no rows in the baseline is new: its checks face the thresholds, not another device's figures.
Tests are judged too, from the reports' outcomes: one that failed or errored outside xfail fails
the gate whether or not it wrote a row, as do a failed sweep entry and a selected test with no outcome.

Example::

    verdict = evaluate(rows, Thresholds(max_abs_error=1e-3), baseline=load_report(path)["rows"])
    print(verdict.markdown())
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_modelpatch.errors import ReportFileError
from pytest_modelpatch.reporting.records import shown_outcome
from pytest_modelpatch.reporting.report import (
    class_of,
    device_order,
    figure,
    load_report,
    speedup,
    speedup_cell,
    worst_first,
)
from pytest_modelpatch.reporting.schema import FAILING_OUTCOMES, TEST_OUTCOMES, is_number
from pytest_modelpatch.reporting.shards import Run, check_key, merge_reports

DEFAULT_FACTOR = 2.0
DEFAULT_FLOOR = 1e-6


@dataclass(frozen=True)
class Thresholds:
    """Limits from the ini file: absolute ceilings and how much growth over the baseline is allowed."""

    max_abs_error: float | None = None
    max_rel_error: float | None = None
    factor: float = DEFAULT_FACTOR
    floor: float = DEFAULT_FLOOR
    min_speedup: float | None = None  # timed checks (--modelpatch-timing) must be at least this fast
    max_speedup_drop: float | None = None  # opt-in: a timed check's speedup may fall this fraction below the baseline's

    def __post_init__(self) -> None:
        # an infinite floor or factor lets any growth pass, a NaN ceiling fails everything: neither is a limit
        for name, value in vars(self).items():
            if value is not None and not (is_number(value) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Thresholds({name}={value!r}): expected a finite number, 0 or more")
        if self.max_speedup_drop is not None and not self.max_speedup_drop < 1:
            raise ValueError(f"Thresholds(max_speedup_drop={self.max_speedup_drop!r}): expected a fraction below 1")

    def allowed_growth(self, baseline: float) -> float:
        """The largest max abs error accepted for a check whose baseline figure is ``baseline``."""
        return max(baseline * self.factor, baseline + self.floor)


def check_name(row: dict[str, Any], device: bool = False) -> str:
    """``tests/test_x.py::test_attn equivalence#1 (LlamaForCausalLM, logits)``: how messages name a check.

    ``device``: add `` on NVIDIA H100 80GB HBM3`` (its device class), for a verdict over several devices.
    """
    extra = ", ".join(str(v) for v in (row.get("model"), row.get("output")) if v)
    where = f" on {class_of(row)}" if device else ""
    return f"{row['nodeid']} {row['check']}" + (f" ({extra})" if extra else "") + where


@dataclass
class GateVerdict:
    """What the gate found: failures (each names the check and both numbers), warnings and notes."""

    checks: int
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    baseline: str = ""
    warnings: list[str] = field(default_factory=list)  # not failures: e.g. shards of one device on different versions
    reports: int = 1  # how many reports were judged as one run
    new_devices: list[str] = field(
        default_factory=list
    )  # device classes the baseline has no rows for: not judged against it
    device_failures: Counter[str] = field(default_factory=Counter)  # failures per device class

    @property
    def passed(self) -> bool:
        return not self.failures

    def fail(self, message: str, row: dict[str, Any] | None = None) -> None:
        """Record a failure, counted against ``row``'s device class when it is about one check."""
        self.failures.append(message)
        if row is not None:
            self.device_failures[class_of(row)] += 1

    def _what(self) -> str:
        sources = f" from {self.reports} reports" if self.reports > 1 else ""
        return f"{self.checks} checks{sources}"

    def __str__(self) -> str:
        against = f" against baseline {self.baseline}" if self.baseline else ""
        head = f"modelpatch gate {'PASSED' if self.passed else 'FAILED'}: {self._what()}{against}, "
        head += f"{len(self.failures)} failures"
        return "\n".join([head, *(f"FAIL {f}" for f in self.failures), *(f"WARNING {w}" for w in self.warnings),
                          *(f"note {n}" for n in self.notes)])  # fmt: skip

    def markdown(self, rows: list[dict[str, Any]] | None = None, limit: int = 30) -> str:
        """A summary for ``$GITHUB_STEP_SUMMARY``: verdict, failures, then a section per device with its worst checks."""
        mark = ":white_check_mark:" if self.passed else ":x:"
        against = f" against `{self.baseline}`" if self.baseline else ""
        lines = [f"### {mark} modelpatch gate {'passed' if self.passed else 'failed'}", "",
                 f"{self._what()}{against}, {len(self.failures)} failures."]  # fmt: skip
        items = [f"- :x: {_md(f)}" for f in self.failures] + [f"- :warning: {_md(w)}" for w in self.warnings]
        items += [f"- {_md(n)}" for n in self.notes]
        lines += ["", *items] if items else []
        for device in device_order(class_of(r) for r in rows or []):
            mine = [r for r in rows or [] if class_of(r) == device]
            new = ", new device: not judged against the baseline" if device in self.new_devices else ""
            lines += ["", f"#### {_md(device)}: {len(mine)} checks, {self.device_failures[device]} failures{new}", ""]
            lines += table_lines(mine, limit)
        return "\n".join(lines) + "\n"


def table_lines(rows: list[dict[str, Any]], limit: int) -> list[str]:
    """The markdown table of ``rows``, worst first, at most ``limit`` of them; a ``speedup`` column when any was timed."""
    timed = any(speedup(r) is not None for r in rows)
    head, rule = ("| speedup ", "---|") if timed else ("", "")
    lines = [
        f"| outcome | max abs | max rel {head}| check | model | dtype@device | test |",
        f"|---|---|---|{rule}---|---|---|---|",
    ]
    for r in sorted(rows, key=worst_first)[:limit]:
        cell = f" {speedup_cell(r)} |" if timed else ""
        lines.append(
            f"| {outcome(r)} | {figure(r.get('max_abs_error'))} | {figure(r.get('max_rel_error'))} |{cell} {r['check']} "
            f"| {_md(r.get('model') or '-')} | {r.get('dtype') or '-'}@{r.get('device') or '-'} | `{r['nodeid']}` |"
        )
    if len(rows) > limit:
        lines.append(f"\n{len(rows) - limit} more checks in the JSON report.")
    return lines


def outcome(row: dict[str, Any]) -> str:
    """``passed``, ``failed``, or ``xfailed``/``xpassed`` for a check its test meant to fail."""
    return shown_outcome(row["outcome"], bool(row.get("expected_failure")))


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _judge_speed(
    rows: list[dict[str, Any]],
    thresholds: Thresholds,
    baseline: list[dict[str, Any]] | None,
    verdict: GateVerdict,
    name: Callable[[dict[str, Any]], str],
) -> None:
    """``min_speedup`` on every timed check; ``max_speedup_drop`` against the baseline's timed checks."""
    if thresholds.min_speedup is None and (thresholds.max_speedup_drop is None or baseline is None):
        return
    gated = [r for r in rows if not r.get("expected_failure")]
    timed = [r for r in gated if speedup(r) is not None]
    if not timed:
        verdict.fail(
            "a speed gate is set but no check was timed: run pytest with --modelpatch-timing "
            "(or ini modelpatch_timing = true) to record timing on equivalence checks"
        )
        return
    limit = thresholds.min_speedup
    for row in timed:
        value = speedup(row)
        if limit is not None and value is not None and not value >= limit:  # NaN passes no floor
            verdict.fail(f"{name(row)}: speedup {speedup_cell(row)} is below min speedup {limit:g}x", row)
    if thresholds.max_speedup_drop is not None and baseline is not None:
        before = {check_key(r): speedup(r) for r in baseline}
        for row in timed:
            old = before.get(check_key(row))
            allowed = None if old is None else old * (1.0 - thresholds.max_speedup_drop)
            now = speedup(row)
            if allowed is not None and now is not None and not now >= allowed:
                verdict.fail(
                    f"{name(row)}: speedup fell from {old:.2f}x (baseline) to {speedup_cell(row)}, below the "
                    f"allowed {allowed:.2f}x (max speedup drop {thresholds.max_speedup_drop:g})", row,
                )  # fmt: skip
    if len(timed) < len(gated):
        verdict.notes.append(
            f"{len(gated) - len(timed)} checks have no timing (only equivalence and property checks are timed)"
        )


def evaluate(
    rows: list[dict[str, Any]],
    thresholds: Thresholds,
    baseline: list[dict[str, Any]] | None = None,
    baseline_name: str = "",
    run: Run | None = None,
    *,
    allow_empty: bool = True,
) -> GateVerdict:
    """Judge ``rows`` against ``thresholds`` and, when given, the ``baseline`` rows of their device classes.

    ``run``: what the reports behind ``rows`` set out to check (:func:`~pytest_modelpatch.reporting.shards.merge_reports`);
    without it, every test on the device classes of ``rows``. ``allow_empty=False``: a run, or one of its
    reports, that judged nothing fails (:func:`unjudged`), as ``modelpatch gate`` does unless ``--allow-empty``.
    """
    run = run if run is not None else merge_reports([("", {"header": {}, "rows": rows})])
    several = len(run.device_classes | {class_of(r) for r in rows}) > 1

    def name(row: dict[str, Any]) -> str:
        return check_name(row, device=several)

    verdict = GateVerdict(checks=len(rows), baseline=baseline_name, reports=len(run.scopes), notes=list(run.notes),
                          warnings=list(run.warnings))  # fmt: skip
    for message in [] if allow_empty else unjudged(run):
        verdict.fail(message)
    expected = [r for r in rows if r.get("expected_failure")]
    if expected:
        failing = sum(r["outcome"] != "passed" for r in expected)
        verdict.notes.append(
            f"{len(expected)} checks in tests meant to fail (xfail or a caught AssertionError), not gated: "
            f"{failing} xfailed, {len(expected) - failing} xpassed (e.g. {name(expected[0])}: {expected[0].get('intent')})"
        )
    for row in rows:
        if row.get("expected_failure"):
            continue
        if row["outcome"] != "passed":
            verdict.fail(f"{name(row)}: the check failed (max abs error {figure(row.get('max_abs_error'))})", row)
        for field_name in ("max_abs_error", "max_rel_error"):
            limit, value = getattr(thresholds, field_name), row.get(field_name)
            # not (value <= limit): a NaN error passes no ceiling
            if limit is not None and value is not None and not value <= limit:
                verdict.fail(
                    f"{name(row)}: {field_name.replace('_', ' ')} {value:.4g} exceeds modelpatch_{field_name} = {limit:g}",
                    row,
                )
    _judge_tests(rows, run, verdict)
    _judge_speed(rows, thresholds, baseline, verdict, name)
    if baseline is not None:
        _judge_against_baseline(rows, baseline, run, thresholds, verdict, name)
    return verdict


ALLOW_EMPTY = "if nothing was to be checked here, pass --allow-empty"


def unjudged(run: Run) -> list[str]:
    """Why ``run`` judged nothing, or one of its reports did; empty when each judged something.

    A run with no check rows would pass any baseline and threshold blind; a report of several with
    no rows and no test that ran (all skipped, none selected) is a shard that checked nothing.
    """
    if not run.rows:
        ran = sum(scope.tests_ran or 0 for scope in run.scopes)
        held = f"{run.scopes[0].name} holds" if len(run.scopes) == 1 else f"the {len(run.scopes)} reports hold"
        tests = f"{ran} tests ran, none recorded a check" if ran else "no test ran"
        return [f"nothing was judged: {held} no checks ({tests}), so no threshold or baseline judged anything; "
                f"{ALLOW_EMPTY}"]  # fmt: skip
    return [
        f"nothing was judged in {scope.name}: it holds no checks and no test ran there; {ALLOW_EMPTY}"
        for scope in run.scopes
        if not scope.checks and not scope.tests_ran
    ]


def load_baseline(path: str | Path, thresholds: Thresholds) -> list[dict[str, Any]]:
    """The rows of the baseline at ``path``, refused when a figure a check is judged by is not finite.

    Against an ``inf`` baseline any growth passes (against ``nan``, none does). A row meant to fail is
    no yardstick, so it may hold any figure; a timed row's speedup counts only with ``max_speedup_drop``.
    """
    rows = load_report(Path(path))["rows"]
    for index, row in enumerate(rows):
        if row.get("expected_failure"):
            continue
        judged_by = [("max_abs_error", row.get("max_abs_error"))]
        if thresholds.max_speedup_drop is not None:
            judged_by.append(("timing speedup", speedup(row)))
        for name, value in judged_by:
            if value is not None and not math.isfinite(value):
                raise ReportFileError(
                    f'{path}: rows[{index}] ({row["nodeid"]}): {name} is "{figure(value)}", expected a finite '
                    "number, the yardstick the check's growth is judged by; write the baseline again from a run where "
                    "the check passes (--modelpatch-update-baseline, or modelpatch gate --update-baseline)"
                )
    return rows


UNFINISHED_NAMED = 10  # tests with no outcome named one by one; a session that stopped early may leave thousands


def _judge_tests(rows: list[dict[str, Any]], run: Run, verdict: GateVerdict) -> None:
    """Every test the reports ran: one that failed or errored fails the gate, row or none; so does a failed sweep
    entry and a selected test with no outcome. A test already named by a failed check is not named twice."""
    named = {r["nodeid"] for r in rows if r["outcome"] != "passed" and not r.get("expected_failure")}
    for nodeid, entry in sorted(run.tests.items()):
        if entry.get("outcome") in FAILING_OUTCOMES and nodeid not in named:
            what = "failed" if entry["outcome"] == "failed" else f"errored in {entry.get('when') or 'setup'}"
            detail = f": {entry['detail']}" if entry.get("detail") else ""
            verdict.fail(f"{nodeid}: the test {what}{detail}")
            named.add(nodeid)
    for test, family, entry in run.sweeps:
        if entry.get("outcome") == "failed" and not any(n.startswith(f"{test}[") and family in n for n in named):
            where = f" ({entry['divergence']})" if entry.get("divergence") else ""
            verdict.fail(f"{test}: the sweep failed on family {family}{where}")
    if run.unfinished:
        listed = ", ".join(f"{nodeid} ({report})" if len(run.scopes) > 1 else nodeid
                           for report, nodeid in run.unfinished[:UNFINISHED_NAMED])  # fmt: skip
        more = f" and {len(run.unfinished) - UNFINISHED_NAMED} more" if len(run.unfinished) > UNFINISHED_NAMED else ""
        verdict.fail(
            f"{len(run.unfinished)} selected tests have no outcome: {listed}{more}; the session stopped before they "
            "ran (-x, --maxfail, a crash or an interrupt): run them again"
        )
    if run.tests:
        counts = Counter(entry.get("outcome", "?") for entry in run.tests.values())
        order = [o for o in TEST_OUTCOMES if counts[o]] + sorted(set(counts) - set(TEST_OUTCOMES))
        verdict.notes.append(f"{len(run.tests)} tests: " + ", ".join(f"{counts[o]} {o}" for o in order))


def _judge_against_baseline(
    rows: list[dict[str, Any]],
    baseline: list[dict[str, Any]],
    run: Run,
    thresholds: Thresholds,
    verdict: GateVerdict,
    name: Callable[[dict[str, Any]], str],
) -> None:
    """Each check against the baseline's row of its test, check and device class; missing, new and unjudged rows noted."""
    before = {check_key(r): r for r in baseline}
    known = {key[2] for key in before}
    current: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:  # a matrix may run one check on one device class in two jobs: each is judged
        current.setdefault(check_key(row), []).append(row)
    verdict.new_devices = [device for device in device_order(class_of(r) for r in rows) if device not in known]
    for device in verdict.new_devices:
        count = sum(class_of(r) == device for r in rows)
        verdict.notes.append(
            f"new device {device}: {count} checks not judged against the baseline, which has no rows for it "
            f"(it has {', '.join(sorted(known)) or 'none'}); add them with --modelpatch-update-baseline"
        )
    where = f" in any of the {verdict.reports} reports" if verdict.reports > 1 else ""
    outside: Counter[str] = Counter()
    for key, old in before.items():
        for new in current.get(key, []):
            _compare(old, new, thresholds, verdict, name)
        if key in current:
            continue
        why = run.not_expected(key)
        if why:
            outside[why] += 1
            continue
        verdict.fail(
            f"{name(old)}: in the baseline (max abs error {figure(old.get('max_abs_error'))}) but did not run{where}; "
            "if it was removed on purpose, rewrite the baseline with --modelpatch-update-baseline", old,
        )  # fmt: skip
    if outside:
        parts = ", ".join(f"{count} {why}" for why, count in sorted(outside.items()))
        verdict.notes.append(f"{sum(outside.values())} baseline checks are outside this run, not judged: {parts}")
    added = [rows_[0] for key, rows_ in current.items() if key not in before and key[2] in known]
    if added:
        verdict.notes.append(f"{len(added)} checks not in the baseline (e.g. {name(added[0])})")


def _compare(old: dict[str, Any], new: dict[str, Any], thresholds: Thresholds, verdict: GateVerdict,
             name: Callable[[dict[str, Any]], str]) -> None:  # fmt: skip
    """One check against its baseline row: its max abs error may grow by the factor, or the floor."""
    if old.get("expected_failure") and not new.get("expected_failure") and new["outcome"] == "passed":
        verdict.notes.append(f"{name(new)}: meant to fail in the baseline, now passes and is gated")
    old_err, new_err = old.get("max_abs_error"), new.get("max_abs_error")
    if old_err is None or new_err is None or new.get("expected_failure"):
        return
    if not math.isfinite(old_err):  # any growth passes an "inf" baseline: no yardstick
        if old.get("expected_failure"):
            verdict.notes.append(
                f"{name(new)}: not judged against the baseline's {figure(old_err)}, of a check meant to fail"
            )
        else:
            verdict.fail(f"{name(new)}: the baseline's max abs error is {figure(old_err)}, against which no growth can "
                         "be judged; write the baseline again from a run where the check passes", new)  # fmt: skip
        return
    allowed = thresholds.allowed_growth(old_err)
    if not new_err <= allowed:  # NaN grew beyond any baseline
        verdict.fail(
            f"{name(new)}: max abs error grew from {old_err:.4g} (baseline) to {new_err:.4g}, "
            f"more than allowed {allowed:.4g} (modelpatch_baseline_factor = {thresholds.factor:g}, "
            f"modelpatch_baseline_floor = {thresholds.floor:g})", new,
        )  # fmt: skip
