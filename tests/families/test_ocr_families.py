"""OCR, document and dense-prediction families (PP-OCR, DepthPro, UVDoc, Sapiens 2): the
sizes their rules keep in agreement, the inputs that reach every stage, and reference
capture hooks installed once."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.models.reference import install_capture_hooks

PARAMETER_BUDGET = 5_000_000
PP_OCR_V6 = ["pp_ocrv6_small_rec", "pp_ocrv6_tiny_rec", "pp_ocrv6_small_det", "pp_ocrv6_medium_det"]
DETECTORS = ["pp_ocrv6_small_det", "pp_ocrv6_medium_det"]


def _built(model_type: str) -> torch.nn.Module:
    config = tiny_config(model_type)
    torch.manual_seed(0)
    return model_class_for(config)(config).eval()


def _hidden_states(model: torch.nn.Module) -> int:
    with torch.no_grad():
        outputs = model(**example_inputs(model.config, model_class=type(model)), output_hidden_states=True)
    return len(outputs.hidden_states)


@pytest.mark.parametrize("model_type", PP_OCR_V6)
def test_pp_lcnet_v4_stem_feeds_its_first_block(model_type: str) -> None:
    backbone = tiny_config(model_type).backbone_config
    assert backbone.stem_channels[-1] == backbone.block_configs[0][0][1]
    for stage, following in zip(backbone.block_configs, backbone.block_configs[1:]):
        assert stage[-1][2] == following[0][1]  # each stage feeds the next
    assert max(len(stage) for stage in backbone.block_configs) <= 2
    assert backbone.stage_out_channels == [stage[-1][2] for stage in backbone.block_configs]


@pytest.mark.parametrize("model_type", DETECTORS)
def test_pp_ocr_detector_backbone_halves_every_stage_for_its_neck(model_type: str) -> None:
    config = tiny_config(model_type)
    backbone = config.backbone_config
    assert backbone.out_features == [f"stage{i}" for i in range(1, len(backbone.block_configs) + 1)]
    assert [stage[0][3] for stage in backbone.block_configs[1:]] == [2] * (len(backbone.block_configs) - 1)
    if hasattr(config, "layer_list_out_channels"):
        assert config.layer_list_out_channels == backbone.stage_out_channels
    maps = _built(model_type).backbone(**example_inputs(config, model_class=model_class_for(config))).feature_maps
    assert [m.shape[-1] for m in maps[1:]] == [m.shape[-1] // 2 for m in maps[:-1]]


def test_pp_ocr_medium_detector_neck_has_its_intraclass_blocks_and_fits_the_budget() -> None:
    config = tiny_config("pp_ocrv6_medium_det")
    assert config.intraclass_block_config["vertical_long_to_small_conv_longratio"] == [[7, 1], 1, [3, 0]]
    assert len(config.scale_factor_list) == len(config.backbone_config.block_configs)
    assert sum(p.numel() for p in _built("pp_ocrv6_medium_det").parameters()) <= PARAMETER_BUDGET


@pytest.mark.parametrize(
    ("model_type", "height", "steps"),
    [("pp_ocrv5_server_rec", 48, 8), ("pp_ocrv6_small_rec", 48, 8), ("pp_ocrv5_mobile_rec", 96, 2)],
)
def test_text_recognizers_get_a_text_line_the_sequence_encoder_reads(model_type: str, height: int, steps: int) -> None:
    model = _built(model_type)
    pixels = example_inputs(model.config, model_class=type(model))["pixel_values"]
    assert pixels.shape[2] == height and pixels.shape[3] > height  # a line: wider than high
    with torch.no_grad():
        features = model(pixel_values=pixels).last_hidden_state
    assert features.shape[2:] == (1, steps)  # the head pooled one row of `steps` time steps


def test_depth_pro_tiles_hold_a_patch_grid_and_hooks_read_real_layers() -> None:
    config = tiny_config("depth_pro")
    for tower in (config.image_model_config, config.patch_model_config, config.fov_model_config):
        assert tower.image_size == config.patch_size
        assert config.patch_size // tower.patch_size >= 4  # a grid of patches per tile, not one
    assert max(config.intermediate_hook_ids) < config.patch_model_config.num_hidden_layers
    pixels = example_inputs(config, model_class=model_class_for(config))["pixel_values"]
    assert pixels.shape[-1] * min(config.scaled_images_ratios) == config.patch_size


def test_uvdoc_head_reads_every_bridge_and_fits_the_budget() -> None:
    config = tiny_config("uvdoc")
    stages = config.backbone_config.stage_configs
    assert config.backbone_config.out_features == [f"stage{i}" for i in range(1, len(stages) + 1)]
    assert {width for stage in stages for width, _ in stage} == {config.bridge_connector[0]}
    model = _built("uvdoc")
    assert sum(p.numel() for p in model.parameters()) <= PARAMETER_BUDGET
    with torch.no_grad():
        points = model(**example_inputs(config, model_class=type(model))).last_hidden_state
    assert points.shape[1] == 2 and min(points.shape[2:]) >= 2  # a 2-D displacement grid, not one point


def test_sapiens2_per_layer_kv_heads_divide_the_heads_and_keep_grouping() -> None:
    config = tiny_config("sapiens2")
    per_layer = config.num_key_value_heads_per_layer
    assert len(per_layer) == config.num_hidden_layers
    assert all(config.num_attention_heads % kv == 0 for kv in per_layer)
    assert min(per_layer) < max(per_layer) == config.num_attention_heads  # grouped layers stay grouped


def test_reference_capture_hooks_are_installed_once_under_a_backbone() -> None:
    # PP-LCNetV4 hooks itself at build (a backbone); the outer model's forward never captures
    lazy, pinned = _built("pp_ocrv6_small_rec"), _built("pp_ocrv6_small_rec")
    install_capture_hooks(pinned)
    blocks = [m for m in pinned.modules() if type(m).__name__ == "PPLCNetV4Block"]
    assert blocks and all(len(block._forward_hooks) == 1 for block in blocks)
    assert _hidden_states(pinned) == _hidden_states(lazy) == len(blocks) + 1


def test_reference_capture_hooks_still_installed_where_forward_captures() -> None:
    model = _built("vit")
    install_capture_hooks(model)
    assert all(
        getattr(m, "_output_capturing_hooks_installed", False)
        for m in model.modules()
        if isinstance(m, PreTrainedModel)
    )
    assert any(m._forward_hooks for m in model.modules())
