"""Tiny configs and inputs of promptable segmentation (SAM 2 / SAM 3) and open-vocabulary detectors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_modelpatch.compare.forward.equivalence import assert_equivalent
from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.families.shrink.rules.timm import TINY_RESNET_ARGS
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest
from pytest_modelpatch.models.checkpoints import seeded_model


def _forward(model_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], object]:
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config))
    inputs = example_inputs(config, model_class=type(model))
    with torch.no_grad():
        return model, inputs, model(**inputs)


# ---------------------------------------------------------------------------
# config rules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["sam2", "sam3_tracker"])
def test_the_prompt_grid_is_the_vision_necks_coarsest_map(model_type: str) -> None:
    config = tiny_config(model_type)
    prompt = config.prompt_encoder_config
    coarsest = config.vision_config.backbone_feature_sizes[-1]
    assert prompt.image_size // prompt.patch_size == coarsest[0]


@pytest.mark.parametrize("model_type", ["sam3", "sam3_tracker", "sam3_lite_text"])
def test_sam3_feature_sizes_are_the_vit_grid_rescaled_by_the_fpn(model_type: str) -> None:
    vision = tiny_config(model_type).vision_config
    grid = vision.backbone_config.image_size // vision.backbone_config.patch_size
    assert vision.backbone_feature_sizes == [[int(grid * s)] * 2 for s in vision.scale_factors[:3]]


def test_edgetam_neck_lists_the_repvit_stage_widths_widest_first() -> None:
    config = tiny_config("edgetam")
    vision, prompt = config.vision_config, config.prompt_encoder_config
    backbone = vision.backbone_config
    assert backbone.architecture.startswith("repvit")  # not the wrapper's resnet50 default
    assert not set(TINY_RESNET_ARGS) & set(backbone.model_args)  # nor that resnet50's shrinking
    assert vision.backbone_channel_list == list(reversed(backbone.model_args["embed_dim"]))
    assert vision.backbone_feature_sizes == [[prompt.image_size // s] * 2 for s in (4, 8, 16)]
    assert prompt.image_size // prompt.patch_size == vision.backbone_feature_sizes[-1][0]


def test_edgetam_runs_on_its_repvit_backbone() -> None:
    pytest.importorskip("timm")
    model, _, outputs = _forward("edgetam")
    assert torch.isfinite(outputs.pred_masks).all()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_omdet_turbo_widths_follow_the_text_tower_and_d_model() -> None:
    config = tiny_config("omdet-turbo")
    text = config.text_config.hidden_size
    assert config.class_embed_dim == config.text_projection_in_dim == config.text_projection_out_dim == text
    assert config.decoder_hidden_dim == config.d_model != config.class_embed_dim  # the task projection exists
    assert config.vision_features_channels == [config.d_model] * config.num_feature_levels
    assert not config.apply_layernorm_after_vision_backbone  # the tiny backbone's maps are channels-first


def test_lw_detr_has_two_projector_levels_for_the_deformable_decoder() -> None:
    config = tiny_config("lw_detr")
    assert config.num_feature_levels == len(config.projector_scale_factors) == 2
    assert config.projector_in_channels == [config.d_model] * 2


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["sam3", "sam3_lite_text"])
def test_sam3_reads_a_text_prompt_beside_the_image(model_type: str) -> None:
    model, inputs, out = _forward(model_type)
    assert {"pixel_values", "input_ids", "attention_mask"} <= set(inputs)
    text = dict(inputs, input_ids=torch.flip(inputs["input_ids"], dims=[1]))
    with torch.no_grad():
        other = model(**text)
    assert not torch.allclose(out.pred_logits, other.pred_logits)  # the prompt decides what is found


def test_omdet_turbo_gets_a_class_list_per_image_and_a_task_prompt() -> None:
    model, inputs, out = _forward("omdet-turbo")
    structure = inputs["classes_structure"]
    assert inputs["classes_input_ids"].shape[0] == int(structure.sum())
    assert inputs["tasks_input_ids"].shape[0] == inputs["pixel_values"].shape[0] == len(structure)
    assert (inputs["classes_input_ids"][:, -1] == model.config.text_config.eos_token_id).all()
    assert out.decoder_class_logits.shape[-1] == int(structure[0])  # one score per named class


@pytest.mark.parametrize("model_type", ["sam2", "sam3_tracker", "lw_detr", "omdet-turbo"])
def test_the_image_reaches_the_outputs(model_type: str) -> None:
    model, inputs, out = _forward(model_type)
    with torch.no_grad():
        other = model(**dict(inputs, pixel_values=inputs["pixel_values"].flip(-1)))
    first = next(v for v in out.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    second = other[next(k for k, v in out.items() if v is first)]
    assert not torch.allclose(first, second)


# ---------------------------------------------------------------------------
# the reference's capture hooks
# ---------------------------------------------------------------------------


def test_a_reference_with_a_prebuilt_backbone_captures_each_layer_once(tmp_path: Path) -> None:
    # LW-DETR's ViT backbone installs its capture hooks when built; pinning the enclosing
    # model's hooks must not hook its layers a second time (the feature maps would repeat a layer)
    builder = ModelBuilder(tmp_path)
    reference = builder.reference(ModelRequest("lw_detr"))
    layer = reference.backbone.backbone.encoder.layer[0]
    assert len(layer._forward_hooks) == 1
    assert_equivalent(reference, builder.patched(ModelRequest("lw_detr"), unpatched=True))


@pytest.mark.parametrize("model_type", ["sam", "sam_hq", "sam2", "sam3_tracker"])
def test_clicked_points_steer_the_masks(model_type: str) -> None:
    model, inputs, out = _forward(model_type)
    size = model.config.prompt_encoder_config.image_size
    assert inputs["input_points"].shape[-2:] == (2, 2) and 0 <= inputs["input_points"].min()
    assert inputs["input_points"].max() < size  # pixel coordinates in the prompt encoder's frame
    assert inputs["input_labels"].unique().tolist() == [0, 1]  # a positive and a negative click
    with torch.no_grad():
        moved = model(**dict(inputs, input_points=size - 1 - inputs["input_points"]))
    assert not torch.allclose(out.pred_masks, moved.pred_masks)


@pytest.mark.parametrize("model_type", ["sam3", "sam3_tracker"])
def test_sam3_vit_runs_windowed_and_global_attention(model_type: str) -> None:
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config))
    vit = config.vision_config.backbone_config
    grid = vit.image_size // vit.patch_size
    windows = [layer.window_size for layer in model.vision_encoder.backbone.layers]
    assert 0 in windows and any(0 < w < grid for w in windows)


def test_lw_detr_vit_has_a_windowed_and_a_global_layer() -> None:
    config = tiny_config("lw_detr")
    model = seeded_model(config, model_class=model_class_for(config))
    windowed = [layer.window for layer in model.backbone.backbone.encoder.layer]
    assert True in windowed and False in windowed
