"""Every rank's result for one test, merged into the reports the controller logs for it.

The ranks agree (all passed, all skipped, all failed, all xfailed): the test's reports are one
rank's, the lowest failing one when they failed (which rank finishes first is chance), each check
row stamped with the kind, the world size and that rank. They disagree, or a rank crashed, hung or could not collect the test: the test
fails, and the failure says what each rank did. A rank must not decide on its own to skip: a test
skipped by some ranks only is a failure, not a skip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest

from pytest_modelpatch.parallel.marker import ParallelSpec
from pytest_modelpatch.parallel.pool import RankOutcome
from pytest_modelpatch.reporting.session import ROW_PROPERTY

Deserialize = Callable[[dict[str, Any]], pytest.TestReport]
GROUP_ADVICE = (
    "the ranks' process group belongs to the pool and serves every parallel test after this one: a test must not "
    "call destroy_process_group() or init_process_group(); make a group of its own with dist.new_group(...) and "
    "destroy that one. The ranks were restarted for the next test."
)


def category(outcome: RankOutcome) -> str:
    """What the rank's test did: failed, skipped, xfailed, xpassed or passed (or broken: no reports)."""
    if outcome.crashed or outcome.hung or outcome.error or outcome.group or not outcome.reports:
        return "broken"
    if any(r.get("outcome") == "failed" for r in outcome.reports):
        return "failed"
    xfail = [r for r in outcome.reports if r.get("wasxfail") is not None]
    if xfail:
        return "xfailed" if any(r.get("outcome") == "skipped" for r in xfail) else "xpassed"
    return "skipped" if any(r.get("outcome") == "skipped" for r in outcome.reports) else "passed"


def describe(outcome: RankOutcome) -> str:
    """One line: what the rank did with the test."""
    if outcome.crashed:
        return f"rank {outcome.rank} {outcome.crashed} during the test"
    if outcome.hung:
        return f"rank {outcome.rank} {outcome.hung.partition(';')[0]}"
    if outcome.error:
        return f"rank {outcome.rank} could not run it: {outcome.error.splitlines()[0]}"
    if outcome.group:
        return f"rank {outcome.rank}: the test {outcome.group}"
    kind = category(outcome)
    skipped = next((r for r in outcome.reports if r.get("outcome") == "skipped" and r.get("wasxfail") is None), None)
    if kind == "skipped" and skipped is not None:
        return f"rank {outcome.rank} skipped ({_skip_reason(skipped)})"
    return f"rank {outcome.rank} {kind}"


def _skip_reason(report: dict[str, Any]) -> str:
    longrepr = report.get("longrepr")
    if isinstance(longrepr, (list, tuple)) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def merge(
    item: pytest.Item,
    spec: ParallelSpec,
    backend: str,
    outcomes: list[RankOutcome],
    deserialize: Deserialize,
    group_advice: str = GROUP_ADVICE,
) -> list[pytest.TestReport]:
    """The reports to log for ``item`` from every rank's outcome."""
    kinds = {category(o) for o in outcomes}
    where = f"{spec} on {backend}"
    if len(kinds) == 1 and "broken" not in kinds:
        failed = [o for o in outcomes if o.failed]
        # all failed: the lowest rank's report, so the same failure reads the same in every run
        chosen = failed[0] if failed else outcomes[0]
        reports = [deserialize(data) for data in chosen.reports]
        _stamp_rows(reports, spec, chosen.rank)
        if failed:
            others = ", ".join(describe(o) for o in outcomes if o is not chosen)
            head = f"{where}: failed on rank {chosen.rank} of {spec.world_size} (the report above is its); {others}"
            for report in reports:
                if report.failed:
                    _add_section(report, "parallel", head)
        return reports
    lines = [describe(o) for o in outcomes]
    if any(o.group for o in outcomes):
        lines.append(group_advice)
    if kinds == {"skipped", "passed"} or ("skipped" in kinds and len(kinds) > 1):
        lines.append(
            "a rank must not decide on its own to skip: skip on every rank or on none (decide from what all ranks see)"
        )
    details = []
    for outcome in outcomes:
        if outcome.hung or outcome.crashed:
            details += [f"--- rank {outcome.rank} ---", outcome.hung or outcome.crashed]
            details += ["its output (last lines):", outcome.output] if outcome.output.strip(". \n") else []
        elif outcome.error:
            details += [f"--- rank {outcome.rank} ---", outcome.error]
        else:
            failure = next((r for r in outcome.reports if r.get("outcome") == "failed"), None)
            if failure is not None:
                details += [f"--- rank {outcome.rank} ({failure.get('when')}) ---", deserialize(failure).longreprtext]
    broke_group = any(o.group for o in outcomes)
    head = "the test broke the ranks' process group" if broke_group else "the ranks did not agree or did not all finish"
    text = "\n".join([f"{where}: {head}:", *(f"  {line}" for line in lines), *details])
    return _failure_reports(item, text)


def log_test(item: pytest.Item, reports: list[pytest.TestReport]) -> None:
    """Log ``reports`` as the test's, between its logstart and logfinish, as pytest's own runner does."""
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in reports:
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def _stamp_rows(reports: list[pytest.TestReport], spec: ParallelSpec, rank: int) -> None:
    for report in reports:
        for name, value in report.user_properties:
            if name == ROW_PROPERTY and isinstance(value, dict):
                value["parallel"] = {"kind": spec.kind, "world_size": spec.world_size, "rank": rank}


def _add_section(report: pytest.TestReport, name: str, text: str) -> None:
    longrepr = report.longrepr
    addsection = getattr(longrepr, "addsection", None)
    if addsection is not None:
        addsection(name, text)
    else:
        report.longrepr = f"{longrepr}\n{text}" if longrepr else text


def _failure_reports(item: pytest.Item, text: str) -> list[pytest.TestReport]:
    """A setup that passed, a call that failed with ``text``, a teardown that passed: how the test reads."""
    keywords: dict[str, Literal[1]] = {name: 1 for name in item.keywords}

    def report(
        when: Literal["setup", "call", "teardown"], outcome: Literal["passed", "failed"], longrepr: Any = None
    ) -> pytest.TestReport:
        return pytest.TestReport(item.nodeid, item.location, keywords, outcome, longrepr, when)

    return [report("setup", "passed"), report("call", "failed", text), report("teardown", "passed")]
