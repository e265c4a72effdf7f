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

def _x4_feature_from_backbone(level: dict[str, Any]) -> None:
    # PP-DocLayoutV3's mask branch reads the backbone's first stage (stride 4) at
    # ``x4_feat_dim``, a number the config repeats instead of deriving
    stages = (level.get("backbone_config") or {}).get("stage_out_channels")
    if isinstance(stages, list) and stages:
        level["x4_feat_dim"] = stages[0]


CONFIG_RULES: dict[str, ConfigRule] = {
    # BiT's group norms use 32 groups; the tiny first stage's bottleneck has 8 channels
    "bit": {"num_groups": 8},
    # CvT indexes each stage's per-layer drop-path rates by the *stage* index
    # (transformers 5.x), so stage i needs more than i layers
    "cvt": {"depth": [1, 2, 3]},
    # pixel-decoder width; the generic rules do not touch ``feature_size`` (time-series
    # configs derive it from their inputs)
    "mask2former": {"feature_size": 64},
    "pp_doclayout_v3": _x4_feature_from_backbone,
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
