"""Shrinking rules for vision-side configs: video frames and tubelets, the small heads beside
a tower, document layout embeddings, Swin-style stage widths, and hierarchical backbones
(per-stage widths, their stem, a timm backbone swapped for a tiny ResNet, the channels a
detector follows, Swin windows). Pure dict work, called by
``configs.shrink_config_dict`` for every config level."""

from __future__ import annotations

from typing import Any, TypeGuard

from pytest_modelpatch.families.shrink.sizes import (
    TINY_HEADS,
    TINY_IMAGE,
    TINY_INTERMEDIATE,
    TINY_LAYERS,
    TINY_PATCH,
    TINY_POSITIONS,
    TINY_VOCAB,
    TINY_WIDTH,
    WIDTH_KEYS,
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
    "decoder_num_hidden_layers": TINY_LAYERS,
    "pred_num_hidden_layers": TINY_LAYERS,
    "mit_num_hidden_layers": TINY_LAYERS,
    "num_spatial_layers": TINY_LAYERS,
    "num_temporal_layers": TINY_LAYERS,
    "num_auxiliary_layers": TINY_LAYERS,
    "num_pooler_layers": TINY_LAYERS,
    "pred_hidden_size": TINY_WIDTH,
    "mit_hidden_size": TINY_WIDTH,
    "pooler_output_size": TINY_WIDTH,
    "decoder_intermediate_size": TINY_INTERMEDIATE,
    "mit_intermediate_size": TINY_INTERMEDIATE,
    "pred_num_attention_heads": TINY_HEADS,
    "mit_num_attention_heads": TINY_HEADS,
    # NaFlex towers: a learned table of patch positions, resized to each image's grid
    "num_patches": (TINY_IMAGE // TINY_PATCH) ** 2,
    "position_embedding_size": TINY_POSITIONS,
    # HunYuan-VL: a learned (max_image_size / patch)**2 position grid, interpolated per image
    "max_image_size": 2 * TINY_IMAGE,
    # MGP-STR's subword heads predict over GPT-2's and BERT's vocabularies
    "num_bpe_labels": TINY_VOCAB,
    "num_wordpiece_labels": TINY_VOCAB,
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


# Per-stage channel lists of hierarchical vision backbones (ResNet, ConvNeXt, PVT, ...).
STAGE_WIDTH_KEYS = (
    "hidden_sizes",
    "embed_dim",
    "embed_dims",
    "dims",
    "hidden_dims",
    "stage_in_channels",
    "stage_mid_channels",
    "stage_out_channels",
    "embed_dim_per_stage",
)
# Widest stage a tiny backbone keeps: ResNet-50's [256, ..., 2048] become [32, ..., 256]
# (bottlenecks a quarter as wide: 8 channels), about 0.4M parameters.
TINY_STAGE_WIDTH = 256


def shrink_stage_widths(out: dict[str, Any], fixed: set[str]) -> None:
    """Divide every per-stage width list of a level by one power of two, so the widest
    stage is at most ``TINY_STAGE_WIDTH``; one divisor for all lists keeps the equalities
    between them (HGNet's stage ``i + 1`` input is stage ``i``'s output) and every
    divisibility by a power of two (heads, groups) that held before."""
    lists = {k: out[k] for k in STAGE_WIDTH_KEYS if k not in fixed and _is_int_list(out.get(k)) and len(out[k]) > 1}
    widest = max((max(v) for v in lists.values()), default=0)
    divisor = 1
    while widest // divisor > TINY_STAGE_WIDTH and all(v % (divisor * 2) == 0 for vs in lists.values() for v in vs):
        divisor *= 2
    for key, values in lists.items():
        out[key] = [v // divisor for v in values]
    if divisor > 1:
        _divide_stem(out, lists, divisor, fixed)
    # Swin-style single embedding widths: vision.fit_stage_widths


# A transformers ResNet in place of a timm one (timm needs torchvision, which often cannot
# be installed beside a given torch); DETR-style configs build either. Stage indices
# mean the same in both ("stem", then stages 1-4).
TINY_RESNET_BACKBONE: dict[str, Any] = {
    "model_type": "resnet",
    "embedding_size": 32,
    "hidden_sizes": [32, 64, 128, 256],
    "depths": [1, 1, 1, 1],
}


def replace_timm_backbone(out: dict[str, Any], fixed: set[str]) -> None:
    """Swap a ``timm_backbone`` sub-config for a tiny transformers ResNet, same outputs."""
    backbone = out.get("backbone_config")
    if "backbone_config" in fixed or not (isinstance(backbone, dict) and backbone.get("model_type") == "timm_backbone"):
        return
    indices = backbone.get("out_indices") or [4]
    out["backbone_config"] = {
        **TINY_RESNET_BACKBONE,
        "num_channels": backbone.get("num_channels", 3),
        "out_indices": list(indices),
    }
    if "use_timm_backbone" in out:
        out["use_timm_backbone"] = False
    if out.get("backbone") is not None:
        out["backbone"] = None  # a timm model name: with a backbone_config it must be unset


def _divide_stem(out: dict[str, Any], lists: dict[str, list[int]], divisor: int, fixed: set[str]) -> None:
    """The stem feeds the first stage, so its widths shrink by the same divisor
    (TextNet: ``stem_out_channels == hidden_sizes[0]``; HGNet: ``stem_channels`` =
    [image channels, ..., first stage's input])."""
    firsts = {v[0] for v in lists.values()}
    for key, value in list(out.items()):
        if "stem" not in str(key) or key in fixed:
            continue
        if is_int(value) and value in firsts and value % divisor == 0:
            out[key] = value // divisor
        elif _is_int_list(value) and len(value) > 1 and all(v % divisor == 0 for v in value[1:]):
            out[key] = [value[0], *(v // divisor for v in value[1:])]


def follow_channels(before: dict[str, Any], out: dict[str, Any], fixed: set[str]) -> None:
    """Per-level channel lists a detector derives from other sizes (RT-DETR): the encoder
    reads the backbone's stages at ``out_indices``; the decoder reads the encoder width."""
    for key, value in before.items():
        if not (str(key).endswith("_in_channels") and _is_int_list(value)) or key in fixed:
            continue
        followed = next(
            (w for w in WIDTH_KEYS if is_int(before.get(w)) and before[w] != out.get(w) and set(value) == {before[w]}),
            None,
        )
        if followed is not None:
            out[key] = [out[followed]] * len(value)
    backbone = out.get("backbone_config")
    if "encoder_in_channels" in before and "encoder_in_channels" not in fixed and isinstance(backbone, dict):
        sizes, indices = backbone.get("hidden_sizes"), backbone.get("out_indices")
        if _is_int_list(sizes) and _is_int_list(indices) and len(indices) == len(before["encoder_in_channels"]):
            out["encoder_in_channels"] = [sizes[i - 1] for i in indices]  # index 0 is the stem


def _is_int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(map(is_int, value))


def fit_windows(out: dict[str, Any], fixed: set[str]) -> None:
    """Swin-style stages halve the patch grid each time; every stage's grid must hold a
    window, or the relative-position tables (sized by the window) stop matching."""
    depths, window, image = out.get("depths"), out.get("window_size"), out.get("image_size")
    if not (isinstance(depths, list) and is_int(window) and is_int(image) and is_int(out.get("patch_size"))):
        return
    if "window_size" not in fixed:
        out["window_size"] = window = min(window, 2)
    if "patch_size" not in fixed:
        out["patch_size"] = max(1, min(out["patch_size"], image // (window * 2 ** (len(depths) - 1))))
