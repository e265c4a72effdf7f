"""Tiny models of any installed transformers family, and inputs to run them.

``tiny_config("llama")`` shrinks the family's default config (``AutoConfig.for_model``)
so the model builds and runs a forward on CPU in milliseconds, keeping the shapes
valid: grouped-query ratios, head sizes the rope settings depend on, per-layer lists
sized to the new layer count, experts and top-k, and special token ids inside the
smaller vocabulary. Sub-configs (text, vision, audio) are shrunk the same way.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from pytest_modelpatch.errors import CheckpointError, ModelPatchError, PatchUsageError
from pytest_modelpatch.models.tiny_configs import shrink_config_dict, special_token_ids


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
    shrunk = shrink_config_dict(tree, overrides, {t: implicit_rope_defaults(t) for t in _model_types(tree)})
    try:
        return type(default).from_dict(shrunk)
    except Exception as exc:  # strict-dataclass validation errors are not ValueErrors
        if not overrides:
            raise
        first = str(exc).strip().splitlines()
        raise PatchUsageError(
            f"tiny_config({model_type!r}) with overrides {overrides} is not a valid {type(default).__name__}: "
            f"{' '.join(first[:2])}. Change the overrides so the sizes agree."
        ) from exc


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


@functools.lru_cache(maxsize=None)
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
        "`python -c \"from pytest_modelpatch.models.families import available_model_types as t; print(t())\"`"
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
}
DEFAULT_TASK_ORDER = ("masked-lm", "causal-lm", "base")


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
        mapping = getattr(modeling_auto, TASK_MAPPINGS[name])
        if type(config) in mapping:
            cls = mapping[type(config)]
            # some composite configs map to a text-only head (Qwen3.5 -> Qwen3_5ForCausalLM
            # takes the text sub-config); skip to a class that takes this config
            if task or cls.config_class not in type(config).sub_configs.values():
                return cls
    tried = task or " / ".join(DEFAULT_TASK_ORDER)
    raise PatchUsageError(
        f"{type(config).__name__} (model type {config.model_type!r}) has no {tried} model class; "
        "pass model_class= explicitly"
    )


# ---------------------------------------------------------------------------
# example inputs
# ---------------------------------------------------------------------------


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
    Other models with image placeholder tokens get text-only inputs.

    Example: ``model(**example_inputs(model.config))``.
    """
    cls = model_class or model_class_for(config)
    params = forward_parameters(cls)
    generator = torch.Generator().manual_seed(seed)
    main = getattr(cls, "main_input_name", "input_ids")
    if isinstance(main, (list, tuple)):
        main = main[0]  # OneFormer: ["pixel_values", "task_inputs"]
    inputs: dict[str, torch.Tensor]
    if main == "input_ids" or (main not in params and "input_ids" in params):
        inputs = text_inputs(config, batch_size, seq_len, generator)
        if _takes_image_grid(config, params):
            inputs.update(_grid_image_inputs(config, inputs["input_ids"], params, generator))
        inputs.update(text_companions(config, cls, inputs["input_ids"]))
        if _is_contrastive(config, params):
            inputs["pixel_values"] = _pixel_values(config, batch_size, generator)
    elif main == "pixel_values":
        inputs = {"pixel_values": _pixel_values(config, batch_size, generator)}
        if _required(cls, "input_ids"):  # grounded detectors read a text query too
            inputs.update(text_inputs(config, batch_size, seq_len, generator))
    elif main == "input_features" and hasattr(config, "max_source_positions"):
        frames = 2 * config.max_source_positions  # Whisper's two stride-2 convs
        inputs = {"input_features": torch.randn(batch_size, config.num_mel_bins, frames, generator=generator)}
    elif main == "input_values":
        inputs = {"input_values": torch.randn(batch_size, 4000, generator=generator)}
    else:
        raise ModelPatchError(f"example_inputs cannot build {main!r} for {cls.__name__}: pass inputs= explicitly")
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def _required(model_class: type[PreTrainedModel], name: str) -> bool:
    parameter = _signature(model_class.forward).parameters.get(name)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def forward_parameters(model_class: type[PreTrainedModel]) -> frozenset[str]:
    """Names the model's ``forward`` accepts."""
    return frozenset(_signature(model_class.forward).parameters)


@functools.lru_cache(maxsize=256)
def _signature(forward: Any) -> inspect.Signature:
    # Keyed by the function, which a patch may replace on the class. Read for every
    # drawn input, and inspect.signature costs as much as the rest of a draw.
    return inspect.signature(forward)


def text_companions(
    config: PretrainedConfig, model_class: type[PreTrainedModel], input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Inputs that go with ``input_ids``: segment ids for encoders, decoder ids for encoder-decoders."""
    params = forward_parameters(model_class)
    extra: dict[str, torch.Tensor] = {}
    if "token_type_ids" in params and getattr(config.get_text_config(), "type_vocab_size", 0):
        extra["token_type_ids"] = torch.zeros_like(input_ids)
    if config.is_encoder_decoder and "decoder_input_ids" in params:
        extra["decoder_input_ids"] = input_ids.clone()
    return extra


def text_inputs(
    config: PretrainedConfig, batch_size: int, seq_len: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random ``input_ids`` over the ordinary tokens of the vocabulary, all attended."""
    allowed = ordinary_token_ids(config)
    picks = torch.randint(len(allowed), (batch_size, seq_len), generator=generator)
    return {
        "input_ids": allowed[picks],
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
    }


def ordinary_token_ids(config: PretrainedConfig) -> torch.Tensor:
    """Token ids below the text vocab size that no ``*_token_id`` key of the config names.

    Multimodal models treat image/audio placeholder ids specially, so random text
    must avoid them.
    """
    vocab = int(getattr(config.get_text_config(), "vocab_size", 0) or 0)
    if vocab <= 0:
        raise ModelPatchError(f"{type(config).__name__} has no vocab_size: pass inputs= explicitly")
    special = special_token_ids(config.to_dict())
    ids = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    return ids if len(ids) else torch.arange(vocab)


_GRID = (1, 4, 4)  # (frames, patch rows, patch columns) of the example image


def _takes_image_grid(config: PretrainedConfig, params: Any) -> bool:
    vision = getattr(config, "vision_config", None)
    return (
        {"pixel_values", "image_grid_thw"} <= set(params)
        and getattr(config, "image_token_id", None) is not None
        and all(hasattr(vision, k) for k in ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels"))
    )


def _grid_image_inputs(
    config: PretrainedConfig, text_ids: torch.Tensor, params: Any, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Each row's text with one image spliced in, laid out as Qwen-VL processors do."""
    vision = config.vision_config
    batch = text_ids.shape[0]
    patches = _GRID[0] * _GRID[1] * _GRID[2]
    image = [config.image_token_id] * (patches // vision.spatial_merge_size**2)
    start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
    if start is not None and end is not None:
        image = [start, *image, end]
    head = text_ids[:, :2]
    ids = torch.cat([head, torch.tensor([image] * batch, dtype=text_ids.dtype), text_ids[:, 2:]], dim=1)
    volume = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch * patches, volume, generator=generator),
        "image_grid_thw": torch.tensor([_GRID] * batch),
    }
    if "mm_token_type_ids" in params:
        inputs["mm_token_type_ids"] = (ids == config.image_token_id).long()
    return inputs


def _is_contrastive(config: PretrainedConfig, params: Any) -> bool:
    """CLIP/SigLIP-like: the forward embeds text and images side by side, no image placeholders."""
    has_vision = getattr(config, "vision_config", None) is not None
    placeholders = any(k.startswith(("image_token", "video_token")) for k in config.to_dict())
    return has_vision and "pixel_values" in params and not placeholders


def _pixel_values(config: PretrainedConfig, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", 32)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    channels = getattr(vision, "num_channels", 3)
    return torch.randn(batch_size, channels, height, width, generator=generator)
