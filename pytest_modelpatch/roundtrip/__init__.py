"""Lossless weights: original checkpoint -> patched load -> save gives the same safetensors back.

:mod:`.check` (``check_roundtrip``), :mod:`.safetensors_diff` (a streaming tensor-by-tensor
diff) and :mod:`.reversibility` (conversions that undo themselves). Imports ``errors``,
``isolation``, ``models``, ``compare`` and ``reporting.records``.
"""
