"""Prompted segmentation and open-vocabulary detection: an image plus what to look for.

SAM-style models segment the object a few clicked points mark; SAM 3 segments what a text prompt names, optionally refined by boxes (its geometry
encoder); OmDet-Turbo detects a per-image list of class names under a task prompt, both
tokenized for its CLIP text tower. Each builder returns ``None`` when the forward is not
of its shape.
"""

from __future__ import annotations

import importlib.util

import torch

from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_inputs, text_request_inputs
from pytest_modelpatch.families.inputs.vision import pixel_values

PROMPT_POINTS = 2  # one positive and one negative click per image
PROMPT_BOXES = 2  # one positive and one negative box per image
CLASSES_PER_IMAGE = 3  # open-vocabulary class names per image


def takes_point_prompt(request: InputRequest) -> bool:
    """SAM / SAM 2-style: pixels and clicked points for a prompt encoder."""
    return {"pixel_values", "input_points", "input_labels"} <= request.params and hasattr(
        request.config, "prompt_encoder_config"
    )


def point_prompt_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Images and one object per image marked by a positive and a negative click.

    Points are pixel coordinates in the prompt encoder's input frame, ``(batch, objects,
    points, 2)``; labels 1 (on the object) and 0 (background), ``(batch, objects, points)``.
    Without them the models embed only a padding point and skip the point embeddings.
    """
    config, batch, generator = request.config, request.batch_size, request.generator
    size = config.prompt_encoder_config.image_size
    points = torch.rand(batch, 1, PROMPT_POINTS, 2, generator=generator) * (size - 1)
    return {
        "pixel_values": pixel_values(config, batch, generator),
        "input_points": points,
        "input_labels": torch.tensor([[[1, 0]]] * batch),
    }


def takes_text_prompt(request: InputRequest) -> bool:
    """SAM 3-style: pixels, a text prompt (ids or embeddings, one of them) and optional boxes."""
    return {"pixel_values", "input_ids", "text_embeds", "input_boxes"} <= request.params and hasattr(
        request.config, "text_config"
    )


def text_prompt_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Images, a text prompt per image, and boxes (cx, cy, w, h in [0, 1]) for the geometry encoder.

    The geometry encoder pools box features with ``torchvision.ops.roi_align``: without
    torchvision installed the boxes are left out and the text prompt alone drives the model.
    """
    batch, generator = request.batch_size, request.generator
    inputs = text_request_inputs(request)
    inputs["pixel_values"] = pixel_values(request.config, batch, generator)
    if importlib.util.find_spec("torchvision") is None:
        return inputs
    centres = 0.25 + 0.5 * torch.rand(batch, PROMPT_BOXES, 2, generator=generator)
    sizes = 0.1 + 0.3 * torch.rand(batch, PROMPT_BOXES, 2, generator=generator)
    inputs["input_boxes"] = torch.cat([centres, sizes], dim=-1)
    if request.takes("input_boxes_labels"):
        inputs["input_boxes_labels"] = torch.tensor([[1, 0]] * batch)  # a positive and a negative box
    return inputs


def takes_class_list(request: InputRequest) -> bool:
    """OmDet-Turbo-style: class names and a task prompt, tokenized, with each image's class count."""
    return {"pixel_values", "classes_input_ids", "tasks_input_ids", "classes_structure"} <= request.params


def class_list_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Images, ``CLASSES_PER_IMAGE`` class names per image (flattened) and one task prompt per image."""
    config, batch, generator = request.config, request.batch_size, request.generator
    text = getattr(config, "text_config", None) or config
    classes = text_inputs(text, batch * CLASSES_PER_IMAGE, max(2, request.seq_len // 2), generator)
    eos = getattr(text, "eos_token_id", None)
    if isinstance(eos, int):  # a class embedding pools the CLIP text at its end token (the largest id)
        classes["input_ids"][:, -1] = eos
    tasks = text_inputs(text, batch, request.seq_len, generator)
    return {
        "pixel_values": pixel_values(config, batch, generator),
        "classes_input_ids": classes["input_ids"],
        "classes_attention_mask": classes["attention_mask"],
        "tasks_input_ids": tasks["input_ids"],
        "tasks_attention_mask": tasks["attention_mask"],
        "classes_structure": torch.full((batch,), CLASSES_PER_IMAGE, dtype=torch.long),
    }
