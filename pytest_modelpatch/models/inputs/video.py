"""Video inputs: ``(batch, frames, channels, height, width)`` clips at the tiny config's sizes.

A model is a video model when its (vision) config counts frames (``num_frames``,
``frames_per_clip``, ``frame_num``) and its forward takes ``pixel_values_videos`` or
``pixel_values``; text-video models (X-CLIP, VideoPrism, TVP) get a text query beside.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.models.inputs.request import InputRequest
from pytest_modelpatch.models.inputs.text import text_companions, text_request_inputs
from pytest_modelpatch.models.tiny_sizes import is_int
from pytest_modelpatch.models.tiny_vision import FRAME_KEYS

VIDEO_NAMES = ("pixel_values_videos", "pixel_values")
# TVP (transformers 5.23) views its column position embeddings as (batch, 1, width, dim):
# only a batch of one fits, so it gets one clip.
SINGLE_CLIP = frozenset({"tvp"})


def video_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """A clip per batch row, plus the text a text-video model reads."""
    name = next((n for n in VIDEO_NAMES if request.takes(n)), None)
    vision = video_config(request.config)
    if name is None or vision is None:
        return None
    if request.config.model_type in SINGLE_CLIP and request.batch_size != 1:
        request = replace(request, batch_size=1)
    inputs: dict[str, torch.Tensor] = {}
    if request.takes("input_ids"):
        inputs.update(text_request_inputs(request))
        inputs.update(text_companions(request.config, request.model_class, inputs["input_ids"]))
    inputs[name] = clip(vision, request)
    return inputs


def video_config(config: PretrainedConfig) -> PretrainedConfig | None:
    """The config level that counts frames: the model's own or its vision tower's."""
    for level in (config, getattr(config, "vision_config", None), getattr(config, "video_config", None)):
        if level is not None and any(is_int(getattr(level, k, None)) for k in FRAME_KEYS):
            return level
    return None


def clip(vision: PretrainedConfig, request: InputRequest) -> torch.Tensor:
    """Seeded frames at the config's frame count, channels and image size."""
    frames = next(getattr(vision, k) for k in FRAME_KEYS if is_int(getattr(vision, k, None)))
    size: Any = next(
        (getattr(vision, k) for k in ("image_size", "crop_size", "max_img_size") if getattr(vision, k, None)), 32
    )
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_chans", None) or 3
    return request.randn(request.batch_size, frames, channels, height, width)

