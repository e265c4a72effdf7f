"""Tiny vision backbones, detectors and SAM-style models: sizes that must agree after shrinking."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.families.shrink.vision import TINY_STAGE_WIDTH
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest

PARAMETER_BUDGET = 5_000_000


@pytest.mark.parametrize("model_type", ["resnet", "convnext", "pvt", "regnet"])
def test_stage_widths_shrink_by_one_divisor_keeping_their_ratios(model_type: str) -> None:
    default = AutoConfig.for_model(model_type).hidden_sizes
    tiny = tiny_config(model_type).hidden_sizes
    assert max(tiny) <= TINY_STAGE_WIDTH
    assert len(tiny) == len(default)
    assert {d // t for d, t in zip(default, tiny)} == {default[0] // tiny[0]}  # one divisor for every stage


def test_hgnet_stages_still_chain_into_each_other_and_the_stem() -> None:
    config = tiny_config("hgnet_v2")
    assert config.stage_in_channels[1:] == config.stage_out_channels[:-1]
    assert config.stem_channels[0] == config.num_channels
    assert config.stem_channels[-1] == config.stage_in_channels[0]
    assert max(config.stage_out_channels) <= TINY_STAGE_WIDTH


def test_textnet_stem_feeds_the_first_stage() -> None:
    config = tiny_config("textnet")
    assert config.stem_out_channels == config.hidden_sizes[0]


@pytest.mark.parametrize("model_type", ["swin", "swinv2", "focalnet", "hiera"])
def test_swin_style_last_stage_stays_within_the_stage_width(model_type: str) -> None:
    config = tiny_config(model_type)
    last = config.embed_dim * 2 ** (len(config.depths) - 1)
    assert last <= TINY_STAGE_WIDTH
    if "hidden_size" in config.to_dict():  # Swin derives it from the stages; FocalNet has none
        assert config.hidden_size == last


@pytest.mark.parametrize("model_type", ["detr", "conditional_detr", "deformable_detr", "table-transformer"])
def test_detr_style_configs_use_a_transformers_backbone_instead_of_timm(model_type: str) -> None:
    config = tiny_config(model_type)
    assert config.backbone_config.model_type == "resnet"
    assert max(config.backbone_config.hidden_sizes) <= TINY_STAGE_WIDTH
    model = model_class_for(config)(config)
    assert sum(p.numel() for p in model.parameters()) <= PARAMETER_BUDGET


@pytest.mark.parametrize("model_type", ["rt_detr", "d_fine"])
def test_detector_channel_lists_follow_the_backbone_and_the_encoder(model_type: str) -> None:
    config = tiny_config(model_type)
    backbone = config.backbone_config
    assert config.encoder_in_channels == [backbone.hidden_sizes[i - 1] for i in backbone.out_indices]
    assert set(config.decoder_in_channels) == {config.encoder_hidden_dim}


@pytest.mark.parametrize("model_type", ["sam", "sam_hq"])
def test_sam_sub_configs_agree_on_the_neck_and_the_embedding_grid(model_type: str) -> None:
    config = tiny_config(model_type)
    vision, prompt, decoder = config.vision_config, config.prompt_encoder_config, config.mask_decoder_config
    assert vision.output_channels == prompt.hidden_size == decoder.hidden_size
    assert prompt.image_embedding_size == vision.image_size // vision.patch_size


def test_sam2_neck_lists_the_hiera_stage_widths_widest_first() -> None:
    vision = tiny_config("sam2_vision_model")
    assert vision.backbone_channel_list == list(reversed(vision.backbone_config.embed_dim_per_stage))
    assert vision.backbone_config.hidden_size == vision.backbone_config.embed_dim_per_stage[0]


@pytest.mark.parametrize("model_type", ["lightglue", "efficientloftr"])
def test_keypoint_matchers_get_two_related_images_per_row(model_type: str) -> None:
    pixels = example_inputs(tiny_config(model_type))["pixel_values"]
    assert pixels.ndim == 5 and pixels.shape[:2] == (2, 2)
    assert torch.equal(torch.roll(pixels[:, 0], shifts=(2, 3), dims=(2, 3)), pixels[:, 1])


def test_seggpt_gets_a_prompt_image_and_mask_each_half_the_stacked_height() -> None:
    config = tiny_config("seggpt")
    inputs = example_inputs(config)
    assert set(inputs) == {"pixel_values", "prompt_pixel_values", "prompt_masks"}
    assert inputs["pixel_values"].shape[2] * 2 == config.image_size[0]
    assert inputs["prompt_masks"].shape == inputs["pixel_values"].shape
    assert set(inputs["prompt_masks"].unique().tolist()) == {0.0, 1.0}


def test_oneformer_loads_with_every_layer_it_runs_materialised(tmp_path) -> None:
    # OneFormer keeps its input projections in a plain list: unregistered, so from_pretrained
    # leaves them on the meta device unless they are identities (hidden_dim == conv_dim), and
    # each forward then reads uninitialised memory
    model = ModelBuilder(tmp_path).reference(ModelRequest("oneformer"))
    unregistered = [
        f"{name}.{attribute}" for name, module in model.named_modules() for attribute, value in vars(module).items()
        if isinstance(value, list) and any(isinstance(item, torch.nn.Module) for item in value)
        for item in value if isinstance(item, torch.nn.Module) and any(p.is_meta for p in item.parameters())
    ]  # fmt: skip
    assert not unregistered
    inputs = example_inputs(model.config, model_class=type(model))
    with torch.no_grad():
        first, second = model(**inputs), model(**inputs)
    assert torch.equal(first.transformer_decoder_object_queries, second.transformer_decoder_object_queries)
