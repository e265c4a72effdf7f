"""What checks report and how to read it: one record per check, the report file, the CI gate's
verdict, and where two models first diverge (what a failed check's report names).

The work is in ``reporting/`` and ``compare/``; this module is the public face of both.
"""

from __future__ import annotations

from pytest_modelpatch import lazy_exports

_EXPORTS: dict[str, str] = {
    "CheckRecord": "reporting.records",
    "load_report": "reporting.report",
    "GateVerdict": "reporting.gate",
    "Thresholds": "reporting.gate",
    "first_divergence": "compare._engine.divergence",
    "divergence_profile": "compare._engine.divergence",
    "Divergence": "compare._engine.divergence",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
