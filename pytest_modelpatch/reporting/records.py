"""Check records: one row per check the plugin runs, for reports and CI gates.

Capability modules call ``record_check(...)``; the plugin installs a sink per
test that attaches the rows to the test report, so they travel from xdist
workers to the controller. Outside a pytest test the rows are dropped.

The session's settings (the seed property checks draw from, whether forwards are timed, whether
internal loads print, whether cached checkpoints are hashed) live here too, in :data:`SETTINGS`,
the one object that holds them: ``plugin.py`` writes them once in ``pytest_configure``, and
models/ and compare/ read them, so neither the plugin nor reporting reaches up to set them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple


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


@dataclass
class CheckSettings:
    """What the pytest session decides for every check and load; a check's own arguments win over these."""

    seed: int | None = None  # property checks' seed when a call passes none (--modelpatch-seed)
    max_examples: int | None = None  # property checks' examples when a call passes none
    timing: bool = False  # --modelpatch-timing: time both models' forwards beside each forward check
    verbose_loads: bool = False  # pytest -v: let transformers' bars and load reports of internal loads through
    full_verification: bool = False  # --modelpatch-verify-cache: hash every file of a cached checkpoint on use


SETTINGS = CheckSettings()


def configure_checks(**changes: Any) -> dict[str, Any]:
    """Change :data:`SETTINGS` (its fields by name, e.g. ``seed=``, ``timing=``); returns the values replaced, to restore.

    Example: ``previous = configure_checks(seed=1234)`` ... ``configure_checks(**previous)``.
    """
    known = {f.name for f in fields(CheckSettings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"configure_checks: unknown settings {unknown}; known: {sorted(known)}")
    previous = {name: getattr(SETTINGS, name) for name in changes}
    for name, value in changes.items():
        setattr(SETTINGS, name, value)
    return previous


class ImplementationAxis(NamedTuple):
    """One implementation a model is loaded with: its name in reports, its keyword, its config attribute."""

    name: str  # as report lines show it: "attention"
    keyword: str  # from_pretrained's keyword, and the patch and model markers': "attn_implementation"
    attribute: str  # where a loaded model's config records it: "_attn_implementation"


# The one table of implementation axes: the markers' keywords and help, the builder's eager
# reference and the report's lines derive from it. Here, in reporting/, because every room that
# reads it (isolation, models, compare, the plugin) may import reporting.records.
IMPLEMENTATION_AXES = (
    ImplementationAxis("attention", "attn_implementation", "_attn_implementation"),
    ImplementationAxis("experts", "experts_implementation", "_experts_implementation"),
)
IMPLEMENTATION_KEYWORDS = tuple(axis.keyword for axis in IMPLEMENTATION_AXES)


def implementations_of(model: Any) -> dict[str, str]:
    """The attention and experts implementations ``model`` was loaded with, by axis, each tower's too.

    The top config's under the axis, each sub-config's (a composite model's towers, nested ones
    dotted) under ``axis.path``: ``{"attention": "sdpa", "attention.text_config": "sdpa",
    "attention.vision_config": "sdpa"}``. A tower left on another implementation shows.
    """
    found = {}
    for path, level in _config_levels(getattr(model, "config", None)):
        for axis, _, attribute in IMPLEMENTATION_AXES:
            name = getattr(level, attribute, None)
            if name is not None:
                found[f"{axis}.{path}" if path else axis] = str(name)
    return found


def _config_levels(config: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, config)`` for a config and every sub-config below it (``sub_configs``, transformers 5.x)."""
    if config is None:
        return
    yield path, config
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and sub is not config and path.count(".") < 4:  # towers of towers at most a few deep
            yield from _config_levels(sub, f"{path}.{key}" if path else key)


def describe_implementations(found: dict[str, str], axis: str) -> str:
    """One side's choice on ``axis`` as a line shows it: ``sdpa``, or ``sdpa (vision_config: eager)`` where towers differ."""
    top = found.get(axis)
    towers = [
        f"{key.partition('.')[2]}: {name}" for key, name in found.items() if key.startswith(f"{axis}.") and name != top
    ]
    return f"{top} ({', '.join(towers)})" if towers else str(top)
