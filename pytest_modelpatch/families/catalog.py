"""Tiny configs and model classes of any installed transformers family (inputs: ``families/inputs``).

``tiny_config("llama")`` shrinks the family's default config (``AutoConfig.for_model``)
so the model builds and runs a forward on CPU in milliseconds, keeping the shapes
valid: grouped-query ratios, head sizes the rope settings depend on, per-layer lists
sized to the new layer count, experts and top-k, and special token ids inside the
smaller vocabulary. Sub-configs (text, vision, audio) are shrunk the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto import configuration_auto, modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.shrink.configs import shrink_config_dict
from pytest_modelpatch.families.shrink.consistency import DERIVE_MARKERS
from pytest_modelpatch.families.shrink.validator_fit import MAX_FITS, fit_validator_message


def available_model_types() -> list[str]:
    """Model types of the installed transformers that have a modeling class, sorted.

    Example: ``"llama" in available_model_types()``.
    """
    return sorted(t for t in CONFIG_MAPPING_NAMES if t in modeling_auto.MODEL_MAPPING_NAMES)


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """The default config of ``model_type`` shrunk to run on CPU in milliseconds.

    Overrides are applied last; sizes that derive from them (``head_dim``, rope
    sections) follow unless overridden too. A dict override of a sub-config
    (``text_config={"num_hidden_layers": 3}``) is merged into the shrunk sub-config.

    Example: ``tiny_config("qwen2_moe", num_hidden_layers=3)``.
    """
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        raise PatchUsageError(unknown_model_type_message(model_type))
    default = AutoConfig.for_model(model_type)
    tree = default.to_dict()
    implicit = {t: implicit_rope_defaults(t) for t in _model_types(tree)}
    shrunk = shrink_config_dict(tree, overrides, implicit, derived_defaults(default))
    try:
        return _validated(type(default), shrunk, overrides)
    except Exception as exc:  # strict-dataclass validation errors are not ValueErrors
        if not overrides:
            raise
        first = str(exc).strip().splitlines()
        raise PatchUsageError(
            f"tiny_config({model_type!r}) with overrides {overrides} is not a valid {type(default).__name__}: "
            f"{' '.join(first[:2])}. Change the overrides so the sizes agree."
        ) from exc


def _validated(
    config_class: type[PretrainedConfig], tree: dict[str, Any], overrides: dict[str, Any]
) -> PretrainedConfig:
    """Build the config, first meeting the size equalities its validators name (``validator_fit``)."""
    for _ in range(MAX_FITS):
        try:
            return config_class.from_dict(tree)
        except Exception as exc:
            if not fit_validator_message(tree, str(exc), overrides):
                raise
    return config_class.from_dict(tree)


def derived_defaults(config: PretrainedConfig) -> dict[str, dict[str, Any]]:
    """Per model type in ``config``'s tree: int fields declared ``None``/``"auto"`` that
    ``__post_init__`` derived from other sizes (Bamba's ``mamba_d_head``), with that default."""
    found: dict[str, dict[str, Any]] = {}
    for level in _config_levels(config):
        fields = dataclasses.fields(level) if dataclasses.is_dataclass(level) else ()
        keys = {
            f.name: f.default
            for f in fields
            if f.default in DERIVE_MARKERS
            and isinstance(getattr(level, f.name, None), int)
            and not isinstance(getattr(level, f.name), bool)
        }
        found.setdefault(level.model_type, {}).update(keys)
    return found


def _config_levels(config: PretrainedConfig) -> list[PretrainedConfig]:
    levels = [config]
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            levels += _config_levels(value)
    return levels


# `self.mrope_section = config.rope_parameters.get("mrope_section", [16, 24, 24])`
_IMPLICIT_ROPE = re.compile(r"""rope_parameters\.get\(\s*["'](\w+)["']\s*,\s*(\[[\d,\s]+\])\s*\)""")


def _model_types(tree: dict[str, Any]) -> set[str]:
    found = {tree["model_type"]} if isinstance(tree.get("model_type"), str) else set()
    for value in tree.values():
        if isinstance(value, dict):
            found |= _model_types(value)
    return found


def implicit_rope_defaults(model_type: str) -> dict[str, Any]:
    """Rope settings a model type's modeling code falls back to when its config lacks them.

    Read from the modeling source next to the config class (Qwen2-VL, GLM-4V, ERNIE-VL
    default ``mrope_section`` to lists sized for the full model's head size).
    """
    return json.loads(_implicit_rope_json(model_type))  # a fresh copy: callers may edit it


@functools.cache
def _implicit_rope_json(model_type: str) -> str:
    # tiny_config runs for every model a session builds; read each family's source once.
    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        return "{}"
    module = sys.modules.get(config_class.__module__)
    folder = Path(module.__file__).parent if module is not None and module.__file__ else None
    found: dict[str, Any] = {}
    for path in sorted(folder.glob("modeling_*.py")) if folder is not None else []:
        for key, value in _IMPLICIT_ROPE.findall(path.read_text(encoding="utf-8")):
            found.setdefault(key, json.loads(value))
    return json.dumps(found)


def unknown_model_type_message(model_type: object) -> str:
    close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=5, cutoff=0.6)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return (
        f"unknown model type {model_type!r}{hint}. List the installed types with "
        '`python -c "from pytest_modelpatch.families.catalog import available_model_types as t; print(t())"`'
    )


# ---------------------------------------------------------------------------
# model classes
# ---------------------------------------------------------------------------

TASK_MAPPINGS: dict[str, str] = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING",
    "base": "MODEL_MAPPING",
    "text-to-waveform": "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING",
}
# text-to-waveform last: MusicGen's base and causal-LM classes take its decoder sub-config only
DEFAULT_TASK_ORDER = ("masked-lm", "causal-lm", "base", "text-to-waveform")


def model_class_for(config: PretrainedConfig, task: str | None = None) -> type[PreTrainedModel]:
    """The class to build for ``config``.

    With no task: the masked-LM class when the family has one (encoders; their
    causal-LM heads are decoder add-ons that warn without ``is_decoder``), else the
    causal-LM class (decoders), else the base model: a head with logits when there
    is one, since logits are the strictest thing to compare. A task (one of
    ``TASK_MAPPINGS``) picks that auto mapping only.

    Example: ``model_class_for(tiny_config("bert")).__name__ == "BertForMaskedLM"``.
    """
    if task is not None and task not in TASK_MAPPINGS:
        raise PatchUsageError(f"unknown task {task!r}: use one of {', '.join(TASK_MAPPINGS)}")
    for name in (task,) if task else DEFAULT_TASK_ORDER:
        cls = _mapped_class(getattr(modeling_auto, TASK_MAPPINGS[name]), type(config))
        if cls is not None:
            # some composite configs map to a text-only head (Qwen3.5 -> Qwen3_5ForCausalLM
            # takes the text sub-config); skip to a class that takes this config
            if task or cls.config_class not in type(config).sub_configs.values():
                return cls
    tried = task or " / ".join(DEFAULT_TASK_ORDER)
    raise PatchUsageError(
        f"{type(config).__name__} (model type {config.model_type!r}) has no {tried} model class; "
        "pass model_class= explicitly"
    )


def _mapped_class(mapping: Any, config_class: type[PretrainedConfig]) -> type[PreTrainedModel] | None:
    # ``in`` on a lazy auto mapping goes by the config class's name and misses some registered
    # families (Evolla, 5.23) that a lookup finds.
    try:
        return mapping[config_class]
    except KeyError:
        return None
    except ValueError:
        return _unexported_class(mapping, config_class)


def _unexported_class(mapping: Any, config_class: type[PretrainedConfig]) -> type[PreTrainedModel] | None:
    # transformers 5.23 maps voxtral_realtime_text to VoxtralRealtimeTextModel, which its
    # modeling module defines but its package does not export: the lookup raises ValueError
    name = getattr(mapping, "_model_mapping", {}).get(config_class.model_type)
    if not isinstance(name, str):
        return None
    package = configuration_auto.model_type_to_module_name(config_class.model_type)
    try:
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    except ImportError:
        return None
    found = getattr(module, name, None)
    return found if isinstance(found, type) else None
