"""How the plugin's own tests run a pytester session, and where its runs keep the lint's index."""

from __future__ import annotations

import os

import pytest

from pytest_modelpatch.lint.scan_index import cache_dir

# A pytester session in file order (no pytest-randomly) and in one process (no xdist): what most
# tests of one behaviour run; the tests of ordering and of xdist pass their own arguments.
IN_ORDER = ("-p", "no:randomly", "-p", "no:xdist")

# Read at import: pytester points HOME at its temporary folder, where the cache would otherwise go.
LINT_CACHE = cache_dir()


def keep_the_lint_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point a pytester run's cache at this process's, or every run rebuilds the lint's scan index."""
    monkeypatch.setenv("MODELPATCH_CACHE_DIR", os.environ.get("MODELPATCH_CACHE_DIR") or str(LINT_CACHE))
