"""Shrink a config dict so any transformers family builds tiny and stays valid.

Pure dict work, no torch (per-family exceptions: ``rules/``): ``shrink_config_dict(config.to_dict(), overrides)`` keeps
grouped-query ratios, head sizes the rope settings depend on, per-layer lists sized
to the new layer count, experts and top-k, and special token ids inside the smaller
vocabulary; sub-configs (text, vision, audio) are shrunk the same way.
"""

from __future__ import annotations

from typing import Any

from pytest_modelpatch.families.shrink.audio import shrink_audio_level
from pytest_modelpatch.families.shrink.consistency import TOKEN_ID_SUFFIXES, fit_feature_layers, rederive_defaults
from pytest_modelpatch.families.shrink.layers import resize_per_layer_lists, shrink_layers, shrink_uncounted_layer_list
from pytest_modelpatch.families.shrink.rules import apply_config_rule
from pytest_modelpatch.families.shrink.sizes import (
    EXPERT_KEYS,
    FFN_KEYS,
    HEAD_KEYS,
    KV_HEAD_KEYS,
    MOE_FFN_KEYS,
    TINY_HEADS,
    TINY_LAYERS,
    TINY_TOP_K,
    TINY_VOCAB,
    TOP_K_KEYS,
    WIDTH_KEYS,
    is_int,
    shrink_int,
)
from pytest_modelpatch.families.shrink.vision import (
    fit_layout_embeddings,
    fit_stage_widths,
    fit_windows,
    follow_channels,
    replace_timm_backbone,
    shrink_stage_widths,
    shrink_vision_sizes,
)


def _is_config_dict(key: Any, value: Any) -> bool:
    return isinstance(value, dict) and ("model_type" in value or str(key).endswith("_config"))


def shrink_config_dict(
    config: dict[str, Any],
    overrides: dict[str, Any],
    implicit_rope: dict[str, dict[str, Any]] | None = None,
    derived: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Shrink a ``to_dict()`` config tree; token ids are moved into the tiny vocabulary.

    ``implicit_rope``: per model type, rope settings the modeling code falls back to
    when the config lacks them (``rope_parameters.get("mrope_section", [16, 24, 24])``),
    sized for the full model; they are written into the config and shrunk with it.
    ``derived``: per model type, keys the config class derives when given their declared
    default (``None``/``"auto"``), with that default (``consistency.rederive_defaults``).
    """
    shrunk = _shrink_level(config, overrides, implicit_rope or {}, derived or {})
    fit_feature_layers(shrunk)
    return _remap_token_ids(shrunk, _large_token_ids(shrunk))


def _shrink_level(
    level: dict[str, Any],
    overrides: dict[str, Any],
    implicit_rope: dict[str, dict[str, Any]],
    derived: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    out = dict(level)
    for key, value in level.items():
        if _is_config_dict(key, value):
            sub = overrides.get(key)
            out[key] = _shrink_level(value, sub if isinstance(sub, dict) else {}, implicit_rope, derived)
        elif is_int(value):
            out[key] = shrink_int(key, value)
        elif isinstance(value, (list, tuple)) and value and all(map(is_int, value)):
            out[key] = _shrink_int_list(key, list(value))  # Swin V2 defaults are tuples
    shrink_vision_sizes(out)
    fit_layout_embeddings(out)
    shrink_layers(level, out)
    shrink_uncounted_layer_list(level, out)
    shrink_audio_level(level, out)
    if any(is_int(out.get(k)) for k in EXPERT_KEYS):
        # some defaults leave top-k unset (DeepSeek-V2) and the router then crashes
        for key in TOP_K_KEYS:
            if key in out and out[key] is None:
                out[key] = TINY_TOP_K
    apply_config_rule(level.get("model_type"), out)  # per-family rules: after the generic ones, before overrides
    plain = {k: v for k, v in overrides.items() if not (isinstance(v, dict) and _is_config_dict(k, out.get(k)))}
    resize_per_layer_lists(out, plain)
    rederive_defaults(level, out, derived.get(str(level.get("model_type", "")), {}), set(plain))
    out.update(plain)
    replace_timm_backbone(out, set(plain))
    shrink_stage_widths(out, set(plain))
    follow_channels(level, out, set(plain))
    _derive_head_sizes(level, out, set(plain), implicit_rope.get(str(level.get("model_type", "")), {}))
    fit_windows(out, set(plain))
    fit_stage_widths(out, set(plain))
    return out


def _shrink_int_list(key: str, values: list[int]) -> list[int]:
    """Per-stage lists of hierarchical vision models (Swin: depths, heads per stage)."""
    if key in ("image_size", "patch_size"):
        return [shrink_int(key, v) for v in values]
    if key in HEAD_KEYS:
        return [TINY_HEADS] * len(values)  # every stage width (64 * 2**i) divides by it
    if key in ("depths", "depth"):  # CvT: depth per stage
        return [min(v, TINY_LAYERS) for v in values]
    if key in FFN_KEYS or key in MOE_FFN_KEYS:
        return [shrink_int(key, v) for v in values]  # per-layer feed-forward sizes (Gemma 3n)
    return values


def _derive_head_sizes(
    before: dict[str, Any], out: dict[str, Any], fixed: set[str], implicit_rope: dict[str, Any]
) -> None:
    """Make head counts and per-head sizes agree with the (possibly overridden) width."""
    width = next((out[k] for k in WIDTH_KEYS if is_int(out.get(k)) and out[k] > 0), None)
    heads_key = next((k for k in HEAD_KEYS if is_int(out.get(k)) and out[k] > 0), None)
    if heads_key is None:
        return
    heads = out[heads_key]
    for kv_key in [k for k in KV_HEAD_KEYS if k in out and k not in fixed]:
        out[kv_key] = _kv_heads(before, kv_key, heads_key, heads)
    if width is None or width % heads:
        return
    head_dim = width // heads
    expand = before.get("expand")
    if (
        is_int(expand)
        and before.get(heads_key, 0) * (before.get("head_dim") or 0)
        == before.get(next(k for k in WIDTH_KEYS if k in before), 0) * expand
    ):
        head_dim = width * expand // heads  # Mamba2: heads * head_dim == hidden_size * expand
    for key in ("head_dim", "d_kv", "attention_head_size", "query_pre_attn_scalar"):
        if is_int(before.get(key)) and before[key] > 0 and key not in fixed:
            out[key] = head_dim
    if "head_dim" in before and before["head_dim"] is None and "head_dim" not in fixed:
        out["head_dim"] = head_dim  # some modeling code reads it without a fallback (Ministral)
    rope_dim = before.get("qk_rope_head_dim")
    if is_int(rope_dim) and before.get("head_dim") == rope_dim and "head_dim" not in fixed:
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA models rotate only the rope part
    given = out.get("head_dim")
    head_dim = given if is_int(given) else head_dim
    if is_int(before.get("rotary_dim")) and "rotary_dim" not in fixed:
        out["rotary_dim"] = max(2, head_dim // 2)
    _shrink_rope(out, head_dim, fixed, implicit_rope)
    _scale_per_layer_head_dims(before, out)


def _scale_per_layer_head_dims(before: dict[str, Any], out: dict[str, Any]) -> None:
    """Per-layer overrides (Gemma 4's wider global layers) keep their ratio to the tiny head_dim."""
    old, new = before.get("head_dim"), out.get("head_dim")
    layers = out.get("per_layer_config")
    if not (is_int(old) and is_int(new) and old > 0 and isinstance(layers, dict)):
        return
    for values in layers.values():
        if isinstance(values, dict) and is_int(values.get("head_dim")):
            values["head_dim"] = max(2, values["head_dim"] * new // old)


def _kv_heads(before: dict[str, Any], kv_key: str, heads_key: str, heads: int) -> Any:
    """Keep the grouped-query shape: multi-head, multi-query, or grouped (two kv heads)."""
    old_kv, old_heads = before.get(kv_key), before.get(heads_key)
    if old_kv is None:
        return heads  # unset means multi-head, but some modeling code divides by it (Nemotron)
    if not is_int(old_kv) or not is_int(old_heads) or old_kv >= old_heads:
        return heads if is_int(old_kv) else old_kv
    if old_kv == 1:
        return 1
    return max(d for d in range(1, heads // 2 + 1) if heads % d == 0) if heads > 1 else 1


def _shrink_rope(level: dict[str, Any], head_dim: int, fixed: set[str], implicit: dict[str, Any]) -> None:
    """Resize rope settings whose lengths follow the head size (mrope sections, longrope factors)."""
    partial = level.get("partial_rotary_factor") or 1.0
    rope = level.get("rope_parameters") or level.get("rope_scaling")
    if isinstance(rope, dict) and implicit and not any(isinstance(v, dict) for v in rope.values()):
        rope = level["rope_parameters" if "rope_parameters" in level else "rope_scaling"] = {**implicit, **rope}
    if isinstance(rope, dict) and "rope_parameters" not in fixed and "rope_scaling" not in fixed:
        nested = [v for v in rope.values() if isinstance(v, dict)] or [rope]
        for params in nested:
            factor = params.get("partial_rotary_factor") or partial
            half = max(1, int(head_dim * factor) // 2)
            if isinstance(params.get("mrope_section"), list):
                params["mrope_section"] = _split_evenly(params["mrope_section"], half)
            for key in ("short_factor", "long_factor"):
                if isinstance(params.get(key), list) and params[key]:
                    values = params[key]
                    params[key] = [values[i * len(values) // half] for i in range(half)]


def _split_evenly(sections: list[int], total: int) -> list[int]:
    """Scale ``sections`` to sum to ``total``, each at least 1 (mrope splits head_dim/2)."""
    old = sum(sections) or 1
    new = [max(1, s * total // old) for s in sections]
    new[-1] += total - sum(new)
    return new


def _large_token_ids(tree: dict[str, Any]) -> dict[int, int]:
    """Special token ids that fall outside the tiny vocab -> free ids at its top."""
    special = special_token_ids(tree)
    large = sorted(i for i in special if i >= TINY_VOCAB)
    free = [i for i in range(TINY_VOCAB - 1, -1, -1) if i not in special]
    return dict(zip(large, free))


def _remap_token_ids(tree: dict[str, Any], mapping: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = _remap_token_ids(value, mapping)
        elif isinstance(key, str) and key.endswith(TOKEN_ID_SUFFIXES) and mapping:
            out[key] = [mapping.get(v, v) for v in value] if isinstance(value, list) else mapping.get(value, value)
        else:
            out[key] = value
    return out


def special_token_ids(tree: Any) -> set[int]:
    found: set[int] = set()
    if isinstance(tree, dict):
        for key, value in tree.items():
            if isinstance(value, dict):
                found |= special_token_ids(value)
            elif isinstance(key, str) and key.endswith(TOKEN_ID_SUFFIXES):
                values = value if isinstance(value, list) else [value]
                found |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
    return found
