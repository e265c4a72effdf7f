"""Per-family rules for what the generic shrinking in ``tiny_configs.py`` cannot derive.

Keyed by ``model_type``; a rule applies to every config level of that type (a top-level
config or a sub-config), after generic shrinking and before the user's overrides, which
always win. A rule is either a dict of values to set or a function that edits the shrunk
level in place. Each entry says why the generic rules are not enough; prefer teaching
``tiny_configs.py`` a general rule over adding an entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

ConfigRule = Mapping[str, Any] | Callable[[dict[str, Any]], None]



def _fused_semantic_width(key: str, width_of: str) -> Callable[[dict[str, Any]], None]:
    """X-Codec style: ``key`` is the width of the semantic and acoustic features concatenated.

    The config stores it as a plain number (1024 + 1024 = 2048 in X-Codec 2), so generic
    shrinking cannot see that it is a sum of two sub-config widths.
    """

    def rule(level: dict[str, Any]) -> None:
        acoustic = level.get(width_of) if width_of != "hidden_size" else level
        semantic = level.get("semantic_model_config") or {}
        if isinstance(acoustic, dict) and "hidden_size" in acoustic and "hidden_size" in semantic:
            level[key] = acoustic["hidden_size"] + semantic["hidden_size"]

    return rule


def _dia_cross_attention(level: dict[str, Any]) -> None:
    """Dia's decoder cross-attends with sizes of the encoder, stored under ``cross_*`` names."""
    encoder, decoder = level.get("encoder_config"), level.get("decoder_config")
    if isinstance(encoder, dict) and isinstance(decoder, dict):
        decoder["cross_hidden_size"] = encoder["hidden_size"]
        decoder["cross_num_attention_heads"] = decoder["cross_num_key_value_heads"] = encoder["num_attention_heads"]
        decoder["cross_head_dim"] = encoder["head_dim"]


CONFIG_RULES: dict[str, ConfigRule] = {
    # X-Codec: codebook_dim == acoustic (DAC) width + semantic (HuBERT) width
    "xcodec": _fused_semantic_width("codebook_dim", "acoustic_model_config"),
    # X-Codec 2 / NeuCodec: the quantizer projects the concatenated features, hidden_size + semantic width
    "xcodec2": _fused_semantic_width("quantization_dim", "hidden_size"),
    "neucodec": _fused_semantic_width("quantization_dim", "hidden_size"),
    # per-stage widths under a name (hidden_sizes) generic shrinking leaves to vision backbones;
    # 256..2048 channels make 100M parameters. Doubling per stage, ending at the tiny width.
    "muse_spark_audio": {"hidden_sizes": [8, 16, 32, 64]},
    # The forward samples with torch.randn scaled by these (a VAE latent, VITS' flow and
    # duration noise), so two runs of the same weights differ; at zero they agree and every
    # layer still runs.
    "vibevoice_acoustic_tokenizer": {"vae_std": 0.0},
    # (VITS: its layer counts have names of their own, 16 posterior WaveNet layers)
    "vits": {"noise_scale": 0.0, "noise_scale_duration": 0.0, "posterior_encoder_num_wavenet_layers": 2},
    # Qwen3-ASR's conv stem widths and output projection have names of their own
    # (downsample_hidden_size 480: 4M of conv weights; output_dim: the LM width it feeds)
    "qwen3_asr_encoder": {"downsample_hidden_size": 32, "output_dim": 64},
    "dia": _dia_cross_attention,
    # CLVP's rotary dimension is max(projection_dim // (2 * heads), 32): heads must be 32 wide
    "clvp_encoder": {"num_attention_heads": 2},
    # CLAP's Swin audio tower ends at patch_embeds_hidden_size * 2**(stages - 1), which the
    # projection reads as hidden_size (96 * 8 = 768 in the full config)
    "clap_audio_model": {"patch_embeds_hidden_size": 8},
    # AST: 1024 frames x 128 mel bins is 1212 patches; 64 x 32 with its 10-step stride is 10
    "audio-spectrogram-transformer": {"max_length": 64, "num_mel_bins": 32},
    # Perceiver's latent array has sizes of its own: 256 latents x 1280 wide, 26 self-attention
    # layers per block (260M parameters); heads must divide both d_latents and d_model
    "perceiver": {
        "num_latents": 16, "d_latents": 64, "num_self_attends_per_block": 2,
        "num_self_attention_heads": 4, "num_cross_attention_heads": 4,
    },
    # transformers 5.23: the decoder layer reads config.num_key_value_heads, which
    # MoonshineStreamingConfig does not define, so even the default config cannot build;
    # set to the head count: plain multi-head attention
    "moonshine_streaming": {"num_key_value_heads": 4},
    # kernel predictor: hidden x hidden x kernel weights per resblock layer (14.8M at 32/64)
    "univnet": {"model_hidden_channels": 8, "kernel_predictor_hidden_channels": 16, "model_in_channels": 16},
}


def apply_config_rule(model_type: Any, level: dict[str, Any]) -> None:
    """Apply the rule for ``model_type`` (if any) to one shrunk config level, in place."""
    rule = CONFIG_RULES.get(model_type) if isinstance(model_type, str) else None
    if rule is None:
        return
    if callable(rule):
        rule(level)
    else:
        level.update(rule)
