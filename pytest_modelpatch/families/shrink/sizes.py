"""The sizes every tiny config shrinks to, the config keys each applies to, and shrinking one key's int
(``configs.py`` and its per-modality rules)."""

from __future__ import annotations

from typing import Any, TypeGuard

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


def is_int(value: Any) -> TypeGuard[int]:
    """A config size: an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


LAYER_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "depth",
)
HEAD_KEYS = (
    "num_attention_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "decoder_num_attention_heads",
    "mamba_n_heads",
)
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
WIDTH_KEYS = (
    "hidden_size",
    "d_model",
    "n_embd",
    "n_embed",
    "embed_dim",
    "dim",
    "model_dim",
    "word_embed_proj_dim",
    "projection_dim",
    "out_hidden_size",
    "text_hidden_size",
    "encoder_hidden_size",
    "decoder_hidden_size",
    "output_hidden_size",
    "projector_hidden_size",
    "embedding_size",
    "vision_output_dim",
    "attention_hidden_size",
    "embedding_dim",
    "lru_width",
    "projection_size",
    "encoder_hidden_dim",
    "mask_feature_size",
    "fpn_feature_size",
    "fpn_hidden_size",  # detection / segmentation
    "adapter_in_dim",
    "adapter_out_dim",
    "adapter_input_size",  # projectors between towers (Dots3)
    "downsample_hidden_size",  # Qwen-Omni / Dots3 audio conv stem channels
    "projector_input_dim",
    "projector_output_dim",
    "image_token_embed_dim",
    "entity_emb_size",
    "pronunciation_embed_dim",
    "shape_embed_dim",  # LUKE, RoCBert side embeddings
)
# distilbert's ``hidden_dim`` is its feed-forward size
FFN_KEYS = (
    "intermediate_size",
    "ffn_dim",
    "n_inner",
    "d_ff",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "hidden_dim",
    "mlp_dim",
    "ffn_hidden_size",
    "intermediate_dim",
    "dim_feedforward",
    "encoder_feedforward_dim",
    "d_inner",
    "intermediate_size_mlp",
    "projection_intermediate_size",
    "alignment_intermediate_size",
)
MOE_FFN_KEYS = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "expert_intermediate_size",
    "shared_intermediate_size",
    "moe_ffn_hidden_size",
    "expert_ffn_hidden_size",
    "moe_hidden_size",
    "shared_experts_intermediate_size",
)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_top_k", "moe_k")
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_source_positions",
    "max_target_positions",
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


def shrink_int(key: str, value: int) -> int:
    """``value`` of config key ``key`` cut to its tiny size (unchanged for a key no size applies to)."""
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
