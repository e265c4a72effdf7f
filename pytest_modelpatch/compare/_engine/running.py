"""Running the models a check compares: a seeded forward in eval mode, on the model's device.

``forward`` runs a model the one way every check runs it (seeded, so a model that draws in eval
mode draws the same for both sides); ``unwrapped`` reaches the model inside a wrapper (PEFT's
``PeftModel``); ``cache_keyword`` and the hints name the ``cache``/``past_key_values`` rename;
``implementations_line`` names each side's attention and experts implementation;
``ieee_float32`` holds float32 at full precision while a check runs its models. What the
outputs are compared with is :mod:`.outputs`'.
"""

from __future__ import annotations

import copy
import inspect
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

import torch

from pytest_modelpatch.compare._engine.outputs import TensorComparison, _describe_leaf, flatten_outputs
from pytest_modelpatch.compare._engine.tolerance import ToleranceSpec, dtype_label
from pytest_modelpatch.models.devices import first_parameter_device, seeded_generators
from pytest_modelpatch.reporting.records import IMPLEMENTATION_AXES, describe_implementations, implementations_of

_FLOAT64_COPIES: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def oracle_outputs(reference: torch.nn.Module, inputs: Mapping[str, Any], spec: ToleranceSpec) -> Any:
    """The reference's output in float64 when ``spec`` is the ``oracle`` policy, else ``None``.

    The float64 copy is made once per reference model (it is the unpatched model, so copying
    it changes nothing global); floating inputs are cast to float64 too.
    """
    if not spec.uses_oracle:
        return None
    if reference not in _FLOAT64_COPIES:
        _FLOAT64_COPIES[reference] = copy.deepcopy(reference).to(torch.float64).eval()
    wide = {
        k: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }
    with torch.no_grad():
        return forward(_FLOAT64_COPIES[reference], wide)


# ---------------------------------------------------------------------------
# Running models
# ---------------------------------------------------------------------------


_IEEE_FLOAT32: ContextVar[bool] = ContextVar("modelpatch_ieee_float32", default=False)


def _per_operation_precisions() -> list[Any]:
    """torch >= 2.9's settings per backend and operation, each an ``fp32_precision``; none before."""
    b = torch.backends
    if not hasattr(b.cuda.matmul, "fp32_precision"):
        return []
    return [b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn, b.mkldnn.matmul, b.mkldnn.conv, b.mkldnn.rnn]


def _readable(read: Callable[[], Any]) -> Any:
    """A legacy precision getter's value, or ``None`` where the caller's mix of legacy and per-operation settings makes it raise."""
    try:
        return read()
    except RuntimeError:
        return None


@contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matmuls and convolutions at IEEE precision for the block; the caller's settings put back after.

    cuDNN convolutions run in TF32 by default on Ampere and later, and a user's
    ``set_float32_matmul_precision("high"|"medium")`` turns on TF32 for CUDA matmuls and bf16 for
    oneDNN's on CPU: 10 or 8 mantissa bits where the float32 tolerance allows for 24. The two
    sides of a check rarely take the same kernels (a Conv3d against the Linear that replaces it),
    so a correct patch would differ by 1e-3 (the Qwen3-VL patch embedding on an H200). Nested
    blocks are free.
    """
    if _IEEE_FLOAT32.get():
        yield
        return
    token = _IEEE_FLOAT32.set(True)
    cudnn = torch.backends.cudnn
    per_operation = _per_operation_precisions()
    saved = [setting.fp32_precision for setting in per_operation]
    matmul, cudnn_tf32 = _readable(torch.get_float32_matmul_precision), _readable(lambda: cudnn.allow_tf32)
    try:
        # the legacy setters first: torch keeps their state beside the per-operation settings
        # and checks the two agree when torch.export, inductor or a library reads the legacy
        # getters (a check that set only the new ones made torch.export raise); "ieee" agrees
        # with "highest" and allow_tf32 False, and overrides a generic "tf32" that "none" inherits
        torch.set_float32_matmul_precision("highest")
        cudnn.allow_tf32 = False
        for setting in per_operation:
            setting.fp32_precision = "ieee"
        yield
    finally:
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        if cudnn_tf32 is not None:
            cudnn.allow_tf32 = cudnn_tf32
        for setting, value in zip(per_operation, saved):
            setting.fp32_precision = value
        _IEEE_FLOAT32.reset(token)


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
        # transformers' train() override: ~0.3 ms a call for two tiny models
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


def class_pair(reference_class: str, patched_class: str) -> str:
    """``LlamaMLP`` when both models ran the same class, else which ran where: how reports name a module."""
    if reference_class == patched_class:
        return reference_class
    return f"{reference_class} in the reference, {patched_class} in the patched model"


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


def placement(model: torch.nn.Module) -> dict[str, str]:
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


def default_inputs(model: torch.nn.Module) -> dict[str, Any]:
    """Example inputs drawn from the model's config, on its device."""
    from pytest_modelpatch.families.inputs import example_inputs

    return example_inputs(model.config, device=str(model_device(model)), model_class=type(model))


def describe_inputs(inputs: Mapping[str, Any], limit: int = 64) -> str:
    """``input_ids=[[5, 1, 9]], attention_mask=...``: values when small, shape and dtype when not."""
    parts = []
    for path, leaf in flatten_outputs(dict(inputs), caches=False):
        small = isinstance(leaf, torch.Tensor) and leaf.numel() <= limit
        parts.append(f"{path}={leaf.tolist() if small else _describe_leaf(leaf)}")
    return ", ".join(parts)


FORWARD_SEED = 0


def forward(model: torch.nn.Module, inputs: Mapping[str, Any]) -> Any:
    """``model(**inputs)`` on the model's device, from the same random state every time.

    Some forwards draw random numbers even in eval mode (ViT-MAE's masking, VITS's noise):
    both models of a comparison must draw the same ones, and the caller's generator must
    not move.
    """
    device = model_device(model)
    if device.type != "cpu":
        with seeded_generators(device, FORWARD_SEED), ieee_float32():
            return model(**move_inputs(inputs, device))
    # CPU: the default generator alone; torch.manual_seed also probes every accelerator
    # backend, which costs more than a tiny model's forward
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(FORWARD_SEED)
    try:
        with ieee_float32():
            return model(**move_inputs(inputs, device))
    finally:
        generator.set_state(state)


# ---------------------------------------------------------------------------
# The cache keyword (transformers 5.24 renamed past_key_values to cache)
# ---------------------------------------------------------------------------

_CACHE_KEYWORDS: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_CACHE_LEAF = re.compile(r"^(cache|past_key_values)\.layers\[\d+\]\.(keys|values)$")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` from transformers 5.24, else ``past_key_values``."""
    cls = type(unwrapped(model))  # a wrapper's forward hands its keywords on
    keyword = _CACHE_KEYWORDS.get(cls)
    if keyword is None:
        try:
            params = inspect.signature(cls.forward).parameters  # follows deprecate_kwarg's __wrapped__
        except (TypeError, ValueError):
            params = {}
        keyword = _CACHE_KEYWORDS[cls] = "cache" if "cache" in params else "past_key_values"
    return keyword


def unfilled_cache_hint(model: torch.nn.Module, where: str) -> str:
    """Why a patched model's cache stays empty, for a failure message: usually the ``cache`` rename."""
    rename = (
        " transformers passes it as `cache=` since 5.24 (it was `past_key_values=`): a replacement forward that "
        "names only `past_key_values` receives it in **kwargs and skips the update. Accept `cache`, or both "
        "spellings (`cache = cache if cache is not None else past_key_values`); `modelpatch lint` names the class."
        if cache_keyword(model) == "cache" else
        " Pass the cache on (`past_key_values`) and call its `update(...)` as the original forward does."
    )  # fmt: skip
    return f"hint: the patched model's cache stayed empty {where} while the reference's was filled.{rename}"


def cache_hint_for(model: torch.nn.Module, comparisons: list[TensorComparison]) -> str:
    """:func:`unfilled_cache_hint` when a failure is a cache layer the patched model never wrote, else ``""``."""
    empty = [
        c.path for c in comparisons if c.problem and _CACHE_LEAF.match(c.path) and "patched is absent" in c.problem
    ]
    return unfilled_cache_hint(model, f"({', '.join(empty[:2])}{', ...' if len(empty) > 2 else ''})") if empty else ""


def implementations_line(reference: torch.nn.Module, patched: torch.nn.Module) -> str:
    """Each side's attention and experts implementation, when they differ (the patch marker's load choices).

    A composite model's towers are named where one is on another implementation than its model.
    """
    ours, theirs = implementations_of(reference), implementations_of(patched)
    shown = [
        (axis, describe_implementations(ours, axis), describe_implementations(theirs, axis))
        for axis, _, _ in IMPLEMENTATION_AXES
    ]
    sides = [f"{axis} {mine} (reference) vs {other} (patched)" for axis, mine, other in shown if mine != other]
    return f"implementations: {'; '.join(sides)}" if sides else ""
