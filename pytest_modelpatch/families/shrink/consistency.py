"""Generic shrink rules for sizes a config derives from others, across levels of the tree.

Pure dict work, no torch. ``configs.shrink_config_dict`` calls these after the per-key
shrinking: a value the config class derived in ``__post_init__`` from the full sizes
(``mamba_d_head = expand * hidden_size // mamba_n_heads``, XLNet's ``d_head``) is put back
to its declared "derive me" default so the tiny config derives it again; indices into
another sub-config's layers (``vision_feature_layer``) are moved into its shrunk depth.
"""

from __future__ import annotations

from typing import Any

from pytest_modelpatch.families.shrink.sizes import is_int

# Config keys that hold special token ids; Molmo2 names its image placeholder image_patch_id.
TOKEN_ID_SUFFIXES = ("_token_id", "_token_index", "_token_ids", "_patch_id")

# Declared defaults that mean "derive from the other sizes" (dataclass field defaults).
DERIVE_MARKERS: tuple[Any, ...] = (None, "auto")


def rederive_defaults(before: dict[str, Any], out: dict[str, Any], derived: dict[str, Any], fixed: set[str]) -> None:
    """Reset sizes the config class derives itself, so it derives them from the shrunk sizes.

    ``derived`` maps a key to its declared default (``None`` or ``"auto"``). Shrinking one of
    them on its own would break the relation (Zamba's ``attention_hidden_size`` is twice
    ``hidden_size``); a key the user overrode is kept.
    """
    for key, default in derived.items():
        if key not in fixed and is_int(out.get(key)) and is_int(before.get(key)):
            out[key] = default


def fit_feature_layers(tree: dict[str, Any]) -> None:
    """Indices of vision layers read by a projector (LLaVA's ``vision_feature_layer``) kept in range.

    The indices may live on the parent or another sub-config (Molmo2's ``adapter_config``);
    they index the shrunk ``vision_config``. Non-negative indices keep their order among
    themselves and map onto the last layers; negative ones already count from the end.
    """
    vision = tree.get("vision_config")
    depth = _depth(vision) if isinstance(vision, dict) else None
    if depth is None:
        return
    for level in [tree, *(v for v in tree.values() if isinstance(v, dict) and v is not vision)]:
        for key in [k for k in level if "feature_layer" in str(k)]:
            level[key] = _into_depth(level[key], depth)


def _into_depth(value: Any, depth: int) -> Any:
    if is_int(value):
        return value if value < depth else depth - 1
    if not (isinstance(value, list) and value and all(map(is_int, value))):
        return value
    if all(v < depth for v in value):
        return value
    ranks = sorted({v for v in value if v >= 0})
    slots = list(range(depth))[-len(ranks) :] if len(ranks) <= depth else [depth - 1] * len(ranks)
    mapped = {v: slots[min(i, len(slots) - 1)] for i, v in enumerate(ranks)}
    return [mapped.get(v, v) for v in value]


def _depth(level: dict[str, Any]) -> int | None:
    for key in ("num_hidden_layers", "num_layers", "depth"):
        if is_int(level.get(key)):
            return int(level[key])
    return None
