"""Shrinking rules for vision-side configs: video frames and tubelets, the small heads beside
a tower, document layout embeddings, Swin-style stage widths. Pure dict work, called by
``tiny_configs.shrink_config_dict`` for every config level."""

from __future__ import annotations

from typing import Any

from pytest_modelpatch.families.tiny_sizes import (
    TINY_HEADS, TINY_IMAGE, TINY_INTERMEDIATE, TINY_LAYERS, TINY_PATCH, TINY_POSITIONS, TINY_VOCAB, TINY_WIDTH,
    is_int,
)

# Video models and the small heads beside a tower (VideoMAE's decoder, V-JEPA 2's
# predictor, X-CLIP's cross-frame transformer, VideoPrism's factorized encoder): named
# sizes the generic keys miss.
TINY_FRAMES = 4  # a multiple of every temporal tubelet (2), so frames still group
FRAME_KEYS = ("num_frames", "frames_per_clip", "frame_num")
TOWER_SIZE_KEYS: dict[str, int] = {
    "crop_size": TINY_IMAGE,  # V-JEPA 2's image size
    "max_img_size": TINY_IMAGE,  # TVP: its frame padding (visual_prompt_size) must fit twice
    "visual_prompt_size": TINY_IMAGE // 8,
    "decoder_num_hidden_layers": TINY_LAYERS, "pred_num_hidden_layers": TINY_LAYERS,
    "mit_num_hidden_layers": TINY_LAYERS, "num_spatial_layers": TINY_LAYERS,
    "num_temporal_layers": TINY_LAYERS, "num_auxiliary_layers": TINY_LAYERS, "num_pooler_layers": TINY_LAYERS,
    "pred_hidden_size": TINY_WIDTH, "mit_hidden_size": TINY_WIDTH, "pooler_output_size": TINY_WIDTH,
    "decoder_intermediate_size": TINY_INTERMEDIATE, "mit_intermediate_size": TINY_INTERMEDIATE,
    "pred_num_attention_heads": TINY_HEADS, "mit_num_attention_heads": TINY_HEADS,
    # NaFlex towers: a learned table of patch positions, resized to each image's grid
    "num_patches": (TINY_IMAGE // TINY_PATCH) ** 2, "position_embedding_size": TINY_POSITIONS,
    # HunYuan-VL: a learned (max_image_size / patch)**2 position grid, interpolated per image
    "max_image_size": 2 * TINY_IMAGE,
    # MGP-STR's subword heads predict over GPT-2's and BERT's vocabularies
    "num_bpe_labels": TINY_VOCAB, "num_wordpiece_labels": TINY_VOCAB,
}


def shrink_vision_sizes(out: dict[str, Any]) -> None:
    """Frames, tubelets and the heads beside a vision tower, kept consistent with the tiny image."""
    for key, tiny in TOWER_SIZE_KEYS.items():
        if is_int(out.get(key)) and out[key] > tiny:
            out[key] = tiny
    tubelet = out.get("tubelet_size")
    if isinstance(tubelet, list) and len(tubelet) == 3 and all(map(is_int, tubelet)):
        # (time, height, width): the spatial part is a patch of the tiny image
        out["tubelet_size"] = [min(tubelet[0], 2), *(min(v, TINY_PATCH) for v in tubelet[1:])]
    temporal = out["tubelet_size"][0] if isinstance(out.get("tubelet_size"), list) else out.get("tubelet_size")
    for key in FRAME_KEYS:
        if is_int(out.get(key)) and out[key] > TINY_FRAMES:
            step = temporal if is_int(temporal) and temporal > 0 else 1
            out[key] = max(step, TINY_FRAMES // step * step)


def fit_layout_embeddings(out: dict[str, Any]) -> None:
    """LayoutLMv3 concatenates four corner and two size embeddings into the hidden size:
    ``4 * coordinate_size + 2 * shape_size == hidden_size``; its page is the tiny image."""
    width = out.get("hidden_size")
    if is_int(out.get("coordinate_size")) and is_int(out.get("shape_size")) and is_int(width):
        out["coordinate_size"] = coordinate = width // 6
        out["shape_size"] = (width - 4 * coordinate) // 2
    if is_int(out.get("input_size")) and is_int(out.get("patch_size")):
        out["input_size"] = min(out["input_size"], TINY_IMAGE)


def fit_stage_widths(out: dict[str, Any], fixed: set[str]) -> None:
    """Swin-style stages double the width each time: start narrow enough that the last
    stage is no wider than twice the tiny width, and say so in ``hidden_size`` (the last
    stage's width, which encoder-decoders read)."""
    depths, embed = out.get("depths"), out.get("embed_dim")
    # hierarchical backbones have three or four stages, each halving the grid; Swin2SR's
    # six residual groups keep one width and are left alone
    if not (isinstance(depths, list) and 3 <= len(depths) <= 4 and is_int(embed)) or "embed_dim" in fixed:
        return
    out["embed_dim"] = embed = min(embed, max(2 * TINY_HEADS, TINY_WIDTH // 2 ** (len(depths) - 2)))
    if is_int(out.get("hidden_size")) and "hidden_size" not in fixed:
        out["hidden_size"] = embed * 2 ** (len(depths) - 1)

