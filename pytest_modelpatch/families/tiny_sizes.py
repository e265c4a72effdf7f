"""The sizes every tiny config shrinks to (``tiny_configs.py`` and its per-modality rules)."""

from __future__ import annotations

from typing import Any

# Every size below is shared by all sub-configs, so cross-config equalities that
# families rely on (a vision tower's ``out_hidden_size`` == the text ``hidden_size``,
# a projector's ``projection_dim``) still hold after shrinking.
TINY_WIDTH = 64
TINY_HEADS = 4
TINY_LAYERS = 2
TINY_INTERMEDIATE = 128
TINY_MOE_INTERMEDIATE = 64
TINY_VOCAB = 256
TINY_POSITIONS = 128
TINY_EXPERTS = 4
TINY_TOP_K = 2
TINY_SLIDING_WINDOW = 4  # shorter than example inputs, so the sliding mask is exercised
TINY_IMAGE = 32
TINY_PATCH = 8
TINY_LORA_RANK = 32


def is_int(value: Any) -> bool:
    """A config size: an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
