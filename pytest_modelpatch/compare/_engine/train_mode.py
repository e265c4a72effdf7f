"""Train mode for a check, and everything it changed put back after: flags, dropout, checkpointing, ``.grad``.

``training_state`` puts a model in train mode with every dropout at 0 (modules, configs and the
functional calls), ``.grad`` cleared and gradient checkpointing as asked, and restores all of it,
so a session-shared reference model is left exactly as it was found. Forward divergence, blame
and the backward and training checks all run a model this way.
"""

from __future__ import annotations

import operator
import re
import sys
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from pytest_modelpatch.errors import PatchUsageError

_ABSENT: Any = object()


# Names of the probabilities of training-only randomness in transformers' configs and modules:
# attention_dropout, hidden_dropout_prob, classifier_dropout, dropout_rate, GPT-2's resid_pdrop,
# Wav2Vec2's layerdrop, the vision backbones' drop_path_rate, attn_drop_rate, proj_drop_rate.
_DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop|drop_path|(?:^|_)drop(?:_|$)")


def _is_dropout_attr(name: str, value: Any) -> bool:
    return isinstance(value, float) and _DROPOUT_NAME.search(name) is not None


def _configs(holders: list[torch.nn.Module]) -> list[Any]:
    """The configs the scanned modules hold now, with their sub-configs at any depth (read fresh at each use)."""
    found: dict[int, Any] = {}
    pending = [getattr(module, "config", None) for module in holders]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "to_dict"):
            continue  # most modules share the model's config: its attributes are read once
        found[id(config)] = config
        # text_config, vision_config, and theirs: a composite's towers read their own
        pending += [v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return list(found.values())


# ---------------------------------------------------------------------------
# Dropout off by what runs, not by where its probability is kept
# ---------------------------------------------------------------------------

# torch's dropout functions with where each takes its probability: (position, keyword). A module
# may keep its probability anywhere (a functools.partial bound at __init__, a closure, a constant),
# but the draw goes through one of these.
_DROPOUT_FUNCTIONS: dict[Any, tuple[int, str]] = {
    **{fn: (1, "p") for fn in (
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
        torch.dropout, torch.dropout_, torch.alpha_dropout, torch.alpha_dropout_, torch.feature_dropout,
        torch.feature_dropout_, torch.feature_alpha_dropout, torch.feature_alpha_dropout_, torch.native_dropout,
    )},
    F.scaled_dot_product_attention: (4, "dropout_p"),
    F.multi_head_attention_forward: (10, "dropout_p"),
}  # fmt: skip
_DROPOUT_OFF: ContextVar[bool] = ContextVar("modelpatch_dropout_off", default=False)


class _DropoutOff(TorchFunctionMode):
    """Every torch dropout function called with probability 0 while :data:`_DROPOUT_OFF` is set."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        where = _DROPOUT_FUNCTIONS.get(func) if _DROPOUT_OFF.get() else None
        if where is not None:
            index, name = where
            if len(args) > index:
                args = (*args[:index], 0.0, *args[index + 1 :])
            else:
                kwargs = {**kwargs, name: 0.0}
        return func(*args, **kwargs)


@contextmanager
def _dropout_functions_off() -> Iterator[None]:
    """Run torch's dropout functions at probability 0 for the block (nested blocks share one mode)."""
    outermost = not any(isinstance(mode, _DropoutOff) for mode in _torch_function_modes())
    token = _DROPOUT_OFF.set(True)
    try:
        if outermost:
            with _DropoutOff():
                yield
        else:
            yield
    finally:
        _DROPOUT_OFF.reset(token)


def _torch_function_modes() -> list[Any]:
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


# what each model's training_state set to 0, so that as_configured can put it back for a block
_ZEROED: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[Any, str, Any]]] = weakref.WeakKeyDictionary()


@contextmanager
def as_configured(*models: torch.nn.Module) -> Iterator[None]:
    """Inside :func:`training_state`: every dropout value as the user had it, torch's dropout functions as they are.

    For what must be judged in true eval mode (the eval log-probabilities after training): a module
    that applies dropout whatever ``self.training`` says shows it here.
    """
    held = [entry for model in models for entry in _ZEROED.get(model, [])]
    for owner, name, value in held:
        _set_attr(owner, name, value)
    token = _DROPOUT_OFF.set(False)
    try:
        yield
    finally:
        _DROPOUT_OFF.reset(token)
        for owner, name, _ in held:
            owner.__dict__[name] = 0.0


def _set_attr(owner: Any, name: str, value: Any) -> None:
    """Write an attribute the owner holds in its ``__dict__`` (as scanned): no validation or hooks to run."""
    if value is _ABSENT:
        owner.__dict__.pop(name, None)
    else:
        owner.__dict__[name] = value


_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")
_INPUT_GRAD_ATTRS = ("_require_grads_hooks", "_require_grads_hook")  # the handles enable_input_require_grads keeps


_ROOT: Any = object()  # stands for the scanned model itself in a cached scan's lists


@dataclass(frozen=True)
class _Scan:
    """What training_state and training_run look up in a model, by module (values are read fresh).

    The model itself is not held: the cache is keyed by it weakly, and a cached scan that held it
    would keep every scanned model alive for the session. Its lists hold ``_ROOT`` in its place.
    """

    descendants: list[torch.nn.Module]  # every module below the model, as named_modules() gives them
    locations: list[tuple[Any, str]]  # dropout attributes
    checkpointed: list[Any]  # modules that can checkpoint
    holders: list[Any]  # modules that hold a config
    parameters: list[tuple[str, torch.nn.Parameter]]  # as named_parameters() gives them
    # what the scan was built from: each module's __dict__ size, child dicts (with copies), parameter identities
    _sizes: list[int]
    _children: tuple[list[dict[str, Any]], list[dict[str, Any]]]
    _parameter_ids: list[tuple[Any, ...]]

    @classmethod
    def build(cls, model: torch.nn.Module) -> _Scan:
        named = list(model.named_modules())
        modules = [m for _, m in named]
        locations: list[tuple[torch.nn.Module, str]] = []
        for module in modules:
            # nn.Dropout's p, and float attributes copied from the config (LlamaAttention.attention_dropout)
            is_dropout = isinstance(module, torch.nn.modules.dropout._DropoutNd)
            # by name only: the values, and so which are floats, are read at each use
            locations += [(module, k) for k in vars(module) if (k == "p" and is_dropout) or _DROPOUT_NAME.search(k)]
        seen: set[int] = set()
        parameters: list[tuple[str, torch.nn.Parameter]] = []
        for prefix, module in named:
            for name, param in module._parameters.items():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    parameters.append((f"{prefix}.{name}" if prefix else name, param))
        children = [m._modules for m in modules]  # the dicts, not their owners: the model's own is fine to hold

        def held(module: torch.nn.Module) -> Any:
            return _ROOT if module is model else module

        return cls(
            modules[1:], [(held(m), k) for m, k in locations],
            [held(m) for m in modules if hasattr(m, "gradient_checkpointing")],
            [held(m) for m in modules if getattr(m, "config", None) is not None],
            parameters, _dict_sizes(modules), (children, [dict(c) for c in children]), _parameter_ids(modules),
        )  # fmt: skip

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Every module of ``model``, itself first, as named_modules() gives them."""
        return [model, *self.descendants]

    def of(self, model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[tuple[Any, str]], list[Any], list[Any]]:
        """``modules``, ``locations``, ``checkpointed`` and ``holders`` for ``model``, itself in ``_ROOT``'s place."""

        def module(m: Any) -> Any:
            return model if m is _ROOT else m

        return (
            self.modules(model), [(module(m), k) for m, k in self.locations],
            [module(m) for m in self.checkpointed], [module(m) for m in self.holders],
        )  # fmt: skip

    def holds(self, model: torch.nn.Module) -> bool:
        """Every module still has these children and parameters, and no attribute was added or removed.

        C-level comparisons (identity first; parameters by identity alone, as a tensor's ``==`` is
        elementwise), where re-walking ``named_modules()`` would cost a tiny model's share
        of every backward check on each side.
        """
        modules = self.modules(model)
        live, saved = self._children
        return (
            _dict_sizes(modules) == self._sizes
            and all(map(operator.eq, live, saved))
            and _parameter_ids(modules) == self._parameter_ids
        )


def _dict_sizes(modules: list[torch.nn.Module]) -> list[int]:
    return [len(m.__dict__) for m in modules]


def _parameter_ids(modules: list[torch.nn.Module]) -> list[tuple[Any, ...]]:
    return [(*m._parameters, *map(id, m._parameters.values())) for m in modules]


_SCANS: weakref.WeakKeyDictionary[torch.nn.Module, _Scan] = weakref.WeakKeyDictionary()


def _module_scan(model: torch.nn.Module) -> _Scan:
    """Every module, its dropout attributes, the modules that can checkpoint, those with a config, the parameters; cached per model.

    The cache holds while every module has the same children and parameters and the same number
    of attributes, so a replaced, added or moved submodule or parameter, or a dropout attribute
    added later, is seen; values are always read fresh.
    """
    cached = _SCANS.get(model)
    if cached is not None and cached.holds(model):
        return cached
    scan = _SCANS[model] = _Scan.build(model)
    return scan


def parameter_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: p.grad for name, p in model.named_parameters() if p.requires_grad}``, from the cached scan.

    Same names, order and de-duplication of shared parameters as ``named_parameters``, whose
    generators cost a tiny model's share of every backward check on each side. Under
    ``DistributedDataParallel`` the names are the wrapped model's, as the reference names them.
    """
    return {
        name: param.grad for name, param in _module_scan(data_parallel_inner(model)).parameters if param.requires_grad
    }


def data_parallel_inner(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``DistributedDataParallel``, which names parameters and embeddings as the reference does."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@contextmanager
def training_state(model: torch.nn.Module, checkpointing: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Train mode with every dropout at 0, ``.grad`` cleared, checkpointing as asked; all restored after.

    Dropout is turned off twice over: every dropout-like value of the modules and of their configs
    at any depth (``attention_dropout``, ``hidden_dropout_prob``, ``resid_pdrop``, ``drop_path_rate``,
    an ``nn.Dropout``'s ``p``) is set to 0, and when any of them was not 0, torch's dropout functions
    (``F.dropout`` and its kin, the ``dropout_p`` of ``scaled_dot_product_attention``) run at
    probability 0 whatever they are passed, for a module that keeps its probability elsewhere (a
    ``functools.partial`` bound from the config at ``__init__``). :func:`as_configured` undoes both
    for a block.

    ``checkpointing``: ``None`` leaves it off, else the kwargs for ``torch.utils.checkpoint``
    (``{"use_reentrant": False}``), enabled through transformers' API.

    Example::

        with training_state(model, {"use_reentrant": True}):
            model(**inputs).loss.backward()
    """
    scan = _module_scan(model)
    modules, locations, checkpointed, holders = scan.of(model)
    flags = [(m, m.training) for m in modules]
    saved: list[tuple[Any, str, Any]] = [
        (m, k, m.__dict__.get(k, _ABSENT)) for m in checkpointed for k in _CHECKPOINT_ATTRS
    ]
    current = [(m, k, m.__dict__.get(k, _ABSENT)) for m, k in locations]
    dropouts = [(m, k, v) for m, k, v in current if (k == "p" and v is not _ABSENT) or _is_dropout_attr(k, v)]
    for config in _configs(holders):  # attention functions read config.attention_dropout at call time
        dropouts += [(config, k, v) for k, v in vars(config).items() if _is_dropout_attr(k, v)]
    saved += dropouts
    grads = [(p, p.grad) for _, p in scan.parameters]
    # the dropout functions' mode slows a tiny model's forward and backward: only where a dropout is on
    off = _dropout_functions_off() if any(v not in (0.0, _ABSENT) for _, _, v in dropouts) else nullcontext()
    added: list[tuple[torch.nn.Module, list[int]]] = []  # forward hooks enabling checkpointing registered
    outer = _ZEROED.get(model)  # a nested block (a divergence search inside a training run) keeps the outer's
    try:
        _train(model, modules)
        for owner, name, _ in dropouts:
            owner.__dict__[name] = 0.0
        for param, _ in grads:
            param.grad = None
        if checkpointing is not None:
            saved += [(model, k, model.__dict__.get(k, _ABSENT)) for k in _INPUT_GRAD_ATTRS]
            before = [(m, set(m._forward_hooks)) for m in modules]
            enable_checkpointing(model, checkpointing)
            added = [(m, [k for k in m._forward_hooks if k not in kept]) for m, kept in before]
        _ZEROED[model] = dropouts if outer is None else outer
        with off:
            yield
    finally:
        # enabling checkpointing hooks the input embeddings (enable_input_require_grads): a shared
        # reference would keep that hook, and every later forward of it would make its inputs need grads
        for module, keys in added:
            for key in keys:
                for table in (
                    module._forward_hooks,
                    module._forward_hooks_with_kwargs,
                    module._forward_hooks_always_called,
                ):
                    table.pop(key, None)
        if outer is None:
            _ZEROED.pop(model, None)
        for owner, name, value in reversed(saved):
            _set_attr(owner, name, value)
        for module, training in flags:  # a plain attribute: skip nn.Module.__setattr__'s parameter checks
            module.__dict__["training"] = training
        for param, grad in grads:
            param.grad = grad


def _train(model: torch.nn.Module, modules: list[torch.nn.Module]) -> None:
    """``model.train()``; when no module's class does more than set its flag, the flags are set directly.

    ``nn.Module.train`` walks the tree through ``named_children`` and ``__setattr__``'s parameter
    checks: as much as a tiny model's loss. transformers' override only re-applies
    kernels when ``use_kernels`` is on; any other override (a kernel library's) runs as it is.
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    transformers_train = modeling_utils.PreTrainedModel.train if modeling_utils is not None else None
    for module in modules:
        train = type(module).train
        if train is not torch.nn.Module.train and (
            train is not transformers_train or getattr(module, "use_kernels", False)
        ):
            model.train()
            return
    for module in modules:
        module.__dict__["training"] = True


def enable_checkpointing(model: torch.nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Gradient checkpointing through transformers' API (``activation_checkpointing_enable`` from 5.x)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=dict(kwargs))
    elif (legacy := getattr(model, "gradient_checkpointing_enable", None)) is not None:
        legacy(gradient_checkpointing_kwargs=dict(kwargs))
    else:
        raise PatchUsageError(
            f"assert_backward_equivalent: {type(model).__name__} is not a transformers model, so gradient "
            "checkpointing cannot be enabled on it; pass gradient_checkpointing=False."
        )
