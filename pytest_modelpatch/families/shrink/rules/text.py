"""Config rules for text decoders, hybrid/recurrent decoders and composite models (see ``rules``).

Each rule says why generic shrinking cannot derive it; most are defaults the config class
leaves ``None`` that released checkpoints set, or hybrid schedules whose shrunk form
must still hold each kind of layer.
"""

from __future__ import annotations

from typing import Any

from pytest_modelpatch.families.shrink.consistency import TOKEN_ID_SUFFIXES

_CODEBOOK = 32  # VQ image tokenizers: tiny codebooks keep the image tokens inside the tiny vocabulary
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _rope_per_layer_type(level: dict[str, Any]) -> None:
    # Cohere Compass' default rope_parameters is {} though its rotary reads one entry per layer type.
    kinds = set(level.get("layer_types") or ["full_attention"])
    rope = level.get("rope_parameters") or {}
    level["rope_parameters"] = {kind: dict(rope.get(kind) or _DEFAULT_ROPE) for kind in kinds}


def _hunyuan_vl_mrope(level: dict[str, Any]) -> None:
    # HunYuan-VL rotates with >= 3 multimodal axes summing to head_dim // 2; the default config has none.
    half = max(4, int(level.get("head_dim") or 16) // 2)
    level["rope_parameters"] = {**(level.get("rope_parameters") or _DEFAULT_ROPE), "mrope_section": [half // 4] * 4}


def _dbrx_rope(level: dict[str, Any]) -> None:
    # DbrxAttention reads attn_config.rope_theta, which the attention sub-config no longer declares (5.x).
    # clip_qkv: the attention clamps with it unconditionally; DBRX checkpoints use 8.
    if isinstance(level.get("attn_config"), dict):
        level["attn_config"].setdefault("rope_theta", (level.get("rope_parameters") or _DEFAULT_ROPE)["rope_theta"])
        level["attn_config"]["clip_qkv"] = level["attn_config"].get("clip_qkv") or 8.0


def _chameleon_vocabulary(level: dict[str, Any]) -> None:
    # The VQ-image-token <-> BPE map ships with the checkpoint's tokenizer (config default None);
    # build one over the tiny codebook, at the top of the tiny vocabulary.
    vocab = int(level["vocab_size"])
    image = level.get("image_token_id") or vocab - _CODEBOOK - 1
    level["image_token_id"] = image
    digits = {str(i): chr(ord("A") + i) for i in range(10)}
    codes = {f"IMGIMG{''.join(digits[c] for c in str(i))}Z": vocab - _CODEBOOK + i for i in range(_CODEBOOK)}
    level["vocabulary_map"] = {"<image>": image, **codes}


def _emu3_vocabulary(level: dict[str, Any]) -> None:
    # As Chameleon: Emu3's image-token map ships with the tokenizer; <|extra_200|> ends an image row.
    vocab = int(level["text_config"]["vocab_size"])
    image = level.get("image_token_id") or vocab - _CODEBOOK - 1
    level["image_token_id"] = image
    codes = {f"<|visual token{i:06d}|>": vocab - _CODEBOOK + i for i in range(_CODEBOOK)}
    level["vocabulary_map"] = {"<image>": image, "<|extra_200|>": vocab - _CODEBOOK - 2, **codes}


def _zamba2_rederive(level: dict[str, Any]) -> None:
    # __post_init__ derives these from hidden_size and the block schedule, then to_dict's
    # full-size copies, passed back as kwargs, overwrite them: drop them so they are derived again.
    for key in ("attention_hidden_size", "attention_head_dim", "mamba_headdim", "kv_channels", "num_query_groups",
                "hybrid_layer_ids"):  # fmt: skip
        level.pop(key, None)


def _image_placeholder(level: dict[str, Any]) -> None:
    # BLIP-2-style models splice the Q-Former output at image_token_index placeholders; the
    # default is None (legacy prepend path, broken in 5.x) while checkpoints add a token.
    vocab = int(level["text_config"]["vocab_size"])
    taken = {v for v in _token_ids(level)}
    keys = ("video_token_index", "video_token_id", "image_token_index", "image_token_id")
    key = next(k for k in keys if k in level)
    if level.get(key) is None:
        level[key] = max(i for i in range(vocab) if i not in taken)


def _token_ids(tree: dict[str, Any]) -> list[int]:
    found: list[int] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            found += _token_ids(value)
        elif str(key).endswith(TOKEN_ID_SUFFIXES) and isinstance(value, int):
            found.append(value)
    return found


def _deepseek_vl_hybrid(level: dict[str, Any]) -> None:
    # The SAM high-res branch's projection convs widen output_channels 2x and 4x; 256 (SAM's
    # neck) alone makes a 6M-parameter projector.
    if isinstance(level.get("high_res_vision_config"), dict):
        level["high_res_vision_config"]["output_channels"] = 32


# A VQ-GAN image tokenizer at 32x32: two resolution levels, narrow channels (GroupNorm has 32
# groups), a tiny codebook.
_TINY_VQGAN = {
    "base_channels": 32, "channel_multiplier": [1, 2], "num_res_blocks": 1, "latent_channels": 8,
    "resolution": 32, "attn_resolutions": [],
}  # fmt: skip

TEXT_CONFIG_RULES: dict[str, Any] = {
    # Default is all-Mamba; real Bamba checkpoints interleave attention, and an all-Mamba cache
    # cannot answer the mask's get_seq_length (5.23).
    "bamba": {"attn_layer_indices": [1]},
    # Same: the default schedule has no attention layer at all.
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "cohere_compass_text": _rope_per_layer_type,
    "hunyuan_vl_text": _hunyuan_vl_mrope,
    "dbrx": _dbrx_rope,
    # Expert counts default to None (released checkpoints set them).
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "diffusion_gemma_text": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64},
    # ESM's vocab_size and pad id default to None; ESM-2 has 33 tokens, <pad> = 1, <mask> = 32.
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    # Per-layer schedules that default to None: one layer of each kind.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    # "indexed_attention" layers need the QSA indexer, whose sizes default to None.
    "qwen4_exp_text": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # Sliding layers but no sliding_window in the default text config.
    "step3p5": {"sliding_window": 4},  # configs.TINY_SLIDING_WINDOW
    # T5Gemma2's MLP reads dropout_rate, which the text config does not declare.
    "t5gemma2_text": {"dropout_rate": 0.0},
    # Zamba ties the shared transformer of the first hybrid layer to the others: it needs two.
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": _zamba2_rederive,
    # qk_dim rounds hidden_size * qk_dim_factor up to a multiple of 64 for the cache but not for
    # the layer; at hidden_size 64 only a factor of 1 keeps the two equal.
    "xlstm": {"qk_dim_factor": 1.0},
    # The last num_kv_shared_layers layers reuse the cache of an earlier layer of their type:
    # four layers, the last two sharing, keep one producer of each type.
    "gemma3n_text": {
        "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
        "intermediate_size": [128] * 4, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    # 64 image positions made the example sequence 72 tokens long: 8 latent queries exercise the same path.
    "kosmos-2": {"latent_query_num": 8},
    "blip-2": _image_placeholder,
    "instructblip": _image_placeholder,
    "instructblipvideo": _image_placeholder,
    # The thinker's rope index reads vision start/end ids that only the whole-omni config declares;
    # released thinker configs carry them (Qwen2 ids, moved into the tiny vocabulary with the rest).
    "qwen2_5_omni_thinker": {"vision_start_token_id": 151652, "vision_end_token_id": 151653},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652, "vision_end_token_id": 151653},
    # SAM-style high-resolution encoders: a neck of output_channels, then two stride-2 convs widening
    # to downsample_channels; the last must be the next encoder's width (tiny: 64).
    "deepseek_ocr2_sam_vision_model": {"output_channels": 32, "downsample_channels": [64, 64]},
    "unlimited_ocr_sam_vision_model": {"output_channels": 32, "downsample_channels": [64, 64]},
    "deepseek_vl_hybrid": _deepseek_vl_hybrid,
    # DaViT stages: widths per stage (each divisible by its heads and channel groups); a list the
    # width rule does not shrink.
    "florence_vision": {"embed_dim": [16, 32, 48, 64]},
    # Conformer sizes under names of their own; 24 blocks (muse_spark_audio: rules/__init__.py).
    "phi4_multimodal_audio": {
        "num_blocks": 2, "ext_pw_out_channel": 64, "depthwise_separable_out_channel": 64, "nemo_conv_channels": 64,
    },
    # Deep-stack projector: (vision layer, LLM layer) pairs (default None) and four spatial groups
    # (default LLM layers 12..21), indices into the tiny 2-layer towers; the Q-Former's window
    # rate defaults to None, which the projector cannot split.
    "granite4_vision": {
        "deepstack_layer_map": [[0, 0], [1, 1]], "spatial_target_layers": [0, 1, 0, 1], "downsample_rate": "1/2",
    },
    # BLT: the forward builds its cache from the top config, which has no layer count (5.23), so
    # run without one; the n-gram hash tables (500k rows) and the global width have names of their own.
    "blt": {"use_cache": False, "encoder_hash_byte_group_vocab": 512, "local_attention_window_len": 4},
    "blt_local_encoder": {"hidden_size_global": 64},
    "blt_local_decoder": {"hidden_size_global": 64},
    "chameleon": _chameleon_vocabulary,
    "chameleon_vqgan": {**_TINY_VQGAN, "num_embeddings": _CODEBOOK},
    "emu3": _emu3_vocabulary,
    "janus_vqgan": {**_TINY_VQGAN, "num_embeddings": _CODEBOOK},
    "emu3_vqgan": {**_TINY_VQGAN, "codebook_size": _CODEBOOK},
    # Axial position embeddings: their dims must sum to hidden_size, the shape covers the positions;
    # chunk lengths must divide the example sequence.
    "reformer": {
        "axial_pos_embds_dim": [16, 48], "axial_pos_shape": [8, 16], "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4, "num_buckets": 2,
    },
}  # fmt: skip
