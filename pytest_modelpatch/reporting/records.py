"""Check records: one row per check the plugin runs, for reports and CI gates.

Capability modules call ``record_check(...)``; the plugin installs a sink per
test that attaches the rows to the test report, so they travel from xdist
workers to the controller. Outside a pytest test the rows are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CheckRecord:
    """One check: what was compared, on what, with which tolerance, and how it went."""

    kind: str  # "equivalence", "property", "module", "decode", "roundtrip", "lint"
    outcome: str  # "passed" | "failed"
    model: str = ""  # model family or spec, e.g. "llama"
    patch_keys: list[str] = field(default_factory=list)
    replacements: list[str] = field(default_factory=list)  # qualified replacement class names
    device: str = ""
    # what the figures are comparable within: the GPU's name as torch reports it, or "cpu";
    # filled in when the row is made (row_from_record), so a baseline compares H100 with H100
    device_class: str = ""
    dtype: str = ""
    examples: int = 1
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    atol: float | None = None
    rtol: float | None = None
    elements_over_tolerance: int = 0
    elements_compared: int = 0
    duration_s: float = 0.0
    detail: str = ""
    nodeid: str = ""
    output: str = ""  # the output that erred most, e.g. "logits"
    profile: list[tuple[str, float]] = field(default_factory=list)  # per-module max abs error, forward order
    # a failed check's located modules: the replaced ones whose own output differs (to look at first), then
    # the first whose output crossed the tolerance, as its text names them
    blamed: list[str] = field(default_factory=list)
    first_diverging: str = ""
    coverage: list[str] = field(default_factory=list)  # replacements that ran only partly, idle experts
    # the test's intent, stamped after it ran: an xfail test's checks, or a failing check whose
    # AssertionError the test caught (pytest.raises) and went on, were meant to fail
    expected_failure: bool = False
    intent: str = ""  # why it was expected, e.g. "xfail: the fused kernel is non-causal"
    # MoE: tokens whose expert choice flipped at a near-tie and was forced to the reference's routing
    routing_near_ties: int = 0
    # --modelpatch-timing: reference_s, patched_s, speedup, reference/patched_peak_bytes; absent when not asked
    timing: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        if row["timing"] is None:
            del row["timing"]  # off by default: no timing key at all, not a null one
        return row

    def __str__(self) -> str:
        err = "" if self.max_abs_error is None else f" max_abs={self.max_abs_error:.3g}"
        outcome = shown_outcome(self.outcome, self.expected_failure)
        return f"{self.kind} {self.model} [{self.dtype or '-'}@{self.device or '-'}] {outcome}{err}"


def shown_outcome(outcome: str, expected_failure: bool) -> str:
    """The outcome a person reads: ``xfailed``/``xpassed`` for a check that was meant to fail."""
    if not expected_failure:
        return outcome
    return "xfailed" if outcome == "failed" else "xpassed"


# the running test's sink: per-test state, so a context variable (as the test's tolerance), not a global
_SINK: ContextVar[Callable[[CheckRecord], None] | None] = ContextVar("modelpatch_record_sink", default=None)


def set_record_sink(sink: Callable[[CheckRecord], None] | None) -> Callable[[CheckRecord], None] | None:
    """Install the function that receives records; returns the previous one."""
    previous = _SINK.get()
    _SINK.set(sink)
    return previous


def record_check(record: CheckRecord) -> None:
    """Hand a finished check to the current test's report (no-op outside pytest)."""
    sink = _SINK.get()
    if sink is not None:
        sink(record)
