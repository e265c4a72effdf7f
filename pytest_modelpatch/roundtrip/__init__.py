"""Lossless weights: original checkpoint -> patched load -> save gives the same safetensors back.

:mod:`.check` (``assert_roundtrip``), :mod:`.safetensors_diff` (a streaming tensor-by-tensor
diff) and :mod:`.differences` (forward passes bit for bit, ``config.json`` changes). Imports
``errors``, ``families``, ``isolation``, ``models``, ``compare`` and ``reporting.records``.
"""
