"""Lint patch-mapping keys against the installed transformers without importing it.

:mod:`.patterns` (``run_lint``, the lint the public ``lint_patterns`` runs; findings), :mod:`.scan_index` (the cached index of
every class), :mod:`.index_builder`, :mod:`.name_resolver` and :mod:`.source_scan` (which read sources as text).
Imports ``errors`` only: ``modelpatch lint`` loads neither torch nor pytest.
"""
