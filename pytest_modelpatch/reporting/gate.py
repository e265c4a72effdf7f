"""The CI gate: judge a run's check rows against thresholds and a baseline report.

A check is named by its test's node id and ``kind#n`` (the n-th check of that kind in
the test). The gate fails when a check failed, when its max error passes an ini
threshold, when its max abs error grew beyond ``factor`` times the baseline's (and by
more than ``floor``, so 0 -> 1e-9 noise passes), or when a baseline check did not run.

Example::

    verdict = evaluate(rows, Thresholds(max_abs_error=1e-3), baseline=load_report(path)["rows"])
    print(verdict.markdown())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.reporting.report import load_report, worst_first, write_report

DEFAULT_FACTOR = 2.0
DEFAULT_FLOOR = 1e-6


@dataclass(frozen=True)
class Thresholds:
    """Limits from the ini file: absolute ceilings and how much growth over the baseline is allowed."""

    max_abs_error: float | None = None
    max_rel_error: float | None = None
    factor: float = DEFAULT_FACTOR
    floor: float = DEFAULT_FLOOR

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
            lines += ["", "| outcome | max abs | max rel | check | model | dtype@device | test |", "|---|---|---|---|---|---|---|"]
            for r in sorted(rows, key=worst_first)[:limit]:
                lines.append(
                    f"| {r['outcome']} | {_num(r.get('max_abs_error'))} | {_num(r.get('max_rel_error'))} | {r['check']} "
                    f"| {_md(r.get('model') or '-')} | {r.get('dtype') or '-'}@{r.get('device') or '-'} | `{r['nodeid']}` |"
                )
            if len(rows) > limit:
                lines.append(f"\n{len(rows) - limit} more checks in the JSON report.")
        return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def evaluate(
    rows: list[dict[str, Any]], thresholds: Thresholds, baseline: list[dict[str, Any]] | None = None, baseline_name: str = ""
) -> GateVerdict:
    """Judge ``rows`` against ``thresholds`` and, when given, the ``baseline`` rows."""
    verdict = GateVerdict(checks=len(rows), baseline=baseline_name)
    for row in rows:
        if row["outcome"] != "passed":
            verdict.failures.append(f"{check_name(row)}: the check failed (max abs error {_num(row.get('max_abs_error'))})")
        for figure in ("max_abs_error", "max_rel_error"):
            limit, value = getattr(thresholds, figure), row.get(figure)
            if limit is not None and value is not None and value > limit:
                verdict.failures.append(
                    f"{check_name(row)}: {figure.replace('_', ' ')} {value:.4g} exceeds modelpatch_{figure} = {limit:g}"
                )
    if baseline is None:
        return verdict
    current = {_key(r): r for r in rows}
    before = {_key(r): r for r in baseline}
    for key, old in before.items():
        new = current.get(key)
        if new is None:
            verdict.failures.append(
                f"{check_name(old)}: in the baseline (max abs error {_num(old.get('max_abs_error'))}) but did not run; "
                "if it was removed on purpose, rewrite the baseline with --modelpatch-update-baseline"
            )
            continue
        old_err, new_err = old.get("max_abs_error"), new.get("max_abs_error")
        if old_err is None or new_err is None:
            continue
        allowed = thresholds.allowed_growth(old_err)
        if new_err > allowed:
            verdict.failures.append(
                f"{check_name(new)}: max abs error grew from {old_err:.4g} (baseline) to {new_err:.4g}, "
                f"more than allowed {allowed:.4g} (modelpatch_baseline_factor = {thresholds.factor:g}, "
                f"modelpatch_baseline_floor = {thresholds.floor:g})"
            )
    added = [k for k in current if k not in before]
    if added:
        verdict.notes.append(f"{len(added)} checks not in the baseline (e.g. {check_name(current[added[0]])})")
    return verdict


# ---------------------------------------------------------------------------
# pytest wiring: ini values and the session verdict
# ---------------------------------------------------------------------------


def _ini_float(config: pytest.Config, name: str, default: float | None) -> float | None:
    text = str(config.getini(name) or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise PatchUsageError(f"ini {name} = {text!r}: expected a non-negative number, e.g. {name} = 1e-4")
    return value


def thresholds_from_ini(config: pytest.Config) -> Thresholds:
    """``modelpatch_max_abs_error``, ``modelpatch_max_rel_error``, ``modelpatch_baseline_factor/_floor``."""
    return Thresholds(
        max_abs_error=_ini_float(config, "modelpatch_max_abs_error", None),
        max_rel_error=_ini_float(config, "modelpatch_max_rel_error", None),
        factor=_ini_float(config, "modelpatch_baseline_factor", DEFAULT_FACTOR) or DEFAULT_FACTOR,
        floor=_ini_float(config, "modelpatch_baseline_floor", DEFAULT_FLOOR) or 0.0,
    )


def validate_options(config: pytest.Config) -> None:
    """Fail at startup, not after the run, on a bad ini value or option combination."""
    thresholds_from_ini(config)
    if config.getoption("modelpatch_update_baseline") and not config.getoption("modelpatch_baseline"):
        raise PatchUsageError("--modelpatch-update-baseline needs --modelpatch-baseline PATH: the file to rewrite")


def gate_requested(config: pytest.Config) -> bool:
    return bool(
        config.getoption("modelpatch_baseline")
        or config.getini("modelpatch_max_abs_error")
        or config.getini("modelpatch_max_rel_error")
    )


def session_verdict(config: pytest.Config, rows: list[dict[str, Any]], header: dict[str, Any] | None) -> GateVerdict | None:
    """The gate for this session (``None`` when no threshold or baseline is set); rewrites the baseline if asked."""

    path = config.getoption("modelpatch_baseline")
    if config.getoption("modelpatch_update_baseline"):
        write_report(Path(path), header or {}, rows)
        verdict = evaluate(rows, thresholds_from_ini(config))
        verdict.notes.append(f"baseline {path} rewritten with {len(rows)} checks")
        return verdict
    if not gate_requested(config):
        return None
    baseline = load_report(Path(path))["rows"] if path else None
    return evaluate(rows, thresholds_from_ini(config), baseline, str(path or ""))
