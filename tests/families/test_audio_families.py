"""Tiny audio, speech, codec and time-series models: the shrinking rules and inputs they need."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pytest_modelpatch.errors import ModelPatchError
from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import InputRequest, example_inputs
from pytest_modelpatch.families.inputs.audio_lms import AUDIO_TOKENS, spliced_ids
from pytest_modelpatch.families.shrink.audio import TINY_CODEBOOKS, shrink_audio_level
from pytest_modelpatch.families.shrink.validator_fit import fit_validator_message
from pytest_modelpatch.models.checkpoints import seeded_model


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _runs(model_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config)).eval()
    inputs = example_inputs(config, model_class=type(model))
    with torch.no_grad():
        model(**inputs)
    return model, inputs


# -- shrinking ------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["dac", "encodec", "mimi", "vibevoice_acoustic_tokenizer"])
def test_codec_base_channels_shrink_so_the_deepest_stage_stays_narrow(model_type: str) -> None:
    config = tiny_config(model_type)
    stages = len(getattr(config, "downsampling_ratios", None) or config.upsampling_ratios)
    base = next(getattr(config, k) for k in ("num_filters", "encoder_hidden_size") if hasattr(config, k))
    assert base * 2**stages <= 128
    assert _parameters(seeded_model(config)) < 2_000_000


def test_codebook_dim_that_equalled_the_width_keeps_equalling_it() -> None:
    config = tiny_config("encodec")  # full config: codebook_dim == hidden_size == 128
    assert config.codebook_dim == config.hidden_size == 64
    assert config.codebook_size <= 256


def test_codebook_counts_agree_between_an_lm_and_its_codec() -> None:
    config = tiny_config("csm")
    assert config.num_codebooks == config.depth_decoder_config.num_codebooks == config.codec_config.num_quantizers
    assert config.num_codebooks == TINY_CODEBOOKS
    assert config.depth_decoder_config.backbone_hidden_size == config.hidden_size


def test_wav2vec2_feature_encoder_channels_shrink_and_keep_one_entry_per_conv_layer() -> None:
    config = tiny_config("wav2vec2")
    assert max(config.conv_dim) <= 32
    assert len(config.conv_dim) == config.num_feat_extract_layers == len(config.conv_stride)


def test_part_sizes_named_with_a_prefix_shrink() -> None:
    config = tiny_config("seamless_m4t")
    assert config.speech_encoder_layers <= 2 and config.t2u_encoder_layers <= 2
    assert config.speech_encoder_intermediate_size <= 128 and config.t2u_encoder_ffn_dim <= 128
    assert config.unit_embed_dim <= 64 and config.upsample_initial_channel <= 32
    assert len(config.resblock_kernel_sizes) == len(config.resblock_dilation_sizes) == 1


def test_a_num_count_that_is_a_list_length_is_left_alone() -> None:
    before = {"num_feat_extract_layers": 7, "conv_dim": [512] * 7, "conv_stride": [5] * 7, "prior_num_flows": 7}
    out = dict(before)
    shrink_audio_level(before, out)
    assert out["num_feat_extract_layers"] == 7 and len(out["conv_dim"]) == 7
    assert out["prior_num_flows"] == 2  # not a num_* count: a depth


def test_layer_type_list_that_is_the_only_depth_record_keeps_one_layer_of_each_kind() -> None:
    text = tiny_config("nemo_speechlm").text_config  # Nemotron-H: 52 layers_block_type entries, no count
    assert len(text.layers_block_type) <= 4
    assert set(text.layers_block_type) == {"linear_attention", "moe", "full_attention"}


@pytest.mark.parametrize("model_type", ["autoformer", "informer", "time_series_transformer"])
def test_forecasters_get_a_horizon_their_configs_leave_unset(model_type: str) -> None:
    config = tiny_config(model_type)
    assert config.prediction_length == 4 and config.context_length == 4


# -- strict validators --------------------------------------------------------------


def test_validator_message_sets_the_named_size_to_the_value_it_must_equal() -> None:
    tree = {"audio_config": {"diarization_config": {"head_config": {"audio_hidden_size": 512}}}}
    message = "`head_config.audio_hidden_size` (512) must match `audio_config.hidden_size` (64)."
    assert fit_validator_message(tree, message, {})
    assert tree["audio_config"]["diarization_config"]["head_config"]["audio_hidden_size"] == 64


def test_validator_fit_never_changes_a_size_the_user_overrode() -> None:
    tree = {"flow_head_config": {"condition_dim": 768}}
    message = "`flow_head_config.condition_dim` (768) must equal the backbone `hidden_size` (64)."
    assert not fit_validator_message(tree, message, {"flow_head_config": {"condition_dim": 768}})
    assert tree["flow_head_config"]["condition_dim"] == 768
    assert not fit_validator_message(tree, "`hidden_size` must be divisible by heads", {})


@pytest.mark.parametrize("model_type", ["fun_asr_nano", "pocket_tts", "nemotron3_diarization", "nemo_speechlm"])
def test_composite_speech_configs_meet_their_validators(model_type: str) -> None:
    tiny_config(model_type)  # raised StrictDataclassClassValidationError before


# -- inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "time_first"),
    [("parakeet_encoder", True), ("speech_to_text", True), ("glmasr_encoder", False), ("qwen3_asr_encoder", False)],
)
def test_features_are_laid_out_as_the_encoder_reads_them(model_type: str, time_first: bool) -> None:
    config = tiny_config(model_type)
    model, inputs = _runs(model_type)
    features = inputs["input_features"]
    mel = getattr(config, "num_mel_bins", None) or config.input_feat_per_channel
    assert features.shape[2 if time_first else 1] == mel


def test_audio_settings_are_read_from_the_encoder_sub_config() -> None:
    config = tiny_config("parakeet_ctc")
    _, inputs = _runs("parakeet_ctc")
    assert inputs["input_features"].shape[-1] == config.encoder_config.num_mel_bins


@pytest.mark.parametrize("model_type", ["dac", "encodec", "pe_audio_encoder", "xcodec2"])
def test_codec_waveforms_are_mono_and_whole_codec_frames(model_type: str) -> None:
    _, inputs = _runs(model_type)
    waveform = inputs["input_values"]
    assert waveform.dim() == 3 and waveform.shape[1] == 1
    config = tiny_config(model_type)
    level = getattr(config, "dac_config", config)
    hop = math.prod(getattr(level, "downsampling_ratios", None) or level.upsampling_ratios)
    assert waveform.shape[-1] % hop == 0


@pytest.mark.parametrize("model_type", ["univnet", "vits", "vibevoice_acoustic_tokenizer"])
def test_sampling_forwards_are_deterministic_for_the_same_inputs(model_type: str) -> None:
    model, inputs = _runs(model_type)
    with torch.no_grad():
        first, second = model(**inputs), model(**inputs)
    assert torch.equal(first[0], second[0])


@pytest.mark.parametrize(
    ("model_type", "name", "dims"),
    [("patchtst", "past_values", 3), ("timesfm", "past_values", 2), ("informer", "past_time_features", 3)],
)
def test_time_series_inputs_run(model_type: str, name: str, dims: int) -> None:
    _, inputs = _runs(model_type)
    assert inputs[name].dim() == dims


@pytest.mark.parametrize("model_type", ["autoformer", "informer", "time_series_transformer"])
@pytest.mark.parametrize("name", ["past_time_features", "future_time_features"])
def test_forecaster_time_features_reach_the_outputs(model_type: str, name: str) -> None:
    # with none (the configs' default), a patch that dropped the covariate columns passed
    model, inputs = _runs(model_type)
    assert inputs[name].shape[-1] == model.config.num_time_features > 0
    with torch.no_grad():
        before = model(**inputs).last_hidden_state
        after = model(**{**inputs, name: inputs[name] + 1}).last_hidden_state
    assert not torch.allclose(before, after)


@pytest.mark.parametrize(
    "model_type",
    ["musicgen", "dia", "kyutai_speech_to_text", "clap", "clvp", "pe_audio", "decision_transformer", "perceiver"],
)
def test_family_inputs_drive_the_whole_model(model_type: str) -> None:
    model, _ = _runs(model_type)
    assert _parameters(model) < 5_000_000


def test_audio_lm_inputs_splice_placeholders_so_the_audio_tower_shapes_the_output() -> None:
    config = tiny_config("qwen3_asr")
    model, inputs = _runs("qwen3_asr")
    assert (inputs["input_ids"] == config.audio_token_id).any()
    changed = {**inputs, "input_features": inputs["input_features"] + 1.0}
    with torch.no_grad():
        assert not torch.equal(model(**inputs)[0], model(**changed)[0])


# Audio language models: each input the audio arrives in, and the placeholder whose positions
# take it. Text-only inputs ran these models without their audio towers, so a patch of a tower
# failed as "never ran"; the TTS backbones ran their voice-prompt projection never and their
# latent projection only on a BOS latent no position took, so a patch of it passed unchecked.
AUDIO_LM_INPUTS = [
    ("fun_asr_nano", "input_features", "audio_token_id"),
    ("nemo_speechlm", "input_features", "audio_token_id"),
    ("vibevoice", "input_values", "audio_token_id"),
    ("vibevoice_asr", "input_values", "audio_token_id"),
    ("csm", "input_values", "audio_token_id"),
    ("pocket_tts", "audio_prompt_latents", "audio_prompt_token_id"),
    ("pocket_tts", "audio_latents", "audio_latent_token_id"),
    ("gradium_phonon_tts", "audio_prompt_latents", "audio_prompt_token_id"),
    ("gradium_phonon_tts", "audio_latents", "audio_latent_token_id"),
]


@pytest.mark.parametrize(("model_type", "name", "placeholder"), AUDIO_LM_INPUTS)
def test_audio_lm_audio_reaches_the_output(model_type: str, name: str, placeholder: str) -> None:
    config = tiny_config(model_type)
    model, inputs = _runs(model_type)
    assert (inputs["input_ids"] == getattr(config, placeholder)).any()
    changed = {**inputs, name: inputs[name] + 1.0}
    with torch.no_grad():
        assert not torch.allclose(model(**inputs)[0], model(**changed)[0])


def test_vibevoice_asr_audio_latents_are_deterministic() -> None:
    # its forward adds N(0, vae_std) noise to the acoustic latents: two runs of one model agree
    # (and so do a reference and a patched copy) only with the tiny config's vae_std of 0
    model, inputs = _runs("vibevoice_asr")
    assert model.config.acoustic_tokenizer_encoder_config.vae_std == 0.0
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], model(**inputs)[0])


def test_a_placeholder_id_the_config_lacks_is_a_clear_error() -> None:
    config = tiny_config("llama")  # no audio_token_id: a builder pointed at the wrong family
    request = InputRequest(config, model_class_for(config), 2, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ModelPatchError, match="audio_token_id is None"):
        spliced_ids(request, ("audio_token_id", AUDIO_TOKENS))


# -- Voxtral Realtime's text model, run alone ----------------------------------------------


def test_a_mapped_class_its_package_does_not_export_is_taken_from_its_modeling_module() -> None:
    from transformers.models.voxtral_realtime import modeling_voxtral_realtime

    # the auto mapping names VoxtralRealtimeTextModel, which `transformers` itself does not export
    assert model_class_for(tiny_config("voxtral_realtime_text")) is modeling_voxtral_realtime.VoxtralRealtimeTextModel


def test_the_realtime_text_model_gets_the_delay_condition_its_parent_would_hand_it() -> None:
    from transformers import VoxtralRealtimeConfig
    from transformers.models.voxtral_realtime.modeling_voxtral_realtime import VoxtralRealtimeTimeEmbedding

    model, inputs = _runs("voxtral_realtime_text")
    delay = VoxtralRealtimeConfig().default_num_delay_tokens
    expected = VoxtralRealtimeTimeEmbedding(model.config.hidden_size)(torch.full((1,), float(delay)))[None]
    torch.testing.assert_close(inputs["t_cond"], expected)
    with torch.no_grad():  # the condition drives the output: a patch that dropped it would not compare equal
        plain = model(**inputs).last_hidden_state
        shifted = model(**{**inputs, "t_cond": inputs["t_cond"] * 2}).last_hidden_state
    assert (plain - shifted).abs().max() > 1e-3


def test_the_delay_condition_takes_the_dtype_of_a_model_loaded_in_bfloat16(tmp_path: Path) -> None:
    from pytest_modelpatch.compare._engine.inputs import default_inputs
    from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest

    model = ModelBuilder(tmp_path).reference(ModelRequest("voxtral_realtime_text"), dtype="bfloat16")
    inputs = default_inputs(model)
    assert inputs["t_cond"].dtype == torch.bfloat16
    with torch.no_grad():
        assert model(**inputs).last_hidden_state.isfinite().all()
