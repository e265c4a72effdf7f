"""Where a check's models run and how: eval mode, the model's device, the model inside a wrapper, its placement."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, TypedDict

import torch

from pytest_modelpatch.compare._engine.precision import ieee_float32
from pytest_modelpatch.compare._engine.tolerance import dtype_label
from pytest_modelpatch.models.devices import first_parameter_device

# id(model) -> its device, for the models of the evaluating() block being run (they stay put in it)
_DEVICES: ContextVar[Mapping[int, torch.device]] = ContextVar("modelpatch_model_devices", default=MappingProxyType({}))


@contextmanager
def evaluating(*models: torch.nn.Module) -> Iterator[None]:
    """Eval mode, no_grad and :func:`ieee_float32` for a block; every module's training flag is restored after.

    The models' devices are looked up once for the block: a property check's forwards would
    otherwise walk to each model's first parameter twice an example.
    """
    flags = [(module, module.training) for model in models for module in model.modules()]
    token = _DEVICES.set({**_DEVICES.get(), **{id(model): first_parameter_device(model) for model in models}})
    try:
        # a shared reference is in eval already, and eval() walks every module through
        # transformers' train() override, which costs as much as a tiny model's forward
        if any(training for _, training in flags):
            for model in models:
                model.eval()
        with torch.no_grad(), ieee_float32():
            yield
    finally:
        _DEVICES.reset(token)
        for module, training in flags:  # a plain attribute: skip nn.Module.__setattr__'s checks
            module.__dict__["training"] = training


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (the CPU when it has none)."""
    device = _DEVICES.get().get(id(model))
    return device if device is not None else first_parameter_device(model)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model a wrapper exposes with ``get_base_model()`` (PEFT's ``PeftModel``), else ``model`` itself.

    Checks run the wrapper (its forward is what users call) and name modules, compare configs
    and read patch usage on the model inside it, whose module names are the reference's.
    ``DistributedDataParallel`` (a ``parallel("ddp")`` test's patched model) is such a wrapper too.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return unwrapped(model.module)
    get = getattr(model, "get_base_model", None)
    if callable(get):
        base = get()
        if isinstance(base, torch.nn.Module) and base is not model:
            return base
    return model


class Placement(TypedDict):
    """Where a check ran, as every check report names it."""

    device: str
    dtype: str


def placement(model: torch.nn.Module) -> Placement:
    """``{"device": "cpu", "dtype": "float32"}`` from the model's first parameter (empty strings when it has none).

    Every check report names where it ran this way; pass it on as ``**placement(model)``.
    """
    param = next(model.parameters(), None)
    if param is None:
        return {"device": "", "dtype": ""}
    return {"device": str(param.device), "dtype": dtype_label(param.dtype)}


def move_inputs(inputs: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Inputs with every tensor on ``device`` (others untouched)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
