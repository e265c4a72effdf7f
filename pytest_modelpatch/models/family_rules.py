"""Per-family rules for what the generic shrinking in ``tiny_configs.py`` cannot derive.

Keyed by ``model_type``; a rule applies to every config level of that type (a top-level
config or a sub-config), after generic shrinking and before the user's overrides, which
always win. A rule is either a dict of values to set or a function that edits the shrunk
level in place. Each entry says why the generic rules are not enough; prefer teaching
``tiny_configs.py`` a general rule over adding an entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

ConfigRule = Mapping[str, Any] | Callable[[dict[str, Any]], None]


def _tvp(level: dict[str, Any]) -> None:
    # Frames of the generic tiny size (32) leave TVP's 32x-downsampling ResNet a 1x1 map,
    # which its grid encoder then max-pools by 2 to nothing. Its default ResNet-50 stages
    # (256..2048 channels) alone are 15M parameters; the grid encoder reads the last one.
    level["max_img_size"] = 64
    backbone = level.get("backbone_config")
    if isinstance(backbone, dict):
        backbone["hidden_sizes"] = [32, 64, 96, 128]
        backbone["embedding_size"] = 32


def _bros(level: dict[str, Any]) -> None:
    # BrosConfig.__post_init__ derives its box-embedding sizes from hidden_size and the
    # heads, but to_dict() saves the full model's values and from_dict() lets them win.
    for key in ("dim_bbox_sinusoid_emb_2d", "dim_bbox_sinusoid_emb_1d", "dim_bbox_projection"):
        level.pop(key, None)


def _align(level: dict[str, Any]) -> None:
    # ALIGN compares text embeddings projected to projection_dim with the EfficientNet's
    # pooled channels, round_filters(out_channels[-1]), unprojected: the two must agree.
    # A narrower, shallower EfficientNet keeps the tower under the parameter budget.
    vision = level.get("vision_config")
    if not isinstance(vision, dict):
        return
    vision.update(width_coefficient=0.5, depth_coefficient=0.25)  # one block per stage
    channels = vision["out_channels"][-1] * vision["width_coefficient"]
    divisor = vision["depth_divisor"]
    pooled = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    level["projection_dim"] = pooled + divisor if pooled < 0.9 * channels else pooled


CONFIG_RULES: dict[str, ConfigRule] = {
    "tvp": _tvp,
    "bros": _bros,
    "align": _align,
    # LiLT concatenates six layout embeddings of hidden_size // 6 back into hidden_size:
    # the width must divide by 6 (and by 4 heads and the channel_shrink_ratio of 4).
    "lilt": {"hidden_size": 48},  # frames too small for its ResNet + pooling, and a ResNet-50 backbone
}

def apply_config_rule(model_type: Any, level: dict[str, Any]) -> None:
    """Apply the rule for ``model_type`` (if any) to one shrunk config level, in place."""
    rule = CONFIG_RULES.get(model_type) if isinstance(model_type, str) else None
    if rule is None:
        return
    if callable(rule):
        rule(level)
    else:
        level.update(rule)
