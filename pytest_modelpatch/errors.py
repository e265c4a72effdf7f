"""Exceptions and warnings raised by pytest-modelpatch.

Kept free of torch/transformers imports: pytest resolves the warning class from
``filterwarnings`` ini lines before any test runs.
"""

from __future__ import annotations

import pytest


class ModelPatchError(Exception):
    """Base class for errors raised by pytest-modelpatch."""


class PatchUsageError(ModelPatchError, pytest.UsageError):
    """A patch, marker or option was used wrongly; the message says how to fix it."""


class PatchLeakError(ModelPatchError):
    """A test changed transformers' global patch state and did not restore it."""


class ModelPatchWarning(UserWarning):
    """Warning category for everything pytest-modelpatch warns about."""
