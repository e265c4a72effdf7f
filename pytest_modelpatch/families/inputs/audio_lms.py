"""Inputs for audio language models: audio for the audio tower, its placeholders spliced into text.

Each model scatters the audio tower's output into the positions of one placeholder token and
checks that the counts agree, so every builder here counts the embeddings the tower will
yield (with the modeling module's own length rule where it has one) and splices that many
placeholders into every row's text, after two ordinary tokens.
Text-to-speech backbones (Pocket TTS, Gradium Phonon) have no audio encoder: their forward
reads codec latents (the voice prompt and the audio so far), spliced the same way.
"""

from __future__ import annotations

import sys

import torch

from pytest_modelpatch.errors import ModelPatchError
from pytest_modelpatch.families.inputs.audio import feature_width, mel_features_for
from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_inputs

AUDIO_TOKENS = 4  # audio embeddings per row: enough that a patch of the tower shows, few enough to stay cheap
TEXT_PREFIX = 2  # ordinary tokens before the first placeholder run, as a chat template puts a role first


def spliced_ids(request: InputRequest, *runs: tuple[str, int]) -> dict[str, torch.Tensor]:
    """Random text with runs of placeholders, ``(config key of the token id, count)``, after
    its first two tokens, every position attended."""
    config = request.config
    placeholders = []
    for key, count in runs:
        token_id = getattr(config, key, None)
        if not isinstance(token_id, int) or isinstance(token_id, bool) or count < 1:
            raise ModelPatchError(
                f"example_inputs cannot splice {count} audio placeholders into {config.model_type}'s text: "
                f"its config's {key} is {token_id!r}; set it to a token id or pass inputs= explicitly"
            )
        placeholders.append(torch.full((request.batch_size, count), token_id, dtype=torch.long))
    text = text_inputs(config, request.batch_size, request.seq_len, request.generator)["input_ids"]
    ids = torch.cat([text[:, :TEXT_PREFIX], *placeholders, text[:, TEXT_PREFIX:]], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _all_valid(request: InputRequest, length: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.ones(request.batch_size, length, dtype=dtype)


def qwen3_asr_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Qwen3-ASR: one clip per row, as many placeholders as the encoder yields (the modeling
    module's own length formula)."""
    config = request.config
    audio = mel_features_for(request, config.audio_config)
    assert audio is not None  # transformers' config refuses a num_mel_bins that is no int
    frames = audio["input_features"].shape[-1]
    lengths = sys.modules[request.model_class.__module__]._get_feat_extract_output_lengths
    count = int(lengths(torch.tensor(frames), config.audio_config.n_window))
    return {**spliced_ids(request, ("audio_token_id", count)), **audio}


def fun_asr_nano_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Fun-ASR-Nano: LFR-stacked features (batch, frames, mel bins x stacked frames); the
    encoder and adaptor keep the frame count, so one embedding per valid frame."""
    config, frames = request.config, AUDIO_TOKENS
    width = feature_width(config.audio_config)  # num_mel_bins * num_stacked_frames, the encoder's input_size
    assert width is not None  # transformers' config refuses a num_mel_bins that is no int
    audio = {
        "input_features": request.randn(request.batch_size, frames, width),
        "input_features_mask": _all_valid(request, frames),
    }
    return {**spliced_ids(request, ("audio_token_id", frames)), **audio}


def nemotron_transcribe_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Nemotron 3.5 Transcribe (``nemo_speechlm``): a (batch, frames, mel bins) spectrogram of
    whole stacks of ``subsampling_factor`` frames, one embedding per stack. The same
    spectrogram feeds the ASR encoder and the diarization model, whose speaker activity is
    added to every audio embedding."""
    config = request.config
    audio = config.audio_config
    frames = AUDIO_TOKENS * audio.subsampling_factor
    features = {
        "input_features": request.randn(request.batch_size, frames, audio.asr_config.num_mel_bins),
        "input_features_mask": _all_valid(request, frames),
    }
    return {**spliced_ids(request, ("audio_token_id", AUDIO_TOKENS)), **features}


def _acoustic_waveform(request: InputRequest, hop_length: int) -> dict[str, torch.Tensor]:
    """A mono (batch, 1, samples) clip of whole tokenizer frames, with its all-valid sample mask."""
    samples = AUDIO_TOKENS * int(hop_length)
    return {
        "input_values": request.randn(request.batch_size, 1, samples),
        "padding_mask": _all_valid(request, samples, torch.bool),
    }


def vibevoice_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """VibeVoice: a voice-cloning clip for the acoustic tokenizer, one embedding per
    ``hop_length`` samples (``ceil(valid samples / hop_length)`` in the modeling code)."""
    config = request.config
    audio = _acoustic_waveform(request, config.audio_config.hop_length)
    return {**spliced_ids(request, ("audio_token_id", AUDIO_TOKENS)), **audio}


def vibevoice_asr_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """VibeVoice-ASR: the clip runs through the acoustic and the semantic tokenizer encoders,
    one fused embedding per acoustic ``hop_length`` samples."""
    config = request.config
    audio = _acoustic_waveform(request, config.acoustic_tokenizer_encoder_config.hop_length)
    return {**spliced_ids(request, ("audio_token_id", AUDIO_TOKENS)), **audio}


def csm_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """CSM: a context clip the Mimi codec encodes into codes, one placeholder per codec frame
    (``frame_size`` samples), the clip's end given by ``input_values_cutoffs``."""
    config = request.config
    samples = AUDIO_TOKENS * config.codec_config.frame_size
    audio = {
        "input_values": request.randn(request.batch_size, 1, samples),
        "input_values_cutoffs": torch.full((request.batch_size, 1), samples, dtype=torch.long),
    }
    return {**spliced_ids(request, ("audio_token_id", AUDIO_TOKENS)), **audio}


def tts_latent_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Pocket TTS / Gradium Phonon backbones: voice-prompt latents in the prompt placeholders,
    then the audio BOS and the audio latents generated so far, as in a training step."""
    config = request.config
    prompt_width = getattr(config, "audio_prompt_dim", None) or config.latent_dim  # Gradium: speaker-codec width
    inputs = spliced_ids(
        request,
        ("audio_prompt_token_id", AUDIO_TOKENS),
        ("audio_bos_token_id", 1),
        ("audio_latent_token_id", AUDIO_TOKENS),
    )
    inputs["audio_prompt_latents"] = request.randn(request.batch_size, AUDIO_TOKENS, prompt_width)
    inputs["audio_latents"] = request.randn(request.batch_size, AUDIO_TOKENS, config.latent_dim)
    return inputs
