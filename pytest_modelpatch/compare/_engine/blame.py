"""Blame the replacement: each replaced module replayed on the arguments its original got in the reference.

In backward, the same arguments go through the original and the replacement, each output's
gradient is a fixed seeded tensor, and the gradients to the arguments and to the parameters
both have are compared: the replaced module that computes other gradients is to blame.

When two models part, the first module whose output crosses the tolerance may be an amplifier
(``lm_head`` multiplies a hidden-state shift below the tolerance into logits above it). The code
the patch brought is the replaced modules, so each of them is asked on its own: the arguments
the original module received in the reference forward go into the replacement, and its output is
compared with the original's at that output's own dtype. A replacement that differs beyond the
tolerance there is to blame; when none does, those whose output differs at all are the only
new code that changed a value, and are named as the source the difference grew from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import evaluating, unwrapped
from pytest_modelpatch.compare._engine.hints import class_pair
from pytest_modelpatch.compare._engine.outputs import (
    TensorComparison,
    compare_flat,
    describe_tolerances,
    flatten_outputs,
)
from pytest_modelpatch.compare._engine.tolerance import ToleranceSpec
from pytest_modelpatch.compare._engine.train_mode import training_state

_NAMED = 4  # module names shown in a blame line before "and N more"


@dataclass
class ReplacedCall:
    """One call of a replaced module in the reference: the original's arguments and output."""

    name: str
    index: int
    reference_class: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: dict[str, Any]


@dataclass
class Blame:
    """Replaced modules whose own output differs from the original's on the original's arguments."""

    names: list[str]  # module calls ("model.layers.0.mlp", "model.norm#1" for a second call), forward order
    reference_class: str
    patched_class: str
    differences: list[TensorComparison]  # the first named call's output comparisons that differ
    beyond_tolerance: bool  # False: within tolerance alone, the only replaced code whose output changed
    not_replayed: list[str] = field(default_factory=list)  # replaced modules whose replay raised, and why
    backward: bool = False  # its gradients were replayed, for a seeded gradient of its output

    @property
    def first(self) -> str:
        """The first replaced module to blame, as a module name."""
        return self.names[0].split("#")[0]

    def __str__(self) -> str:
        more = len(self.names) - _NAMED
        shown = ", ".join(self.names[:_NAMED]) + (f" and {more} more" if more > 0 else "")
        classes = class_pair(self.reference_class, self.patched_class)
        if self.backward:
            lines = [
                f"replaced module whose own gradients differ: {shown} ({classes})",
                "  replayed on the arguments the original got in the reference, for a seeded gradient of its "
                "output, judged at each gradient's dtype:",
            ]
        elif self.beyond_tolerance:
            lines = [
                f"replaced module whose own output differs: {shown} ({classes})",
                "  replayed on the arguments the original got in the reference, judged at its output's dtype:",
            ]
        else:
            lines = [
                f"replaced module whose own output differs, within tolerance alone: {shown} ({classes})",
                "  replayed on the arguments the original got in the reference, no replaced module differs "
                "beyond the tolerance; these are the only ones whose output changed at all, and the "
                "difference the model output shows grew from theirs:",
            ]
        lines += [f"    {c}" for c in self.differences[:3]]
        lines += [f"  {line}" for line in describe_tolerances(self.differences)]
        lines += [f"  not replayed: {line}" for line in self.not_replayed]
        return "\n".join(lines)


def replaced_module_names(reference: torch.nn.Module, patched: torch.nn.Module) -> set[str]:
    """Submodules of ``patched`` whose class is not the class of the module of that name in ``reference``."""
    originals = {name: type(module) for name, module in unwrapped(reference).named_modules() if name}
    return {
        name for name, module in unwrapped(patched).named_modules()
        if name in originals and type(module) is not originals[name]
    }  # fmt: skip


def blame_replacements(
    patched: torch.nn.Module, calls: Iterable[ReplacedCall], spec: ToleranceSpec, *, train: bool = False
) -> Blame | None:
    """Replay each reference call of a replaced module into the patched model's replacement; ``None`` if none differs.

    Innermost first: a replaced module is not blamed for a replaced module inside it that is.
    """
    model = unwrapped(patched)
    beyond: Found = []
    changed: Found = []
    not_replayed = []
    for call in calls:
        module = model.get_submodule(call.name)
        try:
            replayed = _replay(module, call, train)
        except Exception as exc:  # noqa: BLE001 - a replacement that cannot be called alone is named, not blamed
            not_replayed.append(f"{call.name} ({type(module).__name__}): {type(exc).__name__}: {exc}")
            continue
        comparisons = [c for c in compare_flat(call.output, replayed, spec) if not c.other_form]
        failing = [c for c in comparisons if not c.passed]
        label = call.name if not call.index else f"{call.name}#{call.index}"
        if failing:
            beyond.append((call, label, failing))
        elif any(c.problem is None and c.max_abs > 0 for c in comparisons):
            changed.append((call, label, [c for c in comparisons if c.problem is None and c.max_abs > 0]))
    chosen = _innermost(beyond or changed)
    if not chosen:
        return None
    call, _, differences = chosen[0]
    patched_class = type(model.get_submodule(call.name)).__name__
    same = [label for other, label, _ in chosen if other.reference_class == call.reference_class]
    others = [label for other, label, _ in chosen if other.reference_class != call.reference_class]
    return Blame(same + others, call.reference_class, patched_class, differences, bool(beyond), not_replayed)


def _replay(module: torch.nn.Module, call: ReplacedCall, train: bool) -> dict[str, Any]:
    # as the models ran: eval, or train mode with dropout off
    with training_state(module) if train else evaluating(module), torch.no_grad():
        output = module(*call.args, **call.kwargs)
    flat = flatten_outputs(output, "output", caches=False)
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in flat}


Found = list[tuple[ReplacedCall, str, list[TensorComparison]]]  # (call, its label, its differing comparisons)


def _innermost(found: Found) -> Found:
    names = {call.name for call, _, _ in found}
    return [entry for entry in found if not any(other.startswith(f"{entry[0].name}.") for other in names)]


@contextmanager
def capturing_replaced_calls(model: torch.nn.Module, names: set[str], calls: list[ReplacedCall]) -> Iterator[None]:
    """Append each call of the modules ``names`` names to ``calls``, its arguments detached: a training run's."""
    handles = []

    def hook(name: str) -> Any:
        def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            index = sum(1 for c in calls if c.name == name)
            calls.append(ReplacedCall(name, index, type(module).__name__, _detached(args), _detached(kwargs), {}))

        return before

    for name, module in unwrapped(model).named_modules():
        if name in names:
            handles.append(module.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def blame_backward(
    reference: torch.nn.Module, patched: torch.nn.Module, calls: Iterable[ReplacedCall], spec: ToleranceSpec
) -> Blame | None:
    """Replay each call's backward through the original and the replacement; ``None`` when none differs."""
    originals, replacements = unwrapped(reference), unwrapped(patched)
    found: Found = []
    not_replayed = []
    for call in calls:
        original, replacement = originals.get_submodule(call.name), replacements.get_submodule(call.name)
        try:
            expected, got = _gradients(original, call), _gradients(replacement, call)
        except Exception as exc:  # noqa: BLE001 - a replacement that cannot be run alone is named, not blamed
            not_replayed.append(f"{call.name} ({type(replacement).__name__}): {type(exc).__name__}: {exc}")
            continue
        failing = [c for c in compare_flat(expected, got, spec, common_only=True) if not c.passed and not c.other_form]
        if failing:
            found.append((call, call.name if not call.index else f"{call.name}#{call.index}", failing))
    chosen = _innermost(found)
    if not chosen:
        return None
    call, _, differences = chosen[0]
    return Blame(
        [label for _, label, _ in chosen],
        call.reference_class,
        type(replacements.get_submodule(call.name)).__name__,
        differences,
        True,
        not_replayed,
        backward=True,
    )


def _gradients(module: torch.nn.Module, call: ReplacedCall) -> dict[str, Any]:
    """The gradients of ``module``'s floating arguments and parameters for a seeded gradient of its outputs."""
    args, kwargs = _detached(call.args, grad=True), _detached(call.kwargs, grad=True)
    leaves = {path: t for path, t in flatten_outputs({"args": args, **kwargs}, "grad", caches=False)
              if isinstance(t, torch.Tensor) and t.requires_grad}  # fmt: skip
    parameters = dict(module.named_parameters())
    with training_state(module):
        outputs = [t for _, t in flatten_outputs(module(*args, **kwargs), "output", caches=False)
                   if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
    generator = torch.Generator(device="cpu").manual_seed(0)
    cotangents = [torch.randn(t.shape, generator=generator).to(t) for t in outputs]
    wrt = [*leaves.values(), *parameters.values()]
    grads = torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True)
    names = [*leaves, *(f"grad.{name}" for name in parameters)]
    return {name: g for name, g in zip(names, grads) if g is not None}


def _detached(value: Any, *, grad: bool = False) -> Any:
    """``value`` with every tensor detached and cloned (a floating one requiring grad when ``grad``)."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(grad and copy.is_floating_point())
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_detached(v, grad=grad) for v in value)
    if isinstance(value, list):
        return [_detached(v, grad=grad) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v, grad=grad) for k, v in value.items()}
    return value
