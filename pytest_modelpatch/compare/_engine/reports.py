"""The two ends every check shares: the inputs it takes, and the one way it ends (a report row, then its failure).

As ``torch.testing`` turns every mismatch into one error through one path, every check here ends
through :func:`conclude`: its :class:`~pytest_modelpatch.reporting.records.CheckRecord` goes to the
test's report rows, then, if the check failed, ``AssertionError(str(report))`` is raised. A report
of tensor comparisons inherits :class:`CheckReport`, which builds that record from the report's
own fields, so a new check kind writes no record code: at most it overrides which comparison the
row's tolerance and output come from. ``roundtrip/`` and the property checks build their record
otherwise and end through :func:`conclude` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from pytest_modelpatch.compare._engine.outputs import ComparedTensors, TensorComparison
from pytest_modelpatch.reporting.records import CheckRecord, record_check


class Judged(Protocol):
    """A check's report: whether it passed, and a ``__str__`` that is the failure message."""

    @property
    def passed(self) -> bool: ...


R = TypeVar("R", bound=Judged)
# typing.Self is Python 3.11; a TypeVar bound to the class says the same on 3.10
_Report = TypeVar("_Report", bound="CheckReport")


def conclude(report: R, record: CheckRecord, cause: BaseException | None = None) -> R:
    """Record the check's row, then fail the test with the report when it failed (chained to ``cause``).

    Example: ``return conclude(report, report.to_record())`` at the end of an ``assert_*`` check.
    """
    __tracebackhide__ = True
    record_check(record)
    if not report.passed:
        raise AssertionError(str(report)) from cause
    return report


def given_inputs(
    inputs: Mapping[str, Any] | torch.Tensor | None, default: Callable[[], Mapping[str, Any]]
) -> Mapping[str, Any]:
    """A check's inputs: a dict as given, a tensor as ``input_ids``, ``None`` as the check's ``default()``."""
    if inputs is None:
        return default()
    if isinstance(inputs, torch.Tensor):
        return {"input_ids": inputs}
    return inputs


class CheckReport(ComparedTensors):
    """A report of tensor comparisons that makes its own report row and ends its check.

    Mixed into each check's dataclass, which provides ``reference``, ``device``, ``dtype``,
    ``duration_s`` and ``passed`` (and ``divergence``, when it locates one). The row's figures
    come from ``comparisons``; a check changes what its row shows by overriding
    :meth:`judged_comparison`, :meth:`worst_output`, :meth:`passing_detail` or :meth:`row_fields`.
    """

    check_kind = "equivalence"  # the row's kind unless the caller names another ("property", ...)
    divergence: Any = None  # the first diverging module, when the check located one: the row's profile

    def judged_comparison(self) -> TensorComparison | None:
        """The comparison whose tolerance the row shows: the first one judged by a tolerance."""
        return next((c for c in self.comparisons if c.tolerance is not None), None)

    def worst_output(self) -> str:
        """The output that erred most, named in the row."""
        return max(self.comparisons, key=lambda c: c.max_abs).path if self.comparisons else ""

    def passing_detail(self) -> str:
        """The row's detail when the check passed (a failed check's detail is the whole report)."""
        return ""

    def row_fields(self) -> dict[str, Any]:
        """Fields this kind of check adds to (or changes in) its row."""
        return {}

    def to_record(self, kind: str = "", examples: int = 1, detail: str = "") -> CheckRecord:
        """This report as one report row; ``kind``, ``examples`` and ``detail`` for a check that ran it many times."""
        judged = self.judged_comparison()
        tolerance = judged.tolerance if judged is not None else None
        row: dict[str, Any] = {
            "kind": kind or self.check_kind, "outcome": "passed" if self.passed else "failed",
            "model": self.reference, "device": self.device, "dtype": self.dtype, "examples": examples,
            "max_abs_error": self.max_abs_error, "max_rel_error": self.max_rel_error,
            "atol": tolerance.atol if tolerance else None, "rtol": tolerance.rtol if tolerance else None,
            "elements_over_tolerance": sum(c.over for c in self.comparisons),
            "elements_compared": sum(c.total for c in self.comparisons),
            "duration_s": self.duration_s,
            "detail": detail or (self.passing_detail() if self.passed else str(self)),
            "output": self.worst_output(),
            "profile": self.divergence.profile if self.divergence is not None else [],
            # the divergence's own names (forward or backward), so that the row and the page say what the text does
            "blamed": list(getattr(getattr(self.divergence, "blame", None), "names", [])),
            "first_diverging": getattr(self.divergence, "name", ""),
        }  # fmt: skip
        return CheckRecord(**{**row, **self.row_fields()})

    def record(self, kind: str = "", examples: int = 1, detail: str = "") -> None:
        """Hand this outcome to the running test's report rows."""
        record_check(self.to_record(kind, examples, detail))

    def conclude(self: _Report) -> _Report:
        """Record this report's row, then raise ``AssertionError`` with it when the check failed; returns the report."""
        __tracebackhide__ = True
        return conclude(self, self.to_record())

    # reports define these as dataclass fields or properties; declared here for the type checker
    # (``reference`` as a read-only property, which a field or a property may provide, under
    # TYPE_CHECKING: a property here would be taken by a subclass's dataclass field as its default)
    if TYPE_CHECKING:

        @property
        def reference(self) -> str: ...

    device: str
    dtype: str
    duration_s: float

    @property
    def passed(self) -> bool:
        raise NotImplementedError
