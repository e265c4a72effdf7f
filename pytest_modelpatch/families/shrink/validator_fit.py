"""Meet the cross-config equalities that strict config validators state in their messages.

Composite configs (transformers >= 5.x strict dataclasses) validate that a size in one
sub-config equals a size in another: "`head_config.audio_hidden_size` (512) must match
`audio_config.hidden_size` (64)". Shrinking changes the right-hand side, so the
left-hand side, named by its dotted path, is set to the value the validator asked for.
Pure dict work, no torch.
"""

from __future__ import annotations

import re
from typing import Any

# "`a.b` (512) must match|equal|be equal to <anything> (64)."
_EQUALITY = re.compile(r"`([\w.]+)` \((-?\d+)\) must (?:match|equal|be equal to) .*?\((-?\d+)\)")
MAX_FITS = 8  # one per equality a validator checks; more means the message is not about sizes


def fit_validator_message(tree: dict[str, Any], message: str, fixed: dict[str, Any]) -> bool:
    """Set the size the message names to the value it must equal; ``False`` when it cannot.

    ``fixed``: the user's overrides (nested like the tree); a size they set is never changed.
    """
    match = _EQUALITY.search(message)
    if match is None:
        return False
    path, current, wanted = match.group(1).split("."), int(match.group(2)), int(match.group(3))
    # the path is relative to the config that validates, which may be nested (NeMo SpeechLM's
    # audio_config.diarization_config): try every level, outermost first
    level: dict[str, Any] | None
    for level, pinned in _levels(tree, fixed):
        for key in path[:-1]:
            level = level.get(key) if isinstance(level, dict) else None
            pinned = pinned.get(key, {}) if isinstance(pinned, dict) else {}
        leaf = path[-1]
        if isinstance(level, dict) and level.get(leaf) == current:
            if isinstance(pinned, dict) and leaf in pinned:
                return False
            level[leaf] = wanted
            return True
    return False


def _levels(tree: dict[str, Any], fixed: Any) -> list[tuple[dict[str, Any], Any]]:
    """Every dict level of ``tree`` with the matching part of ``fixed``, outermost first."""
    found = [(tree, fixed if isinstance(fixed, dict) else {})]
    for key, value in tree.items():
        if isinstance(value, dict):
            found += _levels(value, fixed.get(key, {}) if isinstance(fixed, dict) else {})
    return found
