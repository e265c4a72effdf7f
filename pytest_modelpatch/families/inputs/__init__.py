"""Deterministic example inputs for one forward of any tiny model, built from its config.

``example_inputs`` picks a builder by the model class's main input (``input_ids``,
``pixel_values``, ``input_features``, ...), after the builders for inputs the forward's
own parameters name (``SIGNATURE_BUILDERS``: grid metadata, videos, layout boxes).
Builders live with their modality (``text.py``, ``vision.py``, ``audio.py``,
``towers.py``, ``video.py``, ``layout.py``) and take an ``InputRequest``: the config, the
class, its forward's parameters, the sizes and a seeded generator. A builder returns
``None`` when the config is not of the shape it knows, and the caller is told to pass
inputs itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig, PreTrainedModel

from pytest_modelpatch.errors import ModelPatchError
from pytest_modelpatch.families.catalog import model_class_for
from pytest_modelpatch.families.inputs.audio import mel_features, waveform
from pytest_modelpatch.families.inputs.audio_families import AUDIO_INPUT_BUILDERS
from pytest_modelpatch.families.inputs.composite import composite_builder
from pytest_modelpatch.families.inputs.documents import DOCUMENT_INPUT_BUILDERS
from pytest_modelpatch.families.inputs.layout import layout_inputs
from pytest_modelpatch.families.inputs.request import InputRequest, forward_parameters, required
from pytest_modelpatch.families.inputs.series import series_inputs
from pytest_modelpatch.families.inputs.text import ordinary_token_ids, text_companions, text_inputs, text_request_inputs
from pytest_modelpatch.families.inputs.towers import grid_tower_inputs, patch_sequence_inputs
from pytest_modelpatch.families.inputs.trajectories import trajectory_inputs
from pytest_modelpatch.families.inputs.video import video_inputs
from pytest_modelpatch.families.inputs.vision import (
    grid_image_inputs,
    is_contrastive,
    pixel_inputs,
    pixel_values,
    single_stream_inputs,
    takes_image_grid,
)

__all__ = [
    "InputRequest",
    "example_inputs",
    "forward_parameters",
    "ordinary_token_ids",
    "required",
    "text_companions",
    "text_inputs",
]

Builder = Callable[[InputRequest], "dict[str, torch.Tensor] | None"]


def token_model_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Text, with the images a VLM splices in or a contrastive model embeds beside it."""
    config, params = request.config, request.params
    inputs = text_request_inputs(request)
    if takes_image_grid(config, params):
        inputs.update(grid_image_inputs(config, inputs["input_ids"], params, request.generator))
    inputs.update(text_companions(config, request.model_class, inputs["input_ids"]))
    if is_contrastive(config, params):
        inputs["pixel_values"] = pixel_values(config, request.batch_size, request.generator)
    return inputs


def generic_token_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """Perceiver's ``inputs`` is any preprocessed modality; its masked-LM head also takes ``input_ids``."""
    return text_request_inputs(request) if request.takes("input_ids") else None


# Inputs whose shape the forward's own parameters name (grid metadata, videos, layout
# boxes), tried in order before the main input's builder; each returns None if not its kind.
SIGNATURE_BUILDERS: tuple[Builder, ...] = (
    grid_tower_inputs,
    patch_sequence_inputs,
    video_inputs,
    layout_inputs,
    single_stream_inputs,
)

# model type -> a builder for inputs no modality rule derives, one table per modality module
FAMILY_INPUT_BUILDERS: dict[str, Builder] = {**AUDIO_INPUT_BUILDERS, **DOCUMENT_INPUT_BUILDERS}

# main input name -> builder
MAIN_INPUT_BUILDERS: dict[str, Builder] = {
    "input_ids": token_model_inputs,
    "pixel_values": pixel_inputs,
    "input_features": mel_features,
    "audio_mel": mel_features,  # Gemma 3n's audio encoder
    "input_values": waveform,
    "past_values": series_inputs,
    "states": trajectory_inputs,
    "inputs": generic_token_inputs,
}


def example_inputs(
    config: PretrainedConfig,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
    model_class: type[PreTrainedModel] | None = None,
) -> dict[str, torch.Tensor]:
    """Deterministic inputs for one forward of the model built from ``config``.

    Covered: ``input_ids`` (within the text vocabulary, avoiding special and
    multimodal placeholder ids) with ``attention_mask`` for every model that takes
    them, plus ``token_type_ids`` where the forward takes them and
    ``decoder_input_ids`` for encoder-decoders; ``pixel_values`` for vision-only
    models and beside the text for CLIP-like contrastive models;
    ``input_features`` for Whisper-like and ``input_values`` for wav2vec2-like
    audio models; one 4x4-patch image per row, between vision start/end tokens, for
    Qwen-VL-style models (``pixel_values`` + ``image_grid_thw``), so a patch of the
    vision tower (e.g. ``fusion_config={"patch_embeddings": True}``) is exercised.
    Vision towers run alone get what their processor emits (packed patches with
    ``grid_thw``, NaFlex patch rows with ``spatial_shapes``); video models get
    ``(batch, frames, C, H, W)`` clips; document models a valid ``bbox`` per token;
    audio language models audio for their tower, its placeholders spliced into the text.
    Other models with image placeholder tokens get text-only inputs.

    Example: ``model(**example_inputs(model.config))``.
    """
    cls = model_class or model_class_for(config)
    generator = torch.Generator().manual_seed(seed)
    request = InputRequest(config, cls, batch_size, seq_len, generator)
    main = getattr(cls, "main_input_name", "input_ids")
    if isinstance(main, (list, tuple)):
        main = main[0]  # OneFormer: ["pixel_values", "task_inputs"]
    if main not in request.params:
        # a tower's main_input_name is often inherited ("input_ids"): trust its forward
        takes = [n for n in ("input_ids", *MAIN_INPUT_BUILDERS) if n in request.params]
        main = takes[0] if takes else main
    # a family's own builder first (inputs no modality rule derives), then the shapes the
    # forward's parameters name, then the main input's
    family = FAMILY_INPUT_BUILDERS.get(config.model_type) or composite_builder(request)
    inputs = family(request) if family is not None else None
    if inputs is None:
        inputs = next((found for build in SIGNATURE_BUILDERS if (found := build(request)) is not None), None)
    builder = MAIN_INPUT_BUILDERS.get(main)
    if inputs is None and builder is not None:
        inputs = builder(request)
    if inputs is None:
        raise ModelPatchError(f"example_inputs cannot build {main!r} for {cls.__name__}: pass inputs= explicitly")
    return {name: tensor.to(device) for name, tensor in inputs.items()}
