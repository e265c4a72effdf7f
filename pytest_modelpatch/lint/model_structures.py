"""The names a family's tiny base model has, with and without replacement classes.

The contract lint (``pytest_modelpatch.lint.contract``) compares parameter and buffer names,
shapes and parallelism plans of the original and the patched structure; building them needs
torch, transformers and the family's tiny config, all imported when a structure is first built, so
``modelpatch lint`` with names only loads none of them. Models are built on the meta device (no memory, a few
milliseconds), on CPU only when a replacement cannot be built there. The replacement classes are
swapped into exactly the module attributes ``apply_patches`` would swap, for the build only, and
put back before returning: nothing global stays changed.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelStructure:
    """Parameter/buffer shapes, module classes and the config's plans of one built base model."""

    model_class: str
    tensors: dict[str, tuple[int, ...]]
    modules: dict[str, str]  # dotted path ("" for the root) -> class name
    tp_plan: dict[str, str] = field(default_factory=dict)
    pp_plan: dict[str, Any] = field(default_factory=dict)
    # loading strips or adds this prefix to fit the model (a base model from a ForXxx checkpoint and back)
    base_model_prefix: str = ""


def meta_structures(
    model_type: str, replacements: Mapping[str, tuple[type, tuple[str, ...]]], *, original: bool = True
) -> tuple[ModelStructure | None, ModelStructure]:
    """(original, patched) structures of ``model_type``'s tiny base model.

    ``replacements`` maps a transformers class name to (replacement class, modules binding it).
    ``original=False`` skips the original (None in its place): the lint caches it on disk.

    Example::

        original, patched = meta_structures(
            "llama", {"LlamaAttention": (LlamaFusedQKVAttention, ("transformers.models.llama.modeling_llama",))}
        )
        "layers.0.self_attn.qkv_proj.weight" in patched.tensors  # True
    """
    key = tuple(sorted((name, cls, tuple(modules)) for name, (cls, modules) in replacements.items()))
    return (_original(model_type) if original else None), _patched(model_type, key)


@functools.lru_cache(maxsize=64)
def _original(model_type: str) -> ModelStructure:
    return _build(model_type, ())


@functools.lru_cache(maxsize=64)
def _patched(model_type: str, key: tuple[tuple[str, type, tuple[str, ...]], ...]) -> ModelStructure:
    return _build(model_type, key)


def _build(model_type: str, swaps: tuple[tuple[str, type, tuple[str, ...]], ...]) -> ModelStructure:
    import torch

    config, model_class = _config_and_class(model_type)
    config = copy.deepcopy(config)  # a model may set attributes on its config while it is built
    with _swapped(swaps):
        try:
            with torch.device("meta"):
                model = model_class(config)
        except Exception:  # noqa: BLE001 - some kernels compute at __init__ and need real tensors
            model = model_class(config)
    tensors = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    modules = {n: type(m).__name__ for n, m in model.named_modules()}
    text = config.get_text_config()
    return ModelStructure(
        model_class.__name__, tensors, modules,
        dict(getattr(text, "base_model_tp_plan", None) or {}), dict(getattr(text, "base_model_pp_plan", None) or {}),
        str(getattr(model, "base_model_prefix", "") or ""),
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _config_and_class(model_type: str) -> tuple[Any, type]:
    # read once per process: a lint builds one patched model per patch of the family
    from pytest_modelpatch.families.catalog import model_class_for, tiny_config

    config = tiny_config(model_type)
    return config, model_class_for(config, "base")


@contextmanager
def _swapped(swaps: tuple[tuple[str, type, tuple[str, ...]], ...]) -> Iterator[None]:
    """Bind each replacement in the modules where ``apply_patches`` would, for the block only."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name, cls, modules in swaps:
            for module_name in modules:
                module = importlib.import_module(module_name)
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, cls)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
