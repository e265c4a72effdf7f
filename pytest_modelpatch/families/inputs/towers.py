"""Standalone vision towers of VLMs: packed patches with grid metadata, patch sequences.

A VLM's tower run on its own takes what its processor emits, not an image batch:
Qwen-VL-style towers take every image's patches flattened into one ``(patches, C*t*p*p)``
tensor with a ``grid_thw`` row per image; NaFlex/NaViT towers (SigLIP 2, Gemma 4) take
``(batch, patches, C*p*p)`` with the patch positions or grid sizes beside. Each image
here is a ``GRID_SIDE x GRID_SIDE`` patch grid, so every spatial merge (1, 2 or 4) tiles it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_request_inputs
from pytest_modelpatch.families.inputs.vision import is_contrastive

GRID_SIDE = 4  # patches per side of each example image: divisible by every merge size seen
GRID_NAMES = ("grid_thw", "image_grid_thw")
PACKED_NAMES = ("hidden_states", "pixel_values")
# How a tower wants its packed patches, where not the Qwen-VL ``(patches, C*t*p*p)`` rows.
PACKED_LAYOUTS: dict[str, str] = {
    "kimi_k25_vision": "patch_images",  # a Conv2d over each patch: (patches, C, p, p)
    # one merged token per row, channels last: (tokens, p*m, p*m, C); its grid counts tokens
    "inkling2_vision": "token_pixels",
}


def grid_tower_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """Qwen-VL-style tower: one image per batch row, its patches packed, ``grid_thw`` beside."""
    grid_name = next((n for n in GRID_NAMES if request.requires(n)), None)
    packed = next((n for n in PACKED_NAMES if request.requires(n)), None)
    if grid_name is None or packed is None or request.takes("input_ids"):
        return None
    config = request.config
    side = GRID_SIDE // _merge(config) if PACKED_LAYOUTS.get(config.model_type) == "token_pixels" else GRID_SIDE
    grid = torch.tensor([[1, side, side]] * request.batch_size)
    patches = request.batch_size * GRID_SIDE * GRID_SIDE
    inputs = {packed: _packed_patches(request, patches), grid_name: grid}
    if request.requires("merge_sizes"):  # VideoLLaMA 3: a spatial merge per image
        inputs["merge_sizes"] = torch.full((request.batch_size,), _merge(config), dtype=torch.long)
    return inputs


def _packed_patches(request: InputRequest, patches: int) -> torch.Tensor:
    config = request.config
    channels, patch = _channels(config), _patch(config)
    layout = PACKED_LAYOUTS.get(config.model_type, "patch_rows")
    if layout == "patch_images":
        return request.randn(patches, channels, patch, patch)
    if layout == "token_pixels":
        merge = _merge(config)
        return request.randn(patches // merge**2, patch * merge, patch * merge, channels)
    return request.randn(patches, channels * _temporal_patch(config) * patch * patch)


def _patch(config: PretrainedConfig) -> int:
    return int(getattr(config, "patch_size", 14))


def _channels(config: PretrainedConfig) -> int:
    return int(getattr(config, "in_channels", None) or getattr(config, "num_channels", None) or 3)


def _temporal_patch(config: PretrainedConfig) -> int:
    for key in ("temporal_patch_size", "patch_temporal"):  # MUSE Spark: patch_temporal
        value: Any = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return 1


def _merge(config: PretrainedConfig) -> int:
    for key in ("spatial_merge_size", "merge_size"):
        value: Any = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return 1


def patch_sequence_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """NaFlex/NaViT towers: patch rows with their positions or grid sizes beside.

    SigLIP 2 (``spatial_shapes``, ``pixel_attention_mask``): the second image is half as
    tall and padded, so the mask and the position resize are exercised. Gemma 4
    (``pixel_position_ids``): a grid two pooling kernels wide. MiniCPM-V
    (``target_sizes``): all images' patches in one strip, as its packer lays them out.
    """
    config = request.config
    vision = getattr(config, "vision_config", None) or config
    # a VLM built on a NaFlex tower (LFM2-VL) needs image placeholder tokens too: not here
    contrastive = request.takes("spatial_shapes") and is_contrastive(config, request.params)
    if request.requires("spatial_shapes") or contrastive:
        inputs = _naflex(request, vision)
    elif request.requires("pixel_position_ids"):
        inputs = _positioned_patches(request, vision)
    elif request.takes("target_sizes") and not request.takes("input_ids"):
        inputs = _navit_strip(request, vision)
    else:
        return None
    if request.takes("input_ids"):
        inputs.update(text_request_inputs(request))
    return inputs


def _naflex(request: InputRequest, vision: PretrainedConfig) -> dict[str, torch.Tensor]:
    batch, side = request.batch_size, GRID_SIDE
    shapes = torch.tensor([[side, side] if row % 2 == 0 else [side // 2, side] for row in range(batch)])
    lengths = shapes.prod(-1)
    mask = (torch.arange(side * side)[None, :] < lengths[:, None]).long()
    pixels = request.randn(batch, side * side, _channels(vision) * _patch(vision) ** 2) * mask[..., None]
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def _positioned_patches(request: InputRequest, vision: PretrainedConfig) -> dict[str, torch.Tensor]:
    side = 2 * int(getattr(vision, "pooling_kernel_size", None) or 1) or GRID_SIDE
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([cols.flatten(), rows.flatten()], dim=-1)  # (x, y) per patch
    # Gemma 4 patches are pixels in [0, 1] (it rescales them itself), always 3 channels
    pixels = torch.rand(request.batch_size, side * side, 3 * _patch(vision) ** 2, generator=request.generator)
    return {"pixel_values": pixels, "pixel_position_ids": positions.expand(request.batch_size, -1, -1).clone()}


def _navit_strip(request: InputRequest, vision: PretrainedConfig) -> dict[str, torch.Tensor]:
    patch, patches = _patch(vision), GRID_SIDE * GRID_SIDE
    strip = request.randn(1, _channels(vision), patch, request.batch_size * patches * patch)
    return {"pixel_values": strip, "target_sizes": torch.tensor([[GRID_SIDE, GRID_SIDE]] * request.batch_size)}
