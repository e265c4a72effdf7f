"""Audio inputs: log-mel ``input_features`` and raw ``input_values`` waveforms, at the shrunk sizes.

The audio settings may live on the config itself or on a sub-config (``audio_config``,
``encoder_config``, ...): ``audio_level`` finds the one that has them. Feature layout is
(batch, frames, features) for conformer-style encoders, (batch, mel bins, frames) for
Whisper-style convolution stems; codecs take (batch, channels, samples) waveforms whose
length is a whole number of codec frames.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_request_inputs

WAVEFORM_SAMPLES = 4000
FEATURE_FRAMES = 64  # enough for 8x conformer subsampling to leave several frames
CODEC_FRAMES = 4  # codec frames per example waveform

# per-frame feature width, first key found wins
FEATURE_WIDTH_KEYS = ("feature_projection_input_dim", "input_feat_size", "num_mel_bins", "n_mels", "feature_size")
# Whisper-style stems: conv1d over mel bins, so features are (batch, mel bins, frames)
MEL_FIRST = frozenset(
    {"whisper", "glmasr_encoder", "voxtral_realtime_encoder", "audioflamingo3_encoder", "qwen3_asr_encoder"}
)
# feature widths fixed in the modeling code, as a multiple of the config's mel bins
FEATURE_WIDTH_FACTOR: dict[str, int] = {
    "granite_speech5_encoder": 4,  # transformers 5.23: ``nn.Linear(config.num_mel_bins * 4, ...)``
}
# model types whose feature extractor has a fixed width the config does not record
FEATURE_WIDTH_DEFAULT: dict[str, int] = {"gemma4_audio": 128}
CODEC_KEYS = ("upsampling_ratios", "downsampling_ratios", "hop_length", "audio_channels", "patch_sizes")
# masks the audio encoders read as "1 = a real frame"
FRAME_MASKS = ("input_features_mask", "attention_mask", "padding_mask")


def audio_level(config: PretrainedConfig) -> PretrainedConfig:
    """The (sub-)config that holds the audio front end's settings (depth first, in attribute order)."""
    keys = FEATURE_WIDTH_KEYS + CODEC_KEYS + ("channels",)
    if any(getattr(config, k, None) is not None for k in keys) or config.model_type in FEATURE_WIDTH_DEFAULT:
        return config
    subs = [v for k, v in vars(config).items() if isinstance(v, PretrainedConfig) and not k.startswith("text")]
    for sub in subs:
        level = audio_level(sub)
        if level is not sub or any(getattr(sub, k, None) is not None for k in keys):
            return level
    return config


def feature_width(level: PretrainedConfig) -> int | None:
    """Features per frame: mel bins, times the frames some encoders stack."""
    if _int(getattr(level, "input_feat_per_channel", None)):
        return level.input_feat_per_channel * getattr(level, "input_channels", 1)  # Speech2Text
    width = next((getattr(level, k) for k in FEATURE_WIDTH_KEYS if _int(getattr(level, k, None))), None)
    width = width or FEATURE_WIDTH_DEFAULT.get(level.model_type)
    if width is None:
        return None
    return width * getattr(level, "num_stacked_frames", 1) * FEATURE_WIDTH_FACTOR.get(level.model_type, 1)


def mel_first(level: PretrainedConfig) -> bool:
    """Whisper-derived encoders (a ``max_source_positions`` table) keep Whisper's layout."""
    time_first = any(_int(getattr(level, k, None)) for k in ("feature_projection_input_dim", "input_feat_per_channel"))
    return level.model_type in MEL_FIRST or (_int(getattr(level, "max_source_positions", None)) and not time_first)


def feature_frames(level: PretrainedConfig) -> int:
    """Frames of the example features, as many as the encoder's framing allows."""
    if _int(getattr(level, "n_window", None)):
        return 2 * level.n_window  # Qwen3-ASR: whole chunks of 2 * n_window frames
    if mel_first(level) and _int(getattr(level, "max_source_positions", None)):
        return 2 * level.max_source_positions  # a stride-2 convolution, then a fixed position table
    return FEATURE_FRAMES


def mel_features(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """Log-mel-like features at the encoder's width and framing, with an all-valid mask if read."""
    return mel_features_for(request, audio_level(request.config))


def mel_features_for(request: InputRequest, level: PretrainedConfig) -> dict[str, torch.Tensor] | None:
    """``mel_features`` for the audio settings of ``level`` (an audio LM's audio sub-config)."""
    width = feature_width(level)
    if width is None:
        return None
    frames, batch = feature_frames(level), request.batch_size
    shape = (batch, width, frames) if mel_first(level) else (batch, frames, width)
    main = "audio_mel" if request.takes("audio_mel") else "input_features"
    inputs = {main: request.randn(*shape)}
    for mask in FRAME_MASKS:
        if request.requires(mask) or (mask == "input_features_mask" and request.takes(mask)):
            inputs[mask] = torch.ones(batch, frames, dtype=torch.long)
    if request.takes("noise_sequence"):
        # UnivNet draws this noise itself when not given: drawn here, seeded, both runs agree
        inputs["noise_sequence"] = request.randn(batch, frames, level.model_in_channels)
    if request.takes("audio_mel_mask"):
        inputs["audio_mel_mask"] = torch.zeros(batch, frames, dtype=torch.bool)  # Gemma 3n: True = padding
    return _with_decoder_ids(request, inputs)


def _with_decoder_ids(request: InputRequest, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Speech encoder-decoders (Speech2Text, Moonshine) need the text side too."""
    if request.config.is_encoder_decoder and request.takes("decoder_input_ids"):
        inputs["decoder_input_ids"] = text_request_inputs(request)["input_ids"]
    return inputs


def codec_samples(level: PretrainedConfig) -> int:
    """A waveform length of whole codec frames: the product of the down-sampling ratios."""
    ratios = (
        getattr(level, "downsampling_ratios", None)
        or getattr(level, "upsampling_ratios", None)
        or getattr(level, "patch_sizes", None)  # MuseSpark audio: each layer patches its input
    )
    hop = math.prod(ratios) if ratios else getattr(level, "hop_length", None) or 320
    return CODEC_FRAMES * int(hop)


def is_codec(level: PretrainedConfig) -> bool:
    """Codecs and their encoders take (batch, channels, samples) waveforms."""
    codec_keys = [k for k in CODEC_KEYS if k != "patch_sizes"]  # MuseSpark patches a (batch, samples) waveform
    return any(getattr(level, k, None) is not None for k in codec_keys) or _int(getattr(level, "channels", None))


def waveform(request: InputRequest) -> dict[str, torch.Tensor]:
    """Raw audio: wav2vec2-style (batch, samples), or codec-style (batch, channels, samples)."""
    level = audio_level(request.config)
    if not is_codec(level):
        # MuseSpark patches the waveform: whole patches, else a wav2vec2-style length
        samples = codec_samples(level) if getattr(level, "patch_sizes", None) else WAVEFORM_SAMPLES
        return _with_decoder_ids(request, {"input_values": request.randn(request.batch_size, samples)})
    channels = getattr(level, "audio_channels", None) or getattr(level, "channels", None) or 1
    samples = codec_samples(level)
    inputs = {"input_values": request.randn(request.batch_size, channels, samples)}
    semantic = _feature_level(request.config)
    if request.requires("input_features") and semantic is not None:
        # X-Codec 2 / NeuCodec: a semantic encoder reads features framed like the codec's codes
        frames = CODEC_FRAMES
        width = feature_width(semantic) or 0
        shape = (request.batch_size, width, frames) if mel_first(semantic) else (request.batch_size, frames, width)
        inputs["input_features"] = request.randn(*shape)
    return inputs


def _feature_level(config: PretrainedConfig) -> PretrainedConfig | None:
    """The first sub-config with a feature width (a codec's semantic encoder)."""
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig) and feature_width(value):
            return value
    return None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
