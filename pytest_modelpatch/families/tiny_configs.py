"""Shrink a config dict so any transformers family builds tiny and stays valid.

Pure dict work, no torch (per-family exceptions: ``rules/``): ``shrink_config_dict(config.to_dict(), overrides)`` keeps
grouped-query ratios, head sizes the rope settings depend on, per-layer lists sized
to the new layer count, experts and top-k, and special token ids inside the smaller
vocabulary; sub-configs (text, vision, audio) are shrunk the same way.
"""

from __future__ import annotations

from typing import Any

from pytest_modelpatch.families.rules import apply_config_rule
from pytest_modelpatch.families.tiny_audio_configs import shrink_audio_level
from pytest_modelpatch.families.tiny_sizes import (  # noqa: F401  (re-exported: tests and callers read them here)
    TINY_WIDTH,
    TINY_HEADS,
    TINY_LAYERS,
    TINY_INTERMEDIATE,
    TINY_MOE_INTERMEDIATE,
    TINY_VOCAB,
    TINY_POSITIONS,
    TINY_EXPERTS,
    TINY_TOP_K,
    TINY_SLIDING_WINDOW,
    TINY_IMAGE,
    TINY_PATCH,
    TINY_LORA_RANK,
    is_int,
)
from pytest_modelpatch.families.tiny_vision import fit_layout_embeddings, fit_stage_widths, shrink_vision_sizes
from pytest_modelpatch.families.tiny_consistency import TOKEN_ID_SUFFIXES, fit_feature_layers, rederive_defaults

# ---------------------------------------------------------------------------
# tiny configs
# ---------------------------------------------------------------------------

LAYER_KEYS = (
    "num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
     "num_encoder_layers", "num_decoder_layers", "depth",
)
HEAD_KEYS = (
    "num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
     "decoder_attention_heads", "decoder_num_attention_heads", "mamba_n_heads",
)
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
WIDTH_KEYS = (
    "hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "model_dim", "word_embed_proj_dim",
     "projection_dim", "out_hidden_size", "text_hidden_size", "encoder_hidden_size", "decoder_hidden_size",
     "output_hidden_size", "projector_hidden_size", "embedding_size", "vision_output_dim",
    "attention_hidden_size", "embedding_dim", "lru_width", "projection_size",
    "encoder_hidden_dim", "mask_feature_size", "fpn_feature_size", "fpn_hidden_size",  # detection / segmentation
    "adapter_in_dim", "adapter_out_dim", "adapter_input_size",  # projectors between towers (Dots3)
    "downsample_hidden_size",  # Qwen-Omni / Dots3 audio conv stem channels
    "projector_input_dim", "projector_output_dim", "image_token_embed_dim",
    "entity_emb_size", "pronunciation_embed_dim", "shape_embed_dim",  # LUKE, RoCBert side embeddings
)
# distilbert's ``hidden_dim`` is its feed-forward size
FFN_KEYS = (
    "intermediate_size", "ffn_dim", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim",
     "mlp_dim", "ffn_hidden_size", "intermediate_dim", "dim_feedforward", "encoder_feedforward_dim",
    "d_inner", "intermediate_size_mlp", "projection_intermediate_size", "alignment_intermediate_size",
)
MOE_FFN_KEYS = (
    "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
     "shared_intermediate_size", "moe_ffn_hidden_size",
    "expert_ffn_hidden_size", "moe_hidden_size", "shared_experts_intermediate_size",
)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_top_k", "moe_k")
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
POSITION_KEYS = (
    "max_position_embeddings", "n_positions", "n_ctx", "max_source_positions", "max_target_positions",
)
# Multi-head latent attention (DeepSeek V2/V3, ...) and linear attention (Qwen3-Next) sizes.
FIXED_SIZES: dict[str, int] = {
    "q_lora_rank": TINY_LORA_RANK,
    "kv_lora_rank": TINY_LORA_RANK,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": TINY_HEADS,  # Kimi delta attention: its CPU fallback is O(heads * dim * 64^2)
    "linear_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "n_group": 1,
    "num_expert_group": 1,  # Bailing's name for n_group
    "topk_group": 1,
    "n_groups": 1,  # Mamba2 state groups: must divide the (tiny) head count
    "emb_dim": TINY_WIDTH,  # XLM
    "hidden_size_per_layer_input": 16,  # Gemma 3n/4 per-layer embeddings
    "num_queries": 8,  # DETR-style object queries: RT-DETR picks them among the few anchors of a tiny image
}


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
    default (``None``/``"auto"``), with that default (``tiny_consistency.rederive_defaults``).
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
            out[key] = _shrink_int(key, value)
        elif isinstance(value, (list, tuple)) and value and all(map(is_int, value)):
            out[key] = _shrink_int_list(key, list(value))  # Swin V2 defaults are tuples
    shrink_vision_sizes(out)
    fit_layout_embeddings(out)
    _shrink_layers(level, out)
    _shrink_uncounted_layer_list(level, out)
    shrink_audio_level(level, out)
    if any(is_int(out.get(k)) for k in EXPERT_KEYS):
        # some defaults leave top-k unset (DeepSeek-V2) and the router then crashes
        for key in TOP_K_KEYS:
            if key in out and out[key] is None:
                out[key] = TINY_TOP_K
    apply_config_rule(level.get("model_type"), out)  # per-family rules: after the generic ones, before overrides
    plain = {k: v for k, v in overrides.items() if not (isinstance(v, dict) and _is_config_dict(k, out.get(k)))}
    _resize_per_layer_lists(out, plain)
    rederive_defaults(level, out, derived.get(str(level.get("model_type", "")), {}), set(plain))
    out.update(plain)
    _replace_timm_backbone(out, set(plain))
    _shrink_stage_widths(out, set(plain))
    _follow_channels(level, out, set(plain))
    _derive_head_sizes(level, out, set(plain), implicit_rope.get(str(level.get("model_type", "")), {}))
    _fit_windows(out, set(plain))
    fit_stage_widths(out, set(plain))
    return out


# Per-stage channel lists of hierarchical vision backbones (ResNet, ConvNeXt, PVT, ...).
STAGE_WIDTH_KEYS = (
    "hidden_sizes", "embed_dim", "embed_dims", "dims", "hidden_dims", "stage_in_channels", "stage_mid_channels",
    "stage_out_channels", "embed_dim_per_stage",
)
# Widest stage a tiny backbone keeps: ResNet-50's [256, ..., 2048] become [32, ..., 256]
# (bottlenecks a quarter as wide: 8 channels), about 0.4M parameters.
TINY_STAGE_WIDTH = 256


def _shrink_stage_widths(out: dict[str, Any], fixed: set[str]) -> None:
    """Divide every per-stage width list of a level by one power of two, so the widest
    stage is at most ``TINY_STAGE_WIDTH``; one divisor for all lists keeps the equalities
    between them (HGNet's stage ``i + 1`` input is stage ``i``'s output) and every
    divisibility by a power of two (heads, groups) that held before."""
    lists = {k: out[k] for k in STAGE_WIDTH_KEYS if k not in fixed and _is_int_list(out.get(k)) and len(out[k]) > 1}
    widest = max((max(v) for v in lists.values()), default=0)
    divisor = 1
    while widest // divisor > TINY_STAGE_WIDTH and all(v % (divisor * 2) == 0 for vs in lists.values() for v in vs):
        divisor *= 2
    for key, values in lists.items():
        out[key] = [v // divisor for v in values]
    if divisor > 1:
        _divide_stem(out, lists, divisor, fixed)
    # Swin-style single embedding widths: tiny_vision.fit_stage_widths


# A transformers ResNet in place of a timm one (timm needs torchvision, which often cannot
# be installed beside a given torch); DETR-style configs build either. Stage indices
# mean the same in both ("stem", then stages 1-4).
TINY_RESNET_BACKBONE: dict[str, Any] = {
    "model_type": "resnet", "embedding_size": 32, "hidden_sizes": [32, 64, 128, 256], "depths": [1, 1, 1, 1],
}


def _replace_timm_backbone(out: dict[str, Any], fixed: set[str]) -> None:
    """Swap a ``timm_backbone`` sub-config for a tiny transformers ResNet, same outputs."""
    backbone = out.get("backbone_config")
    if "backbone_config" in fixed or not (isinstance(backbone, dict) and backbone.get("model_type") == "timm_backbone"):
        return
    indices = backbone.get("out_indices") or [4]
    out["backbone_config"] = {**TINY_RESNET_BACKBONE, "num_channels": backbone.get("num_channels", 3),
                              "out_indices": list(indices)}
    if "use_timm_backbone" in out:
        out["use_timm_backbone"] = False
    if out.get("backbone") is not None:
        out["backbone"] = None  # a timm model name: with a backbone_config it must be unset


def _divide_stem(out: dict[str, Any], lists: dict[str, list[int]], divisor: int, fixed: set[str]) -> None:
    """The stem feeds the first stage, so its widths shrink by the same divisor
    (TextNet: ``stem_out_channels == hidden_sizes[0]``; HGNet: ``stem_channels`` =
    [image channels, ..., first stage's input])."""
    firsts = {v[0] for v in lists.values()}
    for key, value in list(out.items()):
        if "stem" not in str(key) or key in fixed:
            continue
        if is_int(value) and value in firsts and value % divisor == 0:
            out[key] = value // divisor
        elif _is_int_list(value) and len(value) > 1 and all(v % divisor == 0 for v in value[1:]):
            out[key] = [value[0], *(v // divisor for v in value[1:])]


def _follow_channels(before: dict[str, Any], out: dict[str, Any], fixed: set[str]) -> None:
    """Per-level channel lists a detector derives from other sizes (RT-DETR): the encoder
    reads the backbone's stages at ``out_indices``; the decoder reads the encoder width."""
    for key, value in before.items():
        if not (str(key).endswith("_in_channels") and _is_int_list(value)) or key in fixed:
            continue
        followed = next(
            (w for w in WIDTH_KEYS if is_int(before.get(w)) and before[w] != out.get(w) and set(value) == {before[w]}),
            None,
        )
        if followed is not None:
            out[key] = [out[followed]] * len(value)
    backbone = out.get("backbone_config")
    if "encoder_in_channels" in before and "encoder_in_channels" not in fixed and isinstance(backbone, dict):
        sizes, indices = backbone.get("hidden_sizes"), backbone.get("out_indices")
        if _is_int_list(sizes) and _is_int_list(indices) and len(indices) == len(before["encoder_in_channels"]):
            out["encoder_in_channels"] = [sizes[i - 1] for i in indices]  # index 0 is the stem


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(map(is_int, value))


def _fit_windows(out: dict[str, Any], fixed: set[str]) -> None:
    """Swin-style stages halve the patch grid each time; every stage's grid must hold a
    window, or the relative-position tables (sized by the window) stop matching."""
    depths, window, image = out.get("depths"), out.get("window_size"), out.get("image_size")
    if not (isinstance(depths, list) and is_int(window) and is_int(image) and is_int(out.get("patch_size"))):
        return
    if "window_size" not in fixed:
        out["window_size"] = window = min(window, 2)
    if "patch_size" not in fixed:
        out["patch_size"] = max(1, min(out["patch_size"], image // (window * 2 ** (len(depths) - 1))))


def _shrink_int_list(key: str, values: list[int]) -> list[int]:
    """Per-stage lists of hierarchical vision models (Swin: depths, heads per stage)."""
    if key in ("image_size", "patch_size"):
        return [_shrink_int(key, v) for v in values]
    if key in HEAD_KEYS:
        return [TINY_HEADS] * len(values)  # every stage width (64 * 2**i) divides by it
    if key in ("depths", "depth"):  # CvT: depth per stage
        return [min(v, TINY_LAYERS) for v in values]
    if key in FFN_KEYS or key in MOE_FFN_KEYS:
        return [_shrink_int(key, v) for v in values]  # per-layer feed-forward sizes (Gemma 3n)
    return values


def _shrink_int(key: str, value: int) -> int:
    if key in WIDTH_KEYS:
        return min(value, TINY_WIDTH) if value > 0 else value
    if key in FFN_KEYS:
        return min(value, TINY_INTERMEDIATE) if value > 0 else value
    if key in MOE_FFN_KEYS:
        return min(value, TINY_MOE_INTERMEDIATE) if value > 0 else value
    if key in HEAD_KEYS:
        return min(value, TINY_HEADS)
    if key in EXPERT_KEYS:
        return min(value, TINY_EXPERTS)
    if key in TOP_K_KEYS:
        return min(value, TINY_TOP_K)
    if key in SHARED_EXPERT_KEYS:
        return min(value, 1)
    if key in POSITION_KEYS:
        return min(value, TINY_POSITIONS)
    # side vocabularies too: FSMT's src/tgt, LUKE's entities, RoCBert's shapes and pronunciations
    if key in ("vocab_size", "n_words", "vocab_size_per_layer_input") or key.endswith("_vocab_size"):
        return min(value, TINY_VOCAB)
    if key in ("sliding_window", "attention_window_size") and value > 0:
        return min(value, TINY_SLIDING_WINDOW)
    if key == "image_size":
        return min(value, TINY_IMAGE)
    if key == "patch_size" and value > TINY_PATCH:
        return TINY_PATCH
    if key in FIXED_SIZES and value > 0:
        return min(value, FIXED_SIZES[key])
    return value


def _shrink_layers(before: dict[str, Any], out: dict[str, Any]) -> None:
    """Cut the layer count; keep one layer of each kind named in per-layer lists."""
    stages = before.get("depths")
    counts = {
        k: v for k, v in before.items() if k in LAYER_KEYS and is_int(v) and v > TINY_LAYERS
        # a hierarchical backbone's stage count: detection heads expect every level
        and not (isinstance(stages, (list, tuple)) and v == len(stages))
    }
    if not counts:
        return
    old = max(counts.values())
    per_layer = {k: v for k, v in before.items() if isinstance(v, (list, tuple)) and len(v) == old and old > 1}
    keep = _layers_to_keep(per_layer, old)
    keep = _cover_block_pattern(before, old, keep)
    for key, value in counts.items():
        out[key] = len(keep) if value == old else TINY_LAYERS
    for key, value in per_layer.items():
        shrunk = out.get(key)  # already shrunk per entry (heads per stage), when it could be
        source = shrunk if isinstance(shrunk, list) and len(shrunk) == len(value) else value
        out[key] = [source[i] for i in keep]
    n = len(keep)
    if isinstance(before.get("stage_names"), list) and len(before["stage_names"]) == old + 1:
        # backbones: "stem" plus a name per stage; keep as many of the last stages as
        # were wanted (detection heads read several feature levels).
        names = out["stage_names"] = before["stage_names"][: n + 1]
        wanted = len(before.get("out_indices") or before.get("out_features") or [None])
        out["out_indices"] = list(range(n + 1 - min(wanted, n), n + 1))
        out["out_features"] = [names[i] for i in out["out_indices"]]
    elif "stage_names" in before:
        out["out_features"] = out["out_indices"] = None  # let the default (last stage) apply
    if isinstance(before.get("per_layer_config"), dict):
        out["per_layer_config"] = _keep_layer_entries(before["per_layer_config"], keep)
    for key in ("first_k_dense_replace", "max_window_layers"):
        if is_int(before.get(key)):
            out[key] = min(before[key], 1 if key == "first_k_dense_replace" else n)
    if is_int(before.get("decoder_sparse_step")) and before["decoder_sparse_step"] > n:
        out["decoder_sparse_step"] = 1
    for key, value in before.items():
        # Jamba-style schedules: layer i is special when i % period == offset
        if is_int(value) and str(key).endswith("_layer_period"):
            out[key] = min(value, n)
        elif is_int(value) and str(key).endswith("_layer_offset"):
            out[key] = min(value, n - 1)
        elif is_int(value) and str(key).endswith(("_layer_id", "_layer_idx")) and 0 <= value < old:
            out[key] = value * n // old  # MiniCPM-V's merger insert point: still inside the stack
    for key, value in before.items():
        # lists of layer indices (mlp_only_layers, global_attn_indexes, ...): scale into range
        if str(key).endswith(("_layers", "_indexes")) and isinstance(value, list) and key not in per_layer:
            if all(is_int(i) and 0 <= i < old for i in value):
                out[key] = sorted({i * n // old for i in value})


def _shrink_uncounted_layer_list(before: dict[str, Any], out: dict[str, Any]) -> None:
    """A per-layer type list that is the only record of the depth (Nemotron-H's
    ``layers_block_type``, 52 long inside NeMo SpeechLM): keep the first layer of each kind."""
    if any(is_int(before.get(k)) for k in LAYER_KEYS):
        return
    for key in ("layers_block_type", "layer_types", "block_types"):
        value = before.get(key)
        if isinstance(value, list) and len(value) > TINY_LAYERS:
            out[key] = [value[i] for i in _layers_to_keep({key: value}, len(value))]


def _cover_block_pattern(before: dict[str, Any], old: int, keep: list[int]) -> list[int]:
    """Keep enough layers to reach every kind of a repeating block pattern (RecurrentGemma)."""
    for key, value in before.items():
        if str(key).endswith("block_types") and isinstance(value, list) and 0 < len(value) < old:
            wanted = min(len(value), 4)
            keep = sorted(set(keep) | set(range(wanted)))[: max(wanted, len(keep))]
    return keep


def _keep_layer_entries(per_layer: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """``per_layer_config`` entries of the kept layers, renumbered ("05" -> "1")."""
    kept: dict[str, Any] = {}
    for key, value in per_layer.items():
        if str(key).isdigit() and int(key) in keep:
            kept[str(keep.index(int(key)))] = _shrink_layer_entry(value) if isinstance(value, dict) else value
    return kept


def _shrink_layer_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """One layer's overrides (Dots3's wider indexed layers) shrunk like the config; kv heads
    that equalled the heads still do."""
    out = {k: _shrink_int(k, v) if is_int(v) else v for k, v in entry.items()}
    heads = next((k for k in HEAD_KEYS if is_int(entry.get(k))), None)
    for kv in KV_HEAD_KEYS:
        if heads is not None and is_int(entry.get(kv)) and entry[kv] >= entry[heads]:
            out[kv] = out[heads]
    return out


def _resize_per_layer_lists(shrunk: dict[str, Any], overrides: dict[str, Any]) -> None:
    """An overridden layer count resizes the per-layer lists it did not override, cyclically."""
    for key in LAYER_KEYS:
        old, new = shrunk.get(key), overrides.get(key)
        if not (is_int(old) and is_int(new)) or old == new:
            continue
        for name, value in shrunk.items():
            if isinstance(value, list) and len(value) == old and old > 1 and name not in overrides:
                shrunk[name] = [value[i % old] for i in range(new)]


def _layers_to_keep(per_layer: dict[str, list[Any]], old: int) -> list[int]:
    """Indices of the layers to keep: the first of each kind, then the earliest others."""
    keep: list[int] = []
    # layer_types decides first; other kind lists (Kimi's mlp_layer_types) add their kinds
    ordered = sorted(per_layer, key=lambda k: k != "layer_types")
    for position, key in enumerate(ordered):
        if position and not str(key).endswith(("layer_types", "block_type", "block_types")):
            continue
        seen: list[Any] = []
        for index, value in enumerate(per_layer[key]):
            if value not in seen and len(keep) < 4:
                seen.append(value)
                if index not in keep:
                    keep.append(index)
    for index in range(old):
        if len(keep) >= TINY_LAYERS:
            break
        if index not in keep:
            keep.append(index)
    return sorted(keep)


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
    if is_int(expand) and before.get(heads_key, 0) * (before.get("head_dim") or 0) == before.get(
        next(k for k in WIDTH_KEYS if k in before), 0
    ) * expand:
        head_dim = width * expand // heads  # Mamba2: heads * head_dim == hidden_size * expand
    for key in ("head_dim", "d_kv", "attention_head_size", "query_pre_attn_scalar"):
        if is_int(before.get(key)) and before[key] > 0 and key not in fixed:
            out[key] = head_dim
    if "head_dim" in before and before["head_dim"] is None and "head_dim" not in fixed:
        out["head_dim"] = head_dim  # some modeling code reads it without a fallback (Ministral)
    rope_dim = before.get("qk_rope_head_dim")
    if is_int(rope_dim) and before.get("head_dim") == rope_dim and "head_dim" not in fixed:
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA models rotate only the rope part
    head_dim = out.get("head_dim") if is_int(out.get("head_dim")) else head_dim
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
