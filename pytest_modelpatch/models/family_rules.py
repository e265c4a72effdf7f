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

from pytest_modelpatch.models.family_rules_text import TEXT_CONFIG_RULES

ConfigRule = Mapping[str, Any] | Callable[[dict[str, Any]], None]

# one table per modality, each in its own module
CONFIG_RULES: dict[str, ConfigRule] = {**TEXT_CONFIG_RULES}


def apply_config_rule(model_type: Any, level: dict[str, Any]) -> None:
    """Apply the rule for ``model_type`` (if any) to one shrunk config level, in place."""
    rule = CONFIG_RULES.get(model_type) if isinstance(model_type, str) else None
    if rule is None:
        return
    if callable(rule):
        rule(level)
    else:
        level.update(rule)
