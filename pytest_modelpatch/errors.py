"""Every exception and warning pytest-modelpatch raises, in one place.

Kept free of torch/transformers imports: pytest resolves the warning class from
``filterwarnings`` ini lines before any test runs. ``PatchUsageError`` is a
``pytest.UsageError`` and is defined on first use, so that the ``modelpatch`` command,
which imports this module but not pytest, starts in a fraction of the time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "CheckpointError",
    "ModelMismatchError",
    "ModelPatchError",
    "ModelPatchWarning",
    "NotApplicableError",
    "PatchLeakError",
    "PatchNotAppliedError",
    "PatchUsageError",
    "RankPoolError",
    "ReferenceNotPristineError",
    "ReportFileError",
    "ReportMergeError",
    "ScanIndexError",
]


class ModelPatchError(Exception):
    """Base class for errors raised by pytest-modelpatch."""


if TYPE_CHECKING:
    import pytest

    # pytest's stubs mark UsageError final; pytest prints a UsageError as a usage error, so ours is one
    class PatchUsageError(ModelPatchError, pytest.UsageError):  # type: ignore[misc]
        """A patch, marker or option was used wrongly; the message says how to fix it."""


def __getattr__(name: str) -> type:
    if name != "PatchUsageError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import pytest

    class PatchUsageError(ModelPatchError, pytest.UsageError):  # type: ignore[misc]
        """A patch, marker or option was used wrongly; the message says how to fix it."""

    PatchUsageError.__module__, PatchUsageError.__qualname__ = __name__, name  # picklable by name
    globals()[name] = PatchUsageError
    return PatchUsageError


class PatchLeakError(ModelPatchError):
    """A test changed transformers' global patch state and did not restore it (``modelpatch_leaks = error``)."""


class PatchNotAppliedError(ModelPatchError):
    """A registered patch key replaced nothing in the model under test."""


class ReferenceNotPristineError(ModelPatchError):
    """The reference model would run patched code (a class, method or capture hook leaked into it)."""


class CheckpointError(ModelPatchError):
    """A checkpoint directory is missing, incomplete or unreadable."""


class ScanIndexError(ModelPatchError):
    """The lint's scan index could not be built or read."""


class ReportFileError(ModelPatchError):
    """A JSON report or baseline file is missing or not a modelpatch report.

    Not a ``pytest.UsageError``: ``modelpatch gate`` raises it without importing pytest.
    """


class ReportMergeError(ReportFileError):
    """Reports given to one verdict overlap: the same check from the same device in two of them (the message names both)."""


class ModelPatchWarning(UserWarning):
    """Warning category for everything pytest-modelpatch warns about."""


class ModelMismatchError(ModelPatchError):
    """A check was given two different models (family, architecture or config shape) to compare."""


class RankPoolError(ModelPatchError):
    """The rank processes of a ``@pytest.mark.parallel`` test could not be started (the reason and their output follow)."""


class NotApplicableError(ModelPatchError):
    """transformers refuses what a test asks of a family's model (an implementation it does not support, say).

    A sweep skips such a family as not applicable; a test that names the family alone errors with this.
    """
