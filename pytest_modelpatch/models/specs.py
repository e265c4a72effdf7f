"""What ``@pytest.mark.model(spec)`` names, resolved: a model type's tiny config, a config, a checkpoint.

``resolve_model_spec`` turns a spec and its config overrides into a :class:`ModelSpec` (the
config to build, and the checkpoint it came from); overrides that are no field of the config are
refused with the closest names; ``config_families`` lists the model types a config's model is
built from (a composite's towers). The model request (``models.builder.ModelRequest``) resolves
its spec here once.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.catalog import CONFIG_MAPPING_NAMES, tiny_config, unknown_model_type_message


@dataclass
class ModelSpec:
    """A resolved model spec: the config to build, and the checkpoint it came from if any."""

    config: PretrainedConfig
    source_dir: Path | None
    model_type: str
    label: str

    def __str__(self) -> str:
        where = f" from {self.source_dir}" if self.source_dir else " (tiny, seeded)"
        return f"{self.label}: {type(self.config).__name__}{where}"


def config_families(config: PretrainedConfig) -> list[str]:
    """The model types a model of ``config`` is built from: its own, then its sub-configs' (LLaVA: llava, llama, clip_vision_model)."""
    found: list[str] = []
    todo = [config]
    while todo:
        current = todo.pop(0)
        model_type = getattr(current, "model_type", "")
        if model_type and model_type not in found:
            found.append(model_type)
        todo += [value for value in vars(current).values() if isinstance(value, PretrainedConfig)]
    return found


def resolve_model_spec(spec: str | Path | PretrainedConfig, **config_overrides: Any) -> ModelSpec:
    """Resolve a model type, a config or a local checkpoint directory to a ``ModelSpec``.

    Example: ``resolve_model_spec("llama", num_hidden_layers=3).config.num_hidden_layers == 3``.
    """
    if isinstance(spec, PretrainedConfig):
        validate_config_overrides(spec, config_overrides)
        config = _with_overrides(spec, config_overrides)
        return ModelSpec(config, None, config.model_type, f"{config.model_type}-config")
    if not isinstance(spec, (str, os.PathLike)):
        raise PatchUsageError(
            "model spec must be a model type (e.g. 'llama'), a PretrainedConfig or a checkpoint directory, "
            f"not {type(spec).__name__}"
        )
    path = Path(spec)
    if (path / "config.json").is_file():
        base = AutoConfig.from_pretrained(path)
        validate_config_overrides(base, config_overrides)
        config = _with_overrides(base, config_overrides)
        return ModelSpec(config, path, config.model_type, path.name or str(path))
    if isinstance(spec, str) and spec in CONFIG_MAPPING_NAMES:
        if config_overrides:
            validate_config_overrides(AutoConfig.for_model(spec), config_overrides)
        return ModelSpec(tiny_config(spec, **config_overrides), None, spec, spec)
    if path.is_dir():
        raise PatchUsageError(f"model spec {str(spec)!r} is a directory without config.json, not a checkpoint")
    if not isinstance(spec, str) or os.sep in spec or "/" in spec:
        raise PatchUsageError(f"model spec {str(spec)!r}: no such checkpoint directory")
    raise PatchUsageError(f"model spec: {unknown_model_type_message(spec)}")


# not config fields, though a config would silently take them as new attributes
_NOT_CONFIG_FIELDS = {
    "attn_implementation": "pass it as @pytest.mark.model(..., attn_implementation=...) or "
    "ModelRequest(attn_implementation=...): it is a from_pretrained keyword, not a config field",
    "dtype": "the dtype comes from the dtype fixture: use @pytest.mark.dtypes(...) and the dtype fixture",
    "torch_dtype": "the dtype comes from the dtype fixture: use @pytest.mark.dtypes(...) and the dtype fixture",
}


def config_field_names(config: PretrainedConfig) -> list[str]:
    """Every name ``config`` takes as an override: its fields, ``__init__`` keywords and ``attribute_map`` aliases."""
    names = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for cls in (type(config), PretrainedConfig):
        names |= {
            name
            for name, param in inspect.signature(cls.__init__).parameters.items()
            if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL) and name != "self"
        }
    return sorted(name for name in names - set(_NOT_CONFIG_FIELDS) if not name.startswith("_"))


def validate_config_overrides(config: PretrainedConfig, overrides: Mapping[str, Any], prefix: str = "") -> None:
    """Refuse an override that names no field of ``config``: a config takes any keyword as a new attribute.

    Dict values aimed at a sub-config (``text_config={...}``) are checked against it.
    Example: ``validate_config_overrides(LlamaConfig(), {"num_hiden_layers": 5})`` raises, naming ``num_hidden_layers``.
    """
    valid = config_field_names(config)
    for key, value in overrides.items():
        if key in _NOT_CONFIG_FIELDS:
            raise PatchUsageError(
                f"{prefix}{key}={value!r} is not a {type(config).__name__} field: {_NOT_CONFIG_FIELDS[key]}."
            )
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise PatchUsageError(
                f"config override {prefix}{key}={value!r} is not a field of {type(config).__name__}, so no model would "
                f"use it.{hint} See {type(config).__name__}'s documentation for its fields."
            )
        sub = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(sub, PretrainedConfig):
            validate_config_overrides(sub, value, f"{prefix}{key}.")


def _with_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    """A copy of ``config`` with ``overrides``; dict values merge into sub-configs."""
    return type(config).from_dict(config.to_dict(), **overrides)
