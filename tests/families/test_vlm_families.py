"""VLMs whose example inputs carry a real image: the tower runs in the compared forward."""

from __future__ import annotations

import pytest
import torch

from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.families.inputs.composite import GRID_IMAGE_FAMILIES, IMAGE_TOKENS_PER_IMAGE, crop_tokens
from pytest_modelpatch.models.checkpoints import seeded_model

SPLICED_VLMS = [
    "unlimited_ocr", "deepseek_ocr2", "step3p7", "florence2", "chameleon", "emu3", "deepseek_vl_hybrid", "llama4",
    "granite4_vision",
]  # fmt: skip
GRID_VLMS = ["hunyuan_vl", "muse_spark", "dots3_note"]


def _model_and_inputs(model_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config))
    return model, example_inputs(config, model_class=type(model))


def _llama4_reads_a_field_its_language_model_lacks() -> bool:
    """transformers 5.24's Llama4ForConditionalGeneration.forward reads ``outputs.image_outputs`` off its text model's output."""
    import inspect

    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.models.llama4 import modeling_llama4

    source = inspect.getsource(modeling_llama4.Llama4ForConditionalGeneration.forward)
    return "outputs.image_outputs" in source and "image_outputs" not in MoeCausalLMOutputWithPast.__dataclass_fields__


LLAMA4_BROKEN = pytest.mark.xfail(
    _llama4_reads_a_field_its_language_model_lacks(), raises=AttributeError, strict=True,
    reason="transformers' Llama4ForConditionalGeneration.forward reads outputs.image_outputs, which its text model does not return",
)  # fmt: skip


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=LLAMA4_BROKEN) if t == "llama4" else t for t in SPLICED_VLMS + GRID_VLMS]
)
def test_the_image_reaches_the_compared_outputs(model_type: str) -> None:
    # another image, other outputs: a patch of the vision tower would be compared
    model, inputs = _model_and_inputs(model_type)
    other = {**inputs, "pixel_values": torch.randn_like(inputs["pixel_values"])}
    with torch.no_grad():
        first, second = model(**inputs)[0], model(**other)[0]
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("model_type", SPLICED_VLMS)
def test_one_placeholder_per_image_feature(model_type: str) -> None:
    # the forward checks the count too; here it is the table's, per row
    config = tiny_config(model_type)
    _, inputs = _model_and_inputs(model_type)
    per_row = (inputs["input_ids"] == config.image_token_id).sum(dim=1).tolist()
    assert per_row == [IMAGE_TOKENS_PER_IMAGE[model_type](config)] * inputs["input_ids"].shape[0]


def test_an_encoder_decoder_vlm_decodes_plain_text() -> None:
    config = tiny_config("florence2")
    _, inputs = _model_and_inputs("florence2")
    assert not (inputs["decoder_input_ids"] == config.image_token_id).any()


def test_emu3_image_sizes_and_deepseek_vl_hybrid_high_res_view_come_with_the_image() -> None:
    _, emu3 = _model_and_inputs("emu3")
    assert emu3["image_sizes"].tolist() == [list(emu3["pixel_values"].shape[-2:])] * 2
    _, hybrid = _model_and_inputs("deepseek_vl_hybrid")
    assert (
        hybrid["high_res_pixel_values"].shape[-1] == tiny_config("deepseek_vl_hybrid").high_res_vision_config.image_size
    )


@pytest.mark.parametrize("model_type", GRID_VLMS)
def test_packed_patches_match_their_grid_and_placeholders(model_type: str) -> None:
    config = tiny_config(model_type)
    _, inputs = _model_and_inputs(model_type)
    grid = inputs["image_grid_thw"]
    assert inputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    per_row = (inputs["input_ids"] == config.image_token_id).sum(dim=1).tolist()
    assert per_row == [GRID_IMAGE_FAMILIES[model_type][1](config)] * grid.shape[0]


def test_muse_spark_adapter_reads_pixel_shuffled_vision_tokens() -> None:
    config = tiny_config("muse_spark")
    vision = config.vision_config
    assert config.out_hidden_size == vision.hidden_size * vision.merge_size**2


def test_llama4_adapter_reads_the_pixel_shuffled_width() -> None:
    vision = tiny_config("llama4").vision_config
    assert vision.intermediate_size == vision.hidden_size / vision.pixel_shuffle_ratio**2


def test_granite4_vision_pinpoints_are_whole_tiles_of_the_tiny_tower() -> None:
    config = tiny_config("granite4_vision")
    tile = config.vision_config.image_size
    assert all(side % tile == 0 for point in config.image_grid_pinpoints for side in point)
    assert [list(pair) for pair in config.deepstack_layer_map] == [[0, 0], [1, 1]]  # the text rule still applies


def test_granite4_vision_gets_the_base_view_and_the_pinpoint_tiles() -> None:
    config = tiny_config("granite4_vision")
    _, inputs = _model_and_inputs("granite4_vision")
    height, width = config.image_grid_pinpoints[0]
    tile = config.vision_config.image_size
    assert inputs["pixel_values"].shape[1] == 1 + (height // tile) * (width // tile)
    assert inputs["image_sizes"].tolist() == [[height, width]] * 2


def test_phi4_multimodal_crops_reach_the_outputs_through_their_placeholders() -> None:
    config = tiny_config("phi4_multimodal")
    model, inputs = _model_and_inputs("phi4_multimodal")
    per_row = (inputs["input_ids"] == config.vision_config.image_token_id).sum(dim=1).tolist()
    assert per_row == [crop_tokens(config)] * 2
    other = {**inputs, "image_pixel_values": torch.randn_like(inputs["image_pixel_values"])}
    with torch.no_grad():
        assert not torch.allclose(model(**inputs)[0], model(**other)[0])
