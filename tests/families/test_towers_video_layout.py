"""Vision towers run alone, video models, document models: shrunk configs and the inputs they need."""

from __future__ import annotations

import pytest
import torch

from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.families.inputs.video import TOWER_FRAMES
from pytest_modelpatch.families.shrink.sizes import TINY_WIDTH
from pytest_modelpatch.models.checkpoints import seeded_model

PARAMETER_BUDGET = 5_000_000


def _forward(model_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], object]:
    config = tiny_config(model_type)
    model = seeded_model(config).eval()
    inputs = example_inputs(config, model_class=type(model))
    with torch.no_grad():
        return model, inputs, model(**inputs)


# -- Qwen-VL-style towers: packed patches and grid_thw -------------------------


@pytest.mark.parametrize("model_type", ["qwen2_5_vl_vision", "glm4v_vision", "video_llama_3_vision"])
def test_standalone_grid_tower_gets_packed_patches_that_match_its_grid(model_type: str) -> None:
    config = tiny_config(model_type)
    inputs = example_inputs(config, model_class=model_class_for(config))
    grid = inputs["grid_thw"]
    packed = inputs.get("hidden_states", inputs.get("pixel_values"))
    temporal = getattr(config, "temporal_patch_size", None) or 1
    channels = getattr(config, "in_channels", None) or config.num_channels
    assert "input_ids" not in inputs  # the tower inherits main_input_name="input_ids" but takes none
    assert packed.shape == (int(grid.prod(-1).sum()), channels * temporal * config.patch_size**2)
    merge = getattr(config, "spatial_merge_size", 1)
    assert bool((grid[:, 1:] % merge == 0).all())


def test_grid_tower_forward_merges_every_patch_group() -> None:
    model, inputs, output = _forward("qwen2_5_vl_vision")
    patches = int(inputs["grid_thw"].prod(-1).sum())
    merged = output.pooler_output if getattr(output, "pooler_output", None) is not None else output[0]
    assert merged.shape[0] == patches // model.config.spatial_merge_size**2


# -- NaFlex / NaViT patch sequences --------------------------------------------


def test_siglip2_tower_gets_a_padded_image_whose_mask_matches_its_spatial_shape() -> None:
    config = tiny_config("siglip2_vision_model")
    inputs = example_inputs(config, model_class=model_class_for(config))
    assert config.num_patches == 16  # the position table is resized to each image's grid
    lengths = inputs["spatial_shapes"].prod(-1)
    assert torch.equal(inputs["pixel_attention_mask"].sum(-1), lengths)
    assert lengths.min() < inputs["pixel_values"].shape[1]  # one image is padded
    assert inputs["pixel_values"].shape[-1] == config.num_channels * config.patch_size**2


def test_gemma4_tower_patch_grid_pools_by_its_kernel() -> None:
    model, inputs, output = _forward("gemma4_vision")
    kernel = model.config.pooling_kernel_size
    assert inputs["pixel_values"].shape[1] % kernel**2 == 0
    assert (
        output.last_hidden_state.shape[0]
        == inputs["pixel_values"].shape[0] * inputs["pixel_values"].shape[1] // kernel**2
    )


def test_minicpm_merger_insert_layer_is_kept_inside_the_shrunk_stack() -> None:
    config = tiny_config("minicpmv4_7_vision")
    assert 0 <= config.insert_layer_id < config.num_hidden_layers


# -- video ---------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["videomae", "vivit", "vjepa2", "videoprism_vision_model"])
def test_video_frames_and_tubelets_shrink_together(model_type: str) -> None:
    config = tiny_config(model_type)
    frames = getattr(config, "num_frames", None) or config.frames_per_clip
    tubelet = config.tubelet_size
    temporal, spatial = (tubelet[0], tubelet[1:]) if isinstance(tubelet, list) else (tubelet, [config.patch_size])
    size = getattr(config, "image_size", None) or config.crop_size
    assert frames <= 4 and frames % temporal == 0
    assert all(size % s == 0 for s in spatial)


def test_video_model_gets_clips_at_its_frame_count_and_runs() -> None:
    model, inputs, _ = _forward("videomae")
    config = model.config
    assert inputs["pixel_values"].shape == (
        2,
        config.num_frames,
        config.num_channels,
        config.image_size,
        config.image_size,
    )
    assert config.decoder_num_hidden_layers <= 2 and config.decoder_intermediate_size <= 128


def test_text_video_model_gets_text_beside_the_clip() -> None:
    config = tiny_config("xclip")
    inputs = example_inputs(config, model_class=model_class_for(config))
    assert inputs["pixel_values"].dim() == 5 and inputs["pixel_values"].shape[1] == config.vision_config.num_frames
    assert "input_ids" in inputs
    assert config.vision_config.mit_hidden_size <= TINY_WIDTH


@pytest.mark.parametrize("model_type", ["pe_video_encoder", "pe_video", "pe_audio_video_encoder", "pe_audio_video"])
def test_frame_encoder_video_tower_gets_clips_at_the_encoder_size(model_type: str) -> None:
    # PE-Video counts no frames: the clip is TOWER_FRAMES frames at the tiny timm ViT's img_size
    config = tiny_config(model_type)
    inputs = example_inputs(config, model_class=model_class_for(config))
    assert inputs["pixel_values_videos"].shape == (2, TOWER_FRAMES, 3, 16, 16)
    if model_type.startswith("pe_audio_video"):
        assert inputs["input_values"].dim() == 3  # the audio tower's waveform beside the clip
    assert ("input_ids" in inputs) == (not model_type.endswith("encoder"))


def test_pe_frame_encoder_is_shrunk_through_timm_model_args() -> None:
    config = tiny_config("pe_audio_video")
    vision = config.audio_video_config.video_config.vision_config
    assert vision.model_args["depth"] <= 2 and vision.model_args["embed_dim"] <= TINY_WIDTH
    assert vision.model_args["use_rot_pos_emb"] is False  # the tie-key workaround, this family only
    assert "use_rot_pos_emb" not in tiny_config("pe_video").video_config.vision_config.model_args


def test_vlm_with_an_unset_video_token_gets_no_frame_encoder_clip() -> None:
    # MiniCPM-V declares video_token_id (None by default): clips need placeholders, text only
    config = tiny_config("minicpmv4_6")
    assert "pixel_values_videos" not in example_inputs(config, model_class=model_class_for(config))


@pytest.mark.parametrize("model_type", ["pe_video", "pe_audio_video"])
def test_pe_video_families_run_every_tower_within_the_budget(model_type: str) -> None:
    pytest.importorskip("timm")
    model, _, outputs = _forward(model_type)
    assert sum(p.numel() for p in model.parameters()) <= PARAMETER_BUDGET
    names = {k for k, v in outputs.items() if v is not None}
    expected = {"logits_video_text"} | ({"logits_audio_video", "logits_audio_text"} if "audio" in model_type else set())
    assert expected <= names


# -- documents -----------------------------------------------------------------


def test_layoutlmv3_corner_and_size_embeddings_concatenate_to_the_hidden_size() -> None:
    config = tiny_config("layoutlmv3")
    assert 4 * config.coordinate_size + 2 * config.shape_size == config.hidden_size


@pytest.mark.parametrize("model_type", ["layoutlmv3", "lilt", "bros", "udop"])
def test_document_model_gets_one_valid_box_per_token(model_type: str) -> None:
    config = tiny_config(model_type)
    inputs = example_inputs(config, model_class=model_class_for(config))
    boxes = inputs["bbox"]
    assert boxes.shape == (*inputs["input_ids"].shape, 4)
    assert bool((boxes[..., 0] <= boxes[..., 2]).all() and (boxes[..., 1] <= boxes[..., 3]).all())
    limit = 1.0 if boxes.is_floating_point() else config.max_2d_position_embeddings - 1
    assert float(boxes.max()) <= limit


def test_layoutlmv3_reads_the_page_image_at_the_tiny_size() -> None:
    config = tiny_config("layoutlmv3")
    inputs = example_inputs(config, model_class=model_class_for(config))
    assert inputs["pixel_values"].shape[-1] == config.input_size == 32


# -- contrastive and hierarchical encoders -------------------------------------


def test_align_projection_matches_the_efficientnet_pooled_channels() -> None:
    model, inputs, output = _forward("align")
    assert output.image_embeds.shape[-1] == output.text_embeds.shape[-1] == model.config.projection_dim


def test_dual_encoder_vit_pooler_follows_the_tiny_width() -> None:
    config = tiny_config("vision-text-dual-encoder")
    assert config.vision_config.pooler_output_size == config.vision_config.hidden_size


@pytest.mark.parametrize("model_type", ["swin", "donut-swin"])
def test_swin_stages_double_from_a_narrow_start_and_hidden_size_names_the_last(model_type: str) -> None:
    config = tiny_config(model_type)
    last = config.embed_dim * 2 ** (len(config.depths) - 1)
    assert config.hidden_size == last <= 2 * TINY_WIDTH
    assert all(config.embed_dim * 2**i % h == 0 for i, h in enumerate(config.num_heads))
    model = seeded_model(config)
    assert sum(p.numel() for p in model.parameters()) < PARAMETER_BUDGET


def test_stages_that_keep_one_width_are_left_at_the_tiny_width() -> None:
    config = tiny_config("swin2sr")  # its stages do not downsample, so they never double
    assert config.embed_dim == TINY_WIDTH


@pytest.mark.parametrize("model_type", ["hunyuan_vl_vision", "gemma4_vision"])
def test_learned_position_grids_are_sized_for_the_tiny_image_not_the_full_one(model_type: str) -> None:
    model = seeded_model(tiny_config(model_type))
    positions = [p.numel() for name, p in model.named_parameters() if "position_embedding" in name]
    assert (
        positions and max(positions) <= 2 * 128 * TINY_WIDTH
    )  # was 65k positions x 64 (HunYuan-VL), 2 x 10240 x 64 (Gemma 4)
