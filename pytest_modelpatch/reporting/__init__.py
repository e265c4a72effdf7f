"""From checks to a CI verdict: check records, the JSON report, the gate, and their pytest side.

:mod:`.records` (the one ``CheckRecord`` and its sink), :mod:`.report` (JSON read/write,
tables), :mod:`.gate` (thresholds and baselines, pure) and :mod:`.profile_html` import
``errors`` only, so ``modelpatch gate`` loads no pytest. :mod:`.session` is their pytest
side (rows on test reports, the xdist controller, the terminal summary), registered by
``plugin.py``.
"""
