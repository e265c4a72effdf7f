"""Lossless weights: original checkpoint -> patched load -> save gives the same safetensors back.

:mod:`.check` (``assert_roundtrip``), :mod:`.safetensors_diff` (a streaming tensor-by-tensor
diff) and :mod:`.differences` (forward passes bit for bit, ``config.json`` changes). Imports
``errors``, ``families``, ``isolation``, ``models``, ``compare`` and ``reporting.records``.

Public (docs/reference.md): the parts of ``assert_roundtrip``, ``load_with_fusion`` and ``diff_checkpoints``.
"""

from __future__ import annotations

from pytest_modelpatch import lazy_exports

_EXPORTS: dict[str, str] = {
    "load_with_fusion": "roundtrip.check",
    "diff_checkpoints": "roundtrip.safetensors_diff",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
