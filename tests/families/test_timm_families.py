"""Families with a timm vision tower: shrunk through model_args, parents agreeing with the tower."""

from __future__ import annotations

import pytest
import torch

from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.families.inputs.composite import IMAGE_TOKENS_PER_IMAGE
from pytest_modelpatch.models.checkpoints import seeded_model

PARAMETER_BUDGET = 5_000_000


def test_vlm_parents_repeat_the_tiny_towers_sizes() -> None:
    fast = tiny_config("fast_vlm").vision_config
    assert fast.hidden_size == 2 * fast.model_args["embed_dims"][-1]  # the final conv's cls_ratio
    perception = tiny_config("perception_lm").vision_config
    assert perception.architecture.startswith("vit_pe_core")  # the projector reads model_args["embed_dim"]
    assert perception.model_args["img_size"] == [perception.image_size] * 2
    gemma = tiny_config("gemma3n")
    side = gemma.vision_config.model_args["msfa_output_resolution"]
    assert gemma.vision_soft_tokens_per_image == side * side


@pytest.mark.parametrize("model_type", ["timm_wrapper", "gemma3n_vision", "fast_vlm", "perception_lm", "gemma3n"])
def test_timm_towers_build_small_and_their_configs_still_serialise(model_type: str) -> None:
    pytest.importorskip("timm")
    config = tiny_config(model_type)
    model = model_class_for(config)(config)
    assert sum(p.numel() for p in model.parameters()) <= PARAMETER_BUDGET
    config.to_json_string()  # timm edits MobileNetV5's block arguments in place while building
    model_class_for(config)(config)  # and they still build a second model


@pytest.mark.parametrize("model_type", ["gemma3n", "fast_vlm", "perception_lm"])
def test_the_timm_tower_runs_in_the_compared_forward(model_type: str) -> None:
    # text-only inputs would pass every check with the tower never run: another image, other outputs
    pytest.importorskip("timm")
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config))
    inputs = example_inputs(config, model_class=type(model))
    per_row = (inputs["input_ids"] == config.image_token_id).sum(dim=1).tolist()
    assert per_row == [IMAGE_TOKENS_PER_IMAGE[model_type](config)] * inputs["input_ids"].shape[0]
    other = {**inputs, "pixel_values": torch.randn_like(inputs["pixel_values"])}
    with torch.no_grad():
        first, second = model(**inputs)[0], model(**other)[0]
    assert not torch.allclose(first, second)
