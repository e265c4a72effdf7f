"""The CI gate: judge a run's check rows against thresholds and a baseline report.

A check is named by its test's node id and ``kind#n`` (the n-th check of that kind in
the test). The gate fails when a check failed (unless the test meant it to: an
``expected_failure`` row, from an xfail test or a caught AssertionError, is only noted), when its max error passes an ini
threshold, when its max abs error grew beyond ``factor`` times the baseline's (and by
more than ``floor``, so 0 -> 1e-9 noise passes), or when a baseline check did not run.

Example::

    verdict = evaluate(rows, Thresholds(max_abs_error=1e-3), baseline=load_report(path)["rows"])
    print(verdict.markdown())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_modelpatch.reporting.records import shown_outcome
from pytest_modelpatch.reporting.report import figure, speedup, speedup_cell, worst_first

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

    def allowed_growth(self, baseline: float) -> float:
        """The largest max abs error accepted for a check whose baseline figure is ``baseline``."""
        return max(baseline * self.factor, baseline + self.floor)


def check_name(row: dict[str, Any]) -> str:
    """``tests/test_x.py::test_attn equivalence#1 (LlamaForCausalLM, logits)``: how messages name a check."""
    extra = ", ".join(str(v) for v in (row.get("model"), row.get("output")) if v)
    return f"{row['nodeid']} {row['check']}" + (f" ({extra})" if extra else "")


def _key(row: dict[str, Any]) -> tuple[str, str]:
    return row["nodeid"], row["check"]


@dataclass
class GateVerdict:
    """What the gate found: failures (each names the check and both numbers) and notes."""

    checks: int
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    baseline: str = ""

    @property
    def passed(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        against = f" against baseline {self.baseline}" if self.baseline else ""
        head = f"modelpatch gate {'PASSED' if self.passed else 'FAILED'}: {self.checks} checks{against}, "
        head += f"{len(self.failures)} failures"
        return "\n".join([head, *(f"FAIL {f}" for f in self.failures), *(f"note {n}" for n in self.notes)])

    def markdown(self, rows: list[dict[str, Any]] | None = None, limit: int = 30) -> str:
        """A summary for ``$GITHUB_STEP_SUMMARY``: verdict, failures, then the worst checks as a table."""
        mark = ":white_check_mark:" if self.passed else ":x:"
        against = f" against `{self.baseline}`" if self.baseline else ""
        lines = [f"### {mark} modelpatch gate {'passed' if self.passed else 'failed'}", "",
                 f"{self.checks} checks{against}, {len(self.failures)} failures."]  # fmt: skip
        items = [f"- :x: {_md(f)}" for f in self.failures] + [f"- {_md(n)}" for n in self.notes]
        lines += ["", *items] if items else []
        if rows:
            timed = any(speedup(r) is not None for r in rows)
            head, rule = ("| speedup ", "---|") if timed else ("", "")
            lines += ["", f"| outcome | max abs | max rel {head}| check | model | dtype@device | test |", f"|---|---|---|{rule}---|---|---|---|"]
            for r in sorted(rows, key=worst_first)[:limit]:
                cell = f" {speedup_cell(r)} |" if timed else ""
                lines.append(
                    f"| {outcome(r)} | {figure(r.get('max_abs_error'))} | {figure(r.get('max_rel_error'))} |{cell} {r['check']} "
                    f"| {_md(r.get('model') or '-')} | {r.get('dtype') or '-'}@{r.get('device') or '-'} | `{r['nodeid']}` |"
                )
            if len(rows) > limit:
                lines.append(f"\n{len(rows) - limit} more checks in the JSON report.")
        return "\n".join(lines) + "\n"


def outcome(row: dict[str, Any]) -> str:
    """``passed``, ``failed``, or ``xfailed``/``xpassed`` for a check its test meant to fail."""
    return shown_outcome(row["outcome"], bool(row.get("expected_failure")))


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _judge_speed(
    rows: list[dict[str, Any]], thresholds: Thresholds, baseline: list[dict[str, Any]] | None, verdict: GateVerdict
) -> None:
    """``min_speedup`` on every timed check; ``max_speedup_drop`` against the baseline's timed checks."""
    if thresholds.min_speedup is None and (thresholds.max_speedup_drop is None or baseline is None):
        return
    gated = [r for r in rows if not r.get("expected_failure")]
    timed = [r for r in gated if speedup(r) is not None]
    if not timed:
        verdict.failures.append(
            "a speed gate is set but no check was timed: run pytest with --modelpatch-timing "
            "(or ini modelpatch_timing = true) to record timing on equivalence checks"
        )
        return
    limit = thresholds.min_speedup
    for row in timed:
        value = speedup(row)
        if limit is not None and not value >= limit:  # type: ignore[operator]  # NaN passes no floor
            verdict.failures.append(f"{check_name(row)}: speedup {speedup_cell(row)} is below min speedup {limit:g}x")
    if thresholds.max_speedup_drop is not None and baseline is not None:
        before = {_key(r): speedup(r) for r in baseline}
        for row in timed:
            old = before.get(_key(row))
            allowed = None if old is None else old * (1.0 - thresholds.max_speedup_drop)
            if allowed is not None and not speedup(row) >= allowed:  # type: ignore[operator]
                verdict.failures.append(
                    f"{check_name(row)}: speedup fell from {old:.2f}x (baseline) to {speedup_cell(row)}, below the "
                    f"allowed {allowed:.2f}x (max speedup drop {thresholds.max_speedup_drop:g})"
                )
    if len(timed) < len(gated):
        verdict.notes.append(f"{len(gated) - len(timed)} checks have no timing (only equivalence and property checks are timed)")


def evaluate(
    rows: list[dict[str, Any]], thresholds: Thresholds, baseline: list[dict[str, Any]] | None = None, baseline_name: str = ""
) -> GateVerdict:
    """Judge ``rows`` against ``thresholds`` and, when given, the ``baseline`` rows."""
    verdict = GateVerdict(checks=len(rows), baseline=baseline_name)
    expected = [r for r in rows if r.get("expected_failure")]
    if expected:
        failing = sum(r["outcome"] != "passed" for r in expected)
        verdict.notes.append(
            f"{len(expected)} checks in tests meant to fail (xfail or a caught AssertionError), not gated: "
            f"{failing} xfailed, {len(expected) - failing} xpassed (e.g. {check_name(expected[0])}: {expected[0].get('intent')})"
        )
    for row in rows:
        if row.get("expected_failure"):
            continue
        if row["outcome"] != "passed":
            verdict.failures.append(f"{check_name(row)}: the check failed (max abs error {figure(row.get('max_abs_error'))})")
        for name in ("max_abs_error", "max_rel_error"):
            limit, value = getattr(thresholds, name), row.get(name)
            # not (value <= limit): a NaN error passes no ceiling
            if limit is not None and value is not None and not value <= limit:
                verdict.failures.append(
                    f"{check_name(row)}: {name.replace('_', ' ')} {value:.4g} exceeds modelpatch_{name} = {limit:g}"
                )
    _judge_speed(rows, thresholds, baseline, verdict)
    if baseline is None:
        return verdict
    current = {_key(r): r for r in rows}
    before = {_key(r): r for r in baseline}
    for key, old in before.items():
        new = current.get(key)
        if new is None:
            verdict.failures.append(
                f"{check_name(old)}: in the baseline (max abs error {figure(old.get('max_abs_error'))}) but did not run; "
                "if it was removed on purpose, rewrite the baseline with --modelpatch-update-baseline"
            )
            continue
        if old.get("expected_failure") and not new.get("expected_failure") and new["outcome"] == "passed":
            verdict.notes.append(f"{check_name(new)}: meant to fail in the baseline, now passes and is gated")
        old_err, new_err = old.get("max_abs_error"), new.get("max_abs_error")
        if old_err is None or new_err is None or new.get("expected_failure"):
            continue
        allowed = thresholds.allowed_growth(old_err)
        if not new_err <= allowed:  # NaN grew beyond any baseline
            verdict.failures.append(
                f"{check_name(new)}: max abs error grew from {old_err:.4g} (baseline) to {new_err:.4g}, "
                f"more than allowed {allowed:.4g} (modelpatch_baseline_factor = {thresholds.factor:g}, "
                f"modelpatch_baseline_floor = {thresholds.floor:g})"
            )
    added = [k for k in current if k not in before]
    if added:
        verdict.notes.append(f"{len(added)} checks not in the baseline (e.g. {check_name(current[added[0]])})")
    return verdict
