"""Shrinking rules for audio configs: codecs, codebooks, audio front ends, time series.

Called by ``configs._shrink_level`` on every config level after the generic rules
(pure dict work, no torch). Codec convolution stacks double their channels at every
down-sampling stage, so the base channel count is what keeps them tiny; sizes that equal
the codec's width in the full config (codebook dimension, up-sampling groups) keep
equalling it, because the modeling code feeds one into the other.
"""

from __future__ import annotations

from typing import Any

from pytest_modelpatch.families.shrink.sizes import TINY_INTERMEDIATE

TINY_CODEC_TOP_CHANNELS = 128  # channels after the last down-sampling stage
TINY_CODEBOOK_SIZE = 256  # entries per codebook, the tiny vocabulary's size (codes are tokens to LMs)
TINY_CODEBOOKS = 4
TINY_VOCODER_CHANNELS = 32
PREFIXED_FFN_SUFFIXES = ("_intermediate_size", "_ffn_dim", "linear_units")
PREFIXED_VOCAB_SUFFIXES = ("_vocab_size",)
# embedding and predictor widths of vocoders and variance adaptors
PREFIXED_WIDTH_SUFFIXES = ("_embed_dim", "_predictor_channels", "_postnet_units", "backbone_hidden_size")
TINY_PART_WIDTH = 64
# depths of one part: SeamlessM4T's speech_encoder_layers (24), VITS' prior_encoder_num_flows,
# FastSpeech2's encoder_config {"layers": 4}
PREFIXED_DEPTH_SUFFIXES = ("_layers", "_num_flows")
TINY_PART_DEPTH = 2
TINY_HORIZON = 4  # forecast steps
TINY_CONTEXT = 32  # history steps (PatchTST-style models split it into patches)
TINY_FEATURE_CHANNELS = 32  # wav2vec2-style conv feature encoder channels
CODEC_RATIO_KEYS = ("downsampling_ratios", "upsampling_ratios", "strides")
# channel counts at the input end of a codec's encoder, doubled per stage
CODEC_BASE_CHANNEL_KEYS = ("num_filters", "encoder_hidden_size", "n_filters", "base_channels")
# codebook counts that an LM over the codes must agree on (Mimi num_quantizers == CSM num_codebooks)
CODEBOOK_COUNT_KEYS = ("num_quantizers", "n_codebooks", "num_codebooks", "n_q")
# sizes that equal the codec width in released configs, because the model chains them
FOLLOW_WIDTH_KEYS = ("codebook_dim", "upsample_groups", "vector_quantization_hidden_dimension")
WIDTH_KEY = "hidden_size"


def is_codec_level(level: dict[str, Any]) -> bool:
    """A neural audio codec (EnCodec, DAC, Mimi, ...): strided conv stages named by their ratios."""
    return any(isinstance(level.get(k), list) and level[k] for k in CODEC_RATIO_KEYS[:2])


def shrink_audio_level(before: dict[str, Any], out: dict[str, Any]) -> None:
    """Shrink one config level's codec and codebook sizes in place (``before``: the unshrunk level)."""
    if is_codec_level(before):
        _shrink_codec(before, out)
    for key in CODEBOOK_COUNT_KEYS:
        # on every level: a codec and the LM over its codes (CSM, MusicGen, Dia) must agree
        if _pos_int(before.get(key)):
            out[key] = min(before[key], TINY_CODEBOOKS)
    _shrink_prefixed_sizes(before, out)
    if _pos_int(before.get("upsample_initial_channel")):
        # HiFi-GAN vocoders (VITS, SpeechT5, FastSpeech2, SeamlessM4T): channels halve per
        # up-sampling stage from this, and the resblocks at full width are most of the model
        out["upsample_initial_channel"] = min(before["upsample_initial_channel"], TINY_VOCODER_CHANNELS)
    if "prediction_length" in before:
        _shrink_forecaster(before, out)
    if isinstance(before.get("conv_dim"), list) and isinstance(before.get("conv_stride"), list):
        # wav2vec2-style feature encoders: 7 conv layers of 512 channels are most of a tiny model
        out["conv_dim"] = [min(v, TINY_FEATURE_CHANNELS) for v in before["conv_dim"]]


def _shrink_codec(before: dict[str, Any], out: dict[str, Any]) -> None:
    stages = max(len(before.get(k) or ()) for k in CODEC_RATIO_KEYS[:2])
    base = max(2, TINY_CODEC_TOP_CHANNELS >> stages)  # channels double at every stage
    for key in CODEC_BASE_CHANNEL_KEYS:
        if _pos_int(before.get(key)):
            out[key] = min(before[key], base)
    if _pos_int(before.get("codebook_size")):
        out["codebook_size"] = min(before["codebook_size"], TINY_CODEBOOK_SIZE)
    old_width, new_width = before.get(WIDTH_KEY), out.get(WIDTH_KEY)
    for key in FOLLOW_WIDTH_KEYS:
        if not _pos_int(before.get(key)):
            continue
        if before[key] == old_width and _pos_int(new_width):
            out[key] = new_width
        else:
            out[key] = min(before[key], new_width if _pos_int(new_width) else before[key])


def _shrink_prefixed_sizes(before: dict[str, Any], out: dict[str, Any]) -> None:
    """Sizes of one part of a speech model, named with its prefix (SeamlessM4T's
    ``t2u_encoder_ffn_dim``, ``speech_encoder_intermediate_size``; FastSpeech2's
    ``encoder_linear_units``), which the generic key lists do not name."""
    for key, value in before.items():
        if not (_pos_int(value) and isinstance(key, str) and key in out and out[key] == value):
            continue  # already shrunk by a generic rule, or not a size
        if key.endswith(PREFIXED_FFN_SUFFIXES):
            out[key] = min(value, TINY_INTERMEDIATE)
        elif key.endswith(PREFIXED_VOCAB_SUFFIXES):
            out[key] = min(value, TINY_CODEBOOK_SIZE)
        elif key.endswith(PREFIXED_WIDTH_SUFFIXES):
            out[key] = min(value, TINY_PART_WIDTH)
        elif key.endswith("_max_position_embeddings"):
            out[key] = min(value, TINY_INTERMEDIATE)
        elif (key == "layers" or key.endswith(PREFIXED_DEPTH_SUFFIXES)) and not _counts_a_list(before, key, value):
            out[key] = min(value, TINY_PART_DEPTH)
    hifigan = isinstance(before.get("upsample_rates"), list)  # UnivNet's resblock lists are its stages
    if hifigan and _is_list_of_lists(before.get("resblock_dilation_sizes")) and before.get("resblock_kernel_sizes"):
        # HiFi-GAN: one residual block per kernel size at every up-sampling stage; one is enough
        out["resblock_kernel_sizes"] = before["resblock_kernel_sizes"][:1]
        out["resblock_dilation_sizes"] = before["resblock_dilation_sizes"][:1]


def _counts_a_list(level: dict[str, Any], key: str, value: int) -> bool:
    """Whether a ``num_*`` count may be the length of a per-layer list (wav2vec2's
    ``num_feat_extract_layers`` == ``len(conv_dim)``)."""
    return key.startswith("num_") and any(isinstance(v, list) and len(v) == value for v in level.values())


def _is_list_of_lists(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, list) for v in value)


def _shrink_forecaster(before: dict[str, Any], out: dict[str, Any]) -> None:
    """Forecasting horizons: GluonTS-style configs leave them unset and refuse to build."""
    if before.get("prediction_length") is None:
        out["prediction_length"] = TINY_HORIZON
    for key, tiny in (("context_length", TINY_CONTEXT), ("horizon_length", TINY_HORIZON)):
        if _pos_int(before.get(key)):
            out[key] = min(before[key], tiny)
    if _pos_int(before.get("label_length")):
        out["label_length"] = min(before["label_length"], out.get("context_length") or TINY_HORIZON)


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
