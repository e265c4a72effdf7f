"""Refuse to compare two models that are not the same model, before any number is compared.

Every check that takes a reference and a patched model calls ``require_same_model``
first: comparing a Llama with a BERT, or a 2-layer Llama with a 3-layer one, measures
nothing about a patch. A patched model legitimately has other *module* classes, so
this looks only at what a patch does not change: the config's ``model_type``, the
top-level class (or a subclass of it), and the config's main sizes.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import unwrapped
from pytest_modelpatch.errors import ModelMismatchError

# sizes a patch never changes; compared on the text config when both models have them
SHAPE_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "head_dim", "num_experts", "num_local_experts",
)  # fmt: skip


def require_same_model(reference: torch.nn.Module, patched: torch.nn.Module, check: str) -> None:
    """Raise ``ModelMismatchError`` when ``reference`` and ``patched`` are different models.

    Plain modules without a config are left to the comparison itself; a wrapper that exposes
    ``get_base_model()`` (PEFT's ``PeftModel``) is judged by the model inside it.
    Example: ``require_same_model(reference_model, patched_model, "assert_equivalent")``.
    """
    __tracebackhide__ = True
    reference, patched = unwrapped(reference), unwrapped(patched)
    ref_config, pat_config = getattr(reference, "config", None), getattr(patched, "config", None)
    if not (_is_config(ref_config) and _is_config(pat_config)):
        return
    problems = []
    ref_type, pat_type = getattr(ref_config, "model_type", ""), getattr(pat_config, "model_type", "")
    if ref_type != pat_type:
        problems.append(f"model_type {ref_type!r} vs {pat_type!r}")
    ref_cls, pat_cls = type(reference), type(patched)
    # a patch may replace the top-level class with a subclass; an unrelated class is another model
    if ref_cls.__name__ != pat_cls.__name__ and not (issubclass(pat_cls, ref_cls) or issubclass(ref_cls, pat_cls)):
        problems.append(f"architecture {ref_cls.__name__} vs {pat_cls.__name__}")
    problems += _shape_differences(ref_config, pat_config)
    if problems:
        raise ModelMismatchError(
            f"{check}: the reference and patched models are different models ({'; '.join(problems)}), so comparing "
            f"their outputs says nothing about a patch. Compare two loads of one checkpoint: the reference_model and "
            f"patched_model fixtures of one @pytest.mark.model, or from_pretrained of the same directory with and "
            f"without the patch."
        )


def _is_config(config: Any) -> bool:
    return config is not None and hasattr(config, "to_dict") and hasattr(config, "model_type")


def _shape_differences(ref_config: Any, pat_config: Any) -> list[str]:
    ref_text, pat_text = _text_config(ref_config), _text_config(pat_config)
    differences = []
    for key in SHAPE_KEYS:
        ref_value, pat_value = _size(ref_text, key), _size(pat_text, key)
        if isinstance(ref_value, int) and isinstance(pat_value, int) and ref_value != pat_value:
            differences.append(f"{key} {ref_value} vs {pat_value}")
    return differences


def _size(config: Any, key: str) -> Any:
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - heterogeneous configs (Gemma 4) refuse global reads of per-layer sizes
        return vars(config).get(key)


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):  # several text sub-configs, or a config without the method
        return config
