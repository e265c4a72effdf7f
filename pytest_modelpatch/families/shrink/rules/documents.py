"""Per-family config rules for OCR, document and dense-prediction families (PP-OCR, Sapiens 2).

Same contract as ``rules.CONFIG_RULES`` (which merges this table): keyed by
``model_type``, applied to the shrunk level after the generic rules and before overrides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

ConfigRule = Mapping[str, Any] | Callable[[dict[str, Any]], None]

# PP-LCNetV4 blocks kept per stage: the first (which strides) and one more
LCNET_V4_BLOCKS_PER_STAGE = 2


def _lcnet_v4(level: dict[str, Any]) -> None:
    """PP-LCNetV4 lists each block's channels in ``block_configs`` and derives ``depths``
    and ``stage_out_channels`` from them; the generic rules would halve the stem and the
    derived lists but not the blocks, so the stem no longer feeds the first block. Halve
    stem and blocks together, keep the first blocks of each stage, let the config derive
    the rest."""
    blocks = level.get("block_configs")
    stem = level.get("stem_channels")
    if not (isinstance(blocks, list) and isinstance(stem, list) and len(stem) == 3):
        return
    level["block_configs"] = [
        [
            [kernel, cin // 2, cout // 2, stride, se]
            for kernel, cin, cout, stride, se in stage[:LCNET_V4_BLOCKS_PER_STAGE]
        ]
        for stage in blocks
    ]
    level["stem_channels"] = [stem[0], stem[1] // 2, stem[2] // 2]
    for derived in ("depths", "stage_out_channels"):
        level.pop(derived, None)


def _ppocr_det_backbone(level: dict[str, Any]) -> None:
    """PP-OCRv6 detectors build on the default PP-LCNetV4, whose blocks are the
    recognizer's (strides ``1``, ``[2, 1]``: text lines keep their width) and which returns
    only its last stage; the detector's FPN neck reads all four stages and upsamples each by
    2 onto the one before, so each must be half the size of the one before."""
    backbone = level.get("backbone_config")
    if not isinstance(backbone, dict) or not isinstance(backbone.get("block_configs"), list):
        return
    blocks = backbone["block_configs"]
    for index, stage in enumerate(blocks):
        # the first stage keeps the stem's stride 4; every later one halves the grid
        stage[0][3] = 2 if index else 1
        for block in stage[1:]:
            block[3] = 1
    backbone["out_indices"] = list(range(1, len(blocks) + 1))
    backbone["out_features"] = [f"stage{i}" for i in range(1, len(blocks) + 1)]
    if isinstance(level.get("layer_list_out_channels"), list):
        # PP-OCRv6 small det repeats the stage widths for its neck
        level["layer_list_out_channels"] = [stage[-1][2] for stage in blocks]


def _ppocr_intraclass_neck(level: dict[str, Any]) -> None:
    """PP-OCRv6 medium det's neck leaves its Intra-Class Block convs, head kernels and
    per-level upsampling unset (``None``) in the default config; the modeling code indexes
    them. PaddleOCR's values: 1x1 reduce/return convs, 7/5/3-long vertical, horizontal and
    square convs (args: kernel, stride, padding), levels upsampled back to stride 4."""
    _ppocr_det_backbone(level)
    if level.get("intraclass_block_config") is None:
        level["intraclass_block_config"] = {
            "reduce_channel": [1, 1, 0],
            "return_channel": [1, 1, 0],
            "vertical_long_to_small_conv_longratio": [[7, 1], 1, [3, 0]],
            "vertical_long_to_small_conv_midratio": [[5, 1], 1, [2, 0]],
            "vertical_long_to_small_conv_shortratio": [[3, 1], 1, [1, 0]],
            "horizontal_small_to_long_conv_longratio": [[1, 7], 1, [0, 3]],
            "horizontal_small_to_long_conv_midratio": [[1, 5], 1, [0, 2]],
            "horizontal_small_to_long_conv_shortratio": [[1, 3], 1, [0, 1]],
            "symmetric_conv_long_longratio": [[7, 7], 1, [3, 3]],
            "symmetric_conv_long_midratio": [[5, 5], 1, [2, 2]],
            "symmetric_conv_long_shortratio": [[3, 3], 1, [1, 1]],
        }
    level["neck_out_channels"] = min(level.get("neck_out_channels") or 64, 64)  # 256: 7M parameters in the neck
    if level.get("kernel_list") is None:
        level["kernel_list"] = [3, 2, 2]
    if level.get("scale_factor_list") is None:
        level["scale_factor_list"] = [1, 2, 4, 8]


def _per_layer_kv_heads(level: dict[str, Any]) -> None:
    """Sapiens 2 lists key/value heads per layer (16 for full attention, 8 grouped), which
    must divide the shrunk head count: keep each layer's ratio to the widest."""
    heads, per_layer = level.get("num_attention_heads"), level.get("num_key_value_heads_per_layer")
    if isinstance(heads, int) and isinstance(per_layer, list) and per_layer:
        widest = max(per_layer)
        level["num_key_value_heads_per_layer"] = [max(1, kv * heads // widest) for kv in per_layer]


def _depth_pro(level: dict[str, Any]) -> None:
    """DepthPro cuts the image into overlapping ``patch_size`` tiles, each a whole DINOv2
    image (the config copies ``patch_size`` into the towers' ``image_size``). The generic
    patch size (8) would make each tile one DINOv2 patch: 32 keeps a 4x4 grid. The fusion
    stage reads two hidden states by index (layers 11 and 5 of 12), scaled into the tiny
    depth, and its widths (256..1024 channels) are shrunk by a quarter."""
    level["patch_size"] = 32
    towers = [v for v in level.values() if isinstance(v, dict) and v.get("model_type") == "dinov2"]
    layers = min((t["num_hidden_layers"] for t in towers), default=2)
    hooks = level.get("intermediate_hook_ids") or [11, 5]
    level["intermediate_hook_ids"] = [h * layers // 12 for h in hooks]
    for key in ("fusion_hidden_size",):
        level[key] = min(level.get(key) or 64, 64)
    for key in ("intermediate_feature_dims", "scaled_images_feature_dims"):
        if isinstance(level.get(key), list):
            level[key] = [max(32, v // 8) for v in level[key]]


def _uvdoc(level: dict[str, Any]) -> None:
    """UVDoc's head concatenates every bridge's output (``bridge_connector``: six 128-wide
    stages in), but the backbone's default ``out_features`` is only its last stage."""
    backbone = level.get("backbone_config")
    if isinstance(backbone, dict) and isinstance(backbone.get("stage_configs"), list):
        stages = len(backbone["stage_configs"])
        backbone["out_indices"] = list(range(1, stages + 1))
        backbone["out_features"] = [f"stage{i}" for i in range(1, stages + 1)]
        # every width is a plain number inside nested lists (7.9M parameters at 32..128
        # channels with 5x5 kernels): halve them all, image channels and dilations kept
        head = backbone.get("resnet_head") or []
        backbone["resnet_head"] = [[cin if i == 0 else cin // 2, cout // 2] for i, (cin, cout) in enumerate(head)]
        backbone["resnet_configs"] = [
            [[cin // 2, cout // 2, dilation, down] for cin, cout, dilation, down in stage]
            for stage in backbone.get("resnet_configs") or []
        ]
        backbone["stage_configs"] = [
            [[width // 2, dilation] for width, dilation in stage] for stage in backbone["stage_configs"]
        ]
        if isinstance(level.get("bridge_connector"), list):
            level["bridge_connector"] = [v // 2 for v in level["bridge_connector"]]
        points = level.get("out_point_positions2D")
        if isinstance(points, list) and points:
            level["out_point_positions2D"] = [[points[0][0] // 2, points[0][1]], *points[1:]]


DOCUMENT_CONFIG_RULES: dict[str, ConfigRule] = {
    "depth_pro": _depth_pro,
    "uvdoc": _uvdoc,
    "pp_lcnet_v4": _lcnet_v4,
    "pp_ocrv6_small_det": _ppocr_det_backbone,
    "pp_ocrv6_medium_det": _ppocr_intraclass_neck,
    "sapiens2": _per_layer_kv_heads,
}
