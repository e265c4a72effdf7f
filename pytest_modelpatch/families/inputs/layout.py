"""Document inputs: tokens with a bounding box each, and the page image where the model reads it.

LayoutLM-style models (``bbox`` beside ``input_ids``) embed each token's box corners and,
LayoutLMv3 and UDOP, patches of the page. Boxes are valid (``x0 <= x1``, ``y0 <= y1``), in
the 0..1000 integer space the processors emit, or normalized to [0, 1] for the models
that scale them themselves.
"""

from __future__ import annotations

import torch

from pytest_modelpatch.families.inputs.request import InputRequest
from pytest_modelpatch.families.inputs.text import text_companions, text_request_inputs

PAGE_SPAN = 1000  # LayoutLM processors normalize boxes to 0..1000
# Models that take boxes as fractions of the page: BROS multiplies by ``bbox_scale``,
# UDOP by its position-table size (transformers 5.23).
NORMALIZED_BOXES = frozenset({"bros", "udop"})


def layout_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """Tokens, a box per token, and the page image when the forward takes one."""
    if not (request.takes("bbox") and request.takes("input_ids")):
        return None
    inputs = text_request_inputs(request)
    inputs.update(text_companions(request.config, request.model_class, inputs["input_ids"]))
    inputs["bbox"] = token_boxes(request)
    size = page_size(request)
    if size is not None and request.takes("pixel_values"):
        channels = getattr(request.config, "num_channels", 3)
        inputs["pixel_values"] = request.randn(request.batch_size, channels, size, size)
    return inputs


def token_boxes(request: InputRequest) -> torch.Tensor:
    """One valid box per token: ``(batch, seq_len, 4)`` as ``(x0, y0, x1, y1)``."""
    span = min(PAGE_SPAN, int(getattr(request.config, "max_2d_position_embeddings", PAGE_SPAN + 1)) - 1)
    corners = torch.randint(span + 1, (request.batch_size, request.seq_len, 2, 2), generator=request.generator)
    low, high = corners.min(dim=2).values, corners.max(dim=2).values  # (x, y) each
    boxes = torch.cat([low, high], dim=-1)
    if request.config.model_type in NORMALIZED_BOXES:
        return boxes.float() / span
    return boxes


def page_size(request: InputRequest) -> int | None:
    """The page image's side: LayoutLMv3's ``input_size``, UDOP's ``image_size``."""
    for key in ("input_size", "image_size"):
        value = getattr(request.config, key, None)
        if isinstance(value, int):
            return value
    return None
