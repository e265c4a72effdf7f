"""Inputs for speech and music families whose forward reads something no modality rule derives.

Multi-codebook token grids (MusicGen, Dia, Kyutai), contrastive text + audio pairs (CLAP,
CLVP, PE-Audio), spectrogram patches (AST), pre-embedded sequences (SpeechT5 without its
pre-nets), codec latents (Mimi and Pocket-TTS decoders, VibeVoice tokenizer halves); the
audio language models' builders, which splice audio into text, live in ``audio_lms.py``.
Keyed by ``model_type``; ``example_inputs`` consults this table before the main-input
builders. Each builder reads every size from the (shrunk) config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.families.inputs.audio import audio_level, mel_features, waveform
from pytest_modelpatch.families.inputs.audio_lms import (
    csm_inputs,
    fun_asr_nano_inputs,
    nemotron_transcribe_inputs,
    qwen3_asr_inputs,
    tts_latent_inputs,
    vibevoice_asr_inputs,
    vibevoice_inputs,
)
from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_inputs

FamilyBuilder = Callable[[InputRequest], "dict[str, torch.Tensor]"]
LATENT_FRAMES = 4


def _ids(request: InputRequest, vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(vocab, shape, generator=request.generator)


def _text(request: InputRequest, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    return text_inputs(config, request.batch_size, request.seq_len, request.generator)


def music_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """MusicGen: a text prompt for the T5 encoder, codebooks flattened into the decoder's batch."""
    config, batch, seq = request.config, request.batch_size, request.seq_len
    decoder = config.decoder
    inputs = _text(request, config.text_encoder)
    inputs["decoder_input_ids"] = _ids(request, decoder.vocab_size, batch * decoder.num_codebooks, seq)
    if request.takes("input_features") and getattr(config, "num_chroma", None):
        inputs["input_features"] = request.randn(batch, seq, config.num_chroma)  # melody chroma
    return inputs


def dia_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Dia: text bytes for the encoder, (batch, steps, channels) audio codes for the decoder."""
    config, batch, seq = request.config, request.batch_size, request.seq_len
    decoder = config.decoder_config
    inputs = _text(request, config.encoder_config)
    inputs["decoder_input_ids"] = _ids(request, decoder.vocab_size, batch, seq, decoder.num_channels)
    return inputs


def kyutai_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Kyutai STT: each step is one text token and one code per audio codebook."""
    config, batch, seq = request.config, request.batch_size, request.seq_len
    text = _ids(request, config.vocab_size, batch, seq, 1)
    codes = _ids(request, config.codebook_vocab_size, batch, seq, config.num_codebooks)
    return {"input_ids": torch.cat([text, codes], dim=-1), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


def clap_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """CLAP: text beside a (batch, 1, frames, mel bins) spectrogram, not longer than the clip."""
    config, batch = request.config, request.batch_size
    audio = config.audio_config
    inputs = _text(request, config.text_config)
    inputs["input_features"] = request.randn(batch, 1, audio.spec_size, audio.num_mel_bins)
    inputs["is_longer"] = torch.zeros(batch, 1, dtype=torch.bool)
    return inputs


def clvp_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """CLVP: text tokens beside the conditioning mel spectrogram (batch, mel bins, frames)."""
    config, batch = request.config, request.batch_size
    inputs = _text(request, config.text_config)
    inputs["input_features"] = request.randn(batch, config.decoder_config.feature_size, 4 * request.seq_len)
    return inputs


def with_audio(request: InputRequest) -> dict[str, torch.Tensor]:
    """Contrastive text + audio (PE-Audio): text, plus the audio tower's own input."""
    config = request.config
    inputs = _text(request, config.text_config)
    audio = waveform(request) if request.takes("input_values") else mel_features(request) or {}
    inputs.update({k: v for k, v in audio.items() if k not in inputs})
    return inputs


def streaming_asr_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Voxtral Realtime adds audio frames to text positions: features for 8 frames per token
    (a stride-2 convolution, then the projector's 4x downsampling)."""
    config, batch, seq = request.config, request.batch_size, request.seq_len
    audio = config.audio_config
    frames = seq * 2 * config.downsample_factor
    inputs = _text(request, config.text_config)
    inputs["input_features"] = request.randn(batch, audio.num_mel_bins, frames)
    return inputs


def spectrogram_patches(request: InputRequest) -> dict[str, torch.Tensor]:
    """AST: a (batch, max_length frames, mel bins) spectrogram cut into patches."""
    config = request.config
    return {"input_values": request.randn(request.batch_size, config.max_length, config.num_mel_bins)}


def embedded_speech(request: InputRequest) -> dict[str, torch.Tensor]:
    """SpeechT5Model without pre-nets: encoder and decoder read (batch, steps, hidden) directly."""
    config, batch, seq = request.config, request.batch_size, request.seq_len
    return {
        "input_values": request.randn(batch, seq, config.hidden_size),
        "decoder_input_values": request.randn(batch, seq, config.hidden_size),
    }


def codec_latents(request: InputRequest) -> dict[str, torch.Tensor]:
    """A codec decoder's continuous latents, (batch, hidden, frames)."""
    level = audio_level(request.config)
    return {"latents": request.randn(request.batch_size, level.hidden_size, LATENT_FRAMES)}


def tokenizer_encoder(request: InputRequest) -> dict[str, torch.Tensor]:
    """VibeVoice tokenizer encoder: the waveform, under the name ``hidden_states``."""
    return {"hidden_states": waveform(request)["input_values"]}


def tokenizer_decoder(request: InputRequest) -> dict[str, torch.Tensor]:
    """VibeVoice tokenizer decoder: (batch, hidden, frames) latents, as ``hidden_states``."""
    config = request.config
    return {"hidden_states": request.randn(request.batch_size, config.hidden_size, LATENT_FRAMES)}


def encoder_states(request: InputRequest) -> dict[str, torch.Tensor]:
    """Nemotron word timestamps: ASR encoder states (batch, frames, hidden), every frame valid."""
    config, batch, frames = request.config, request.batch_size, request.seq_len
    return {
        "inputs_embeds": request.randn(batch, frames, config.hidden_size),
        "attention_mask": torch.ones(batch, frames, dtype=torch.long),
    }


def phoneme_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """FastSpeech2 + HiFi-GAN: phoneme ids from the acoustic model's vocabulary."""
    return _text(request, request.config.model_config)


AUDIO_INPUT_BUILDERS: dict[str, FamilyBuilder] = {
    "musicgen": music_inputs,
    "musicgen_melody": music_inputs,
    "dia": dia_inputs,
    "kyutai_speech_to_text": kyutai_inputs,
    "clap": clap_inputs,
    "clvp": clvp_inputs,
    "pe_audio": with_audio,
    "voxtral_realtime": streaming_asr_inputs,
    "audio-spectrogram-transformer": spectrogram_patches,
    "speecht5": embedded_speech,
    "mimi_decoder": codec_latents,
    "pocket_tts_audio_tokenizer_decoder": codec_latents,
    "vibevoice_acoustic_tokenizer_encoder": tokenizer_encoder,
    "vibevoice_acoustic_tokenizer_decoder": tokenizer_decoder,
    "nemotron3_5_transcribe_word_timestamp": encoder_states,
    "fastspeech2_conformer_with_hifigan": phoneme_inputs,
    # audio language models: audio for the tower, its placeholders spliced into the text
    "qwen3_asr": qwen3_asr_inputs,
    "fun_asr_nano": fun_asr_nano_inputs,
    "nemo_speechlm": nemotron_transcribe_inputs,
    "vibevoice": vibevoice_inputs,
    "vibevoice_asr": vibevoice_asr_inputs,
    "csm": csm_inputs,
    "pocket_tts": tts_latent_inputs,
    "gradium_phonon_tts": tts_latent_inputs,
}
