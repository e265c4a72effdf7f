"""Video inputs: ``(batch, frames, channels, height, width)`` clips at the tiny config's sizes.

A model is a video model when its (vision) config counts frames (``num_frames``,
``frames_per_clip``, ``frame_num``) and its forward takes ``pixel_values_videos`` or
``pixel_values``; text-video models (X-CLIP, VideoPrism, TVP) get a text query beside.
A video tower that embeds each frame with an image encoder reads any number of frames and
its config counts none (PE-Video): when the forward takes ``pixel_values_videos``, no video
placeholder token splices the clip into text, and a ``video_config`` / ``vision_config``
sub-config is the frame encoder, it gets ``TOWER_FRAMES`` frames at that encoder's size.
The text and the audio such a model reads beside (PE-Audio-Video) come with the clip.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.families.inputs.audio import waveform
from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_companions, text_request_inputs
from pytest_modelpatch.families.shrink.sizes import is_int
from pytest_modelpatch.families.shrink.vision import FRAME_KEYS

VIDEO_NAMES = ("pixel_values_videos", "pixel_values")
# TVP (transformers 5.23) views its column position embeddings as (batch, 1, width, dim):
# only a batch of one fits, so it gets one clip.
SINGLE_CLIP = frozenset({"tvp"})
# Frames of a clip for a tower whose config counts none. 3, not the example waveform's 4
# codec frames: PE-Audio-Video then stretches the video states to the audio's length
# (nearest-neighbour interpolation), a step equal lengths skip.
TOWER_FRAMES = 3
# sub-configs that lead from a video model to the encoder that embeds each frame
# (PE-Audio-Video: audio_video_config, or its video_config property, -> video_config ->
# vision_config, a timm ViT)
FRAME_ENCODER_KEYS = ("video_config", "audio_video_config", "vision_config")
# config keys naming the token a VLM's text uses as a clip's (or a frame's) placeholder;
# declared, even unset (MiniCPM-V's video_token_id defaults to None), they mark a VLM
PLACEHOLDER_KEYS = ("video_token_id", "video_token_index", "video_token", "image_token_id", "image_token_index")


def video_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """A clip per batch row, plus the text and the audio the model reads beside."""
    name = next((n for n in VIDEO_NAMES if request.takes(n)), None)
    if name is None:
        return None
    vision = video_config(request.config)
    frames = frame_count(vision) if vision is not None else None
    if vision is None and name == "pixel_values_videos":
        vision, frames = frame_encoder(request.config), TOWER_FRAMES
    if vision is None or frames is None:
        return None
    if request.config.model_type in SINGLE_CLIP and request.batch_size != 1:
        request = replace(request, batch_size=1)
    inputs: dict[str, torch.Tensor] = {}
    if request.takes("input_ids"):
        inputs.update(text_request_inputs(request))
        inputs.update(text_companions(request.config, request.model_class, inputs["input_ids"]))
    if request.takes("input_values") and not request.takes("input_features"):
        # an audio tower beside the video one (PE-Audio-Video): its raw waveform, so both
        # towers and the fusion over them run; models reading mel features are not this shape
        inputs.update(waveform(request))
    inputs[name] = clip(vision, request, frames)
    return inputs


def video_config(config: PretrainedConfig) -> PretrainedConfig | None:
    """The config level that counts frames: the model's own or its vision tower's."""
    for level in (config, getattr(config, "vision_config", None), getattr(config, "video_config", None)):
        if level is not None and any(is_int(getattr(level, k, None)) for k in FRAME_KEYS):
            return level
    return None


def frame_count(level: PretrainedConfig) -> int:
    """The frames a config level counts (``video_config`` found one)."""
    return next(getattr(level, k) for k in FRAME_KEYS if is_int(getattr(level, k, None)))


def frame_encoder(config: PretrainedConfig) -> PretrainedConfig | None:
    """The innermost frame-encoder sub-config of a video tower that counts no frames, or
    ``None`` for a VLM (placeholder tokens: its clips need matching text) and for
    a model with no such sub-config (nothing says what one frame looks like)."""
    if any(hasattr(config, k) for k in PLACEHOLDER_KEYS):
        return None
    found: PretrainedConfig | None = None
    level = _inner_encoder(config)
    while level is not None:
        found, level = level, _inner_encoder(level)
    return found


def _inner_encoder(level: PretrainedConfig) -> PretrainedConfig | None:
    """The first of ``FRAME_ENCODER_KEYS`` that is a sub-config of ``level``."""
    for key in FRAME_ENCODER_KEYS:
        sub = getattr(level, key, None)
        if isinstance(sub, PretrainedConfig):
            return sub
    return None


def frame_size(level: PretrainedConfig) -> int | tuple[int, ...]:
    """One frame's side (or (height, width)): the config's, a timm encoder's model_args /
    pretrained input size, else 32."""
    keys = ("image_size", "crop_size", "max_img_size")
    size: Any = next((getattr(level, k) for k in keys if getattr(level, k, None)), None)
    if size is None and level.model_type == "timm_wrapper":
        # TimmWrapperConfig has no size keys: timm.create_model takes img_size as a model arg,
        # and a pretrained config records the size it was trained at as (C, H, W)
        size = (getattr(level, "model_args", None) or {}).get("img_size")
        input_size = (getattr(level, "pretrained_cfg", None) or {}).get("input_size")
        size = size or (tuple(input_size[1:]) if input_size else None)
    return size or 32


def clip(vision: PretrainedConfig, request: InputRequest, frames: int | None = None) -> torch.Tensor:
    """Seeded frames at the config's frame count (or ``frames``), channels and image size."""
    frames = frames if frames is not None else frame_count(vision)
    size = frame_size(vision)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_chans", None) or 3
    return request.randn(request.batch_size, frames, channels, height, width)
