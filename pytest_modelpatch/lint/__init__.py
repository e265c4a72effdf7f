"""Lint patch-mapping keys against the installed transformers without importing it.

:mod:`.patterns` (``lint_patterns``, the one entry point; findings), :mod:`.scan_index` (the cached index of
every class), :mod:`.index_builder`, :mod:`.name_resolver` and :mod:`.source_scan` (which read sources as text),
:mod:`.model_structures` (the family's tiny model on the meta device, for the contract lint). Imports ``errors``
and ``families``; torch and transformers only when a structure is built: ``modelpatch lint`` of names loads
neither torch nor pytest.

Public (docs/reference.md): ``lint_patterns``, ``Finding``, ``failing_findings``, ``meta_structures``.
"""

from __future__ import annotations

from pytest_modelpatch import lazy_exports

_EXPORTS: dict[str, str] = {
    "lint_patterns": "lint.patterns",
    "failing_findings": "lint.patterns",
    "Finding": "lint.findings",
    "meta_structures": "lint.model_structures",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
