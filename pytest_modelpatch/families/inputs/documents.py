"""Images for OCR, document and dense-prediction families whose config names no image size.

These configs carry no ``image_size``, so the generic builder's 32x32 image would be
downsampled to nothing (or to one pixel) before the parts under test run. Each size here
is the smallest that leaves every stage a real grid.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from pytest_modelpatch.families.inputs.request import InputRequest

# (height, width) of a text line: PP-OCR processors resize lines to 48 high (320 wide, cut
# to 64 here: 8 time steps for the sequence encoder after the backbone's 8x width stride)
TEXT_LINE = (48, 64)
DOCUMENT_IMAGE_SIZES: dict[str, tuple[int, int]] = {
    "pp_ocrv5_server_rec": TEXT_LINE,
    "pp_ocrv6_small_rec": TEXT_LINE,
    "pp_ocrv6_tiny_rec": TEXT_LINE,
    # the default PP-LCNetV3 strides 2 in both axes at every stage (32x), and the head then
    # average-pools 3x2: a 96-high line leaves it a 3x4 map (2 time steps)
    "pp_ocrv5_mobile_rec": (96, 128),
    # text detectors read four stages (strides 4..32) and fuse them: 2x2 at the coarsest
    "pp_ocrv6_small_det": (64, 64),
    "pp_ocrv6_medium_det": (64, 64),
    # UVDoc's dilated bridges (dilations 1..18) run at 1/16 of the page: 8x8 keeps the
    # small dilations' taps inside the grid
    "uvdoc": (128, 128),
}


def depth_pro_size(config: PretrainedConfig) -> tuple[int, int]:
    """DepthPro tiles its image at several scales; the smallest scale (0.25) must still
    hold one ``patch_size`` tile, so the image is ``patch_size / min(ratio)`` a side."""
    side = round(config.patch_size / min(config.scaled_images_ratios))
    return side, side


def document_image(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """``pixel_values`` at the family's working size (see ``DOCUMENT_IMAGE_SIZES``)."""
    config = request.config
    if config.model_type == "depth_pro":
        height, width = depth_pro_size(config)
    elif config.model_type in DOCUMENT_IMAGE_SIZES:
        height, width = DOCUMENT_IMAGE_SIZES[config.model_type]
    else:
        return None
    backbone = getattr(config, "backbone_config", None)
    channels = getattr(config, "num_channels", None) or getattr(backbone, "num_channels", None) or 3
    return {"pixel_values": request.randn(request.batch_size, channels, height, width)}


DOCUMENT_INPUT_BUILDERS: dict[str, Callable[[InputRequest], dict[str, torch.Tensor] | None]] = {
    model_type: document_image for model_type in (*DOCUMENT_IMAGE_SIZES, "depth_pro")
}
