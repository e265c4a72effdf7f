"""Image inputs: pixel values at the config's image size, Qwen-VL-style patch grids."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_companions, text_request_inputs

_GRID = (1, 4, 4)  # (frames, patch rows, patch columns) of the example image


# Keypoint matchers take a pair of images per row: (batch, 2, channels, height, width).
IMAGE_PAIR_TYPES = frozenset({"efficientloftr", "lightglue", "superglue"})
PAIR_IMAGE_SIZE = 64
# SegGPT stacks the prompt above the query: each is half the configured image height.
PROMPT_STACKED_TYPES = frozenset({"seggpt"})  # enough corners for SuperPoint-style detectors to find keypoints in


def pixel_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """``pixel_values`` for a vision model; grounded detectors read a text query too."""
    if request.config.model_type in IMAGE_PAIR_TYPES:
        return {"pixel_values": image_pairs(request)}
    inputs = {"pixel_values": pixel_values(request.config, request.batch_size, request.generator)}
    if request.config.model_type in PROMPT_STACKED_TYPES:
        inputs["pixel_values"] = inputs["pixel_values"][:, :, : inputs["pixel_values"].shape[2] // 2]
    if request.requires("input_ids"):
        inputs.update(text_request_inputs(request))
    inputs.update(image_companions(request, inputs["pixel_values"]))
    return inputs


def image_companions(request: InputRequest, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Required inputs beside the image: a prompt image and its mask (SegGPT paints the
    prompt's mask onto the query), or a task prompt's token ids (OneFormer)."""
    found: dict[str, torch.Tensor] = {}
    for name in sorted(request.params):
        if not request.requires(name):
            continue
        if name.endswith("pixel_values") and name != "pixel_values":
            found[name] = request.randn(*pixels.shape)
        elif name.startswith("prompt_mask"):
            found[name] = (request.randn(*pixels.shape) > 0).float()  # a binary mask, per channel
        elif name == "task_inputs":
            length = getattr(request.config, "task_seq_len", request.seq_len)
            vocab = getattr(request.config, "text_encoder_vocab_size", 2)
            found[name] = torch.randint(1, vocab, (request.batch_size, length), generator=request.generator)
    return found


def image_pairs(request: InputRequest) -> torch.Tensor:
    """Two views of one scene per row (the second a shifted copy), so matches exist."""
    size = getattr(request.config, "image_size", None)
    height, width = (size, size) if isinstance(size, int) else tuple(size or (PAIR_IMAGE_SIZE,) * 2)[:2]
    channels = getattr(request.config, "num_channels", 3)
    first = request.randn(request.batch_size, channels, height, width)
    second = torch.roll(first, shifts=(2, 3), dims=(2, 3))
    return torch.stack([first, second], dim=1)


def takes_image_grid(config: PretrainedConfig, params: Any) -> bool:
    """Qwen-VL-style: flattened patches plus ``image_grid_thw``, placeholders in the text."""
    vision = getattr(config, "vision_config", None)
    return (
        {"pixel_values", "image_grid_thw"} <= set(params)
        and getattr(config, "image_token_id", None) is not None
        and all(hasattr(vision, k) for k in ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels"))
    )


def grid_image_inputs(
    config: PretrainedConfig, text_ids: torch.Tensor, params: Any, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Each row's text with one image spliced in, laid out as Qwen-VL processors do."""
    vision = config.vision_config
    batch = text_ids.shape[0]
    patches = _GRID[0] * _GRID[1] * _GRID[2]
    image = [config.image_token_id] * (patches // vision.spatial_merge_size**2)
    start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
    if start is not None and end is not None:
        image = [start, *image, end]
    head = text_ids[:, :2]
    ids = torch.cat([head, torch.tensor([image] * batch, dtype=text_ids.dtype), text_ids[:, 2:]], dim=1)
    volume = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch * patches, volume, generator=generator),
        "image_grid_thw": torch.tensor([_GRID] * batch),
    }
    if "mm_token_type_ids" in params:
        inputs["mm_token_type_ids"] = (ids == config.image_token_id).long()
    return inputs


def is_contrastive(config: PretrainedConfig, params: Any) -> bool:
    """CLIP/SigLIP-like: the forward embeds text and images side by side, no image placeholders."""
    has_vision = getattr(config, "vision_config", None) is not None
    placeholders = any(k.startswith(("image_token", "video_token")) for k in config.to_dict())
    return has_vision and "pixel_values" in params and not placeholders


def pixel_values(config: PretrainedConfig, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of images at the (vision) config's size and channel count."""
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", 32)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    channels = getattr(vision, "num_channels", 3)
    return torch.randn(batch_size, channels, height, width, generator=generator)


def single_stream_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """ViLT-style: text and image patches in one transformer, sized by the model's own config.

    No vision sub-config and no placeholder tokens, so neither the contrastive nor the
    VLM path applies; without pixels the forward refuses to run.
    """
    config = request.config
    single = (
        request.takes("input_ids")
        and request.takes("pixel_values")
        and request.takes("pixel_mask")
        and getattr(config, "vision_config", None) is None
        and isinstance(getattr(config, "image_size", None), int)
    )
    if not single:
        return None
    inputs = text_request_inputs(request)
    inputs.update(text_companions(config, request.model_class, inputs["input_ids"]))
    inputs["pixel_values"] = pixel_values(config, request.batch_size, request.generator)
    return inputs
