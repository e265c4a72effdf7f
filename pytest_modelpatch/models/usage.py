"""Proof that a patch ran: instances of each replacement class and calls in the last forward."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

_COUNTS = "_modelpatch_call_counts"


@dataclass(frozen=True)
class PatchUsage:
    """How one replacement class is used by a model."""

    replacement: str
    instances: int
    calls_in_last_forward: int

    def __str__(self) -> str:
        return f"{self.replacement}: {self.instances} instance(s), {self.calls_in_last_forward} ran in the last forward"


@dataclass
class _Tracking:
    classes: frozenset[type]
    counts: Counter[type] = field(default_factory=Counter)
    depth: int = 0  # > 0 while the model itself runs: module replays call submodules directly


def track_patch_usage(model: torch.nn.Module, classes: set[type]) -> None:
    """Count calls of instances of ``classes`` made by the model's own forwards, reset at each one."""
    tracking = _Tracking(frozenset(classes))
    setattr(model, _COUNTS, tracking)

    def enter(module: torch.nn.Module, args: Any) -> None:
        if not tracking.depth:
            tracking.counts.clear()
        tracking.depth += 1

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        tracking.depth -= 1

    def count(module: torch.nn.Module, args: Any) -> None:
        if tracking.depth:
            tracking.counts.update([type(module)])

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    for module in model.modules():
        if type(module) in classes and module is not model:
            module.register_forward_pre_hook(count)


def unused_replacements(model: torch.nn.Module) -> list[PatchUsage]:
    """Replacement classes with instances in ``model`` that did not run in its last forward."""
    return [u for u in patch_usage(model) if u.instances and not u.calls_in_last_forward]


def patch_usage(model: torch.nn.Module) -> list[PatchUsage]:
    """Per replacement class: instances in ``model`` and how many ran in its last forward.

    Example::

        patched_model(**inputs)
        assert all(u.calls_in_last_forward == u.instances for u in patch_usage(patched_model))
    """
    tracked: _Tracking = getattr(model, _COUNTS, None) or _Tracking(frozenset())
    counts, classes = tracked.counts, tracked.classes
    instances = Counter(type(m) for m in model.modules() if type(m) in classes)
    return [
        PatchUsage(f"{cls.__module__}.{cls.__qualname__}", instances[cls], counts[cls])
        for cls in sorted(classes, key=lambda c: c.__qualname__)
    ]


def unused_message(unused: list[str], *, where: str) -> str:
    """Why a check that never ran a replacement proves nothing about it, and the opt-out."""
    names = ", ".join(unused)
    return (
        f"replacement class(es) {names} never ran in {where}: the check compared nothing they compute. "
        "Give inputs that reach them (an MoE expert needs tokens routed to it, a branch its condition), "
        "or pass allow_unused=True when that is expected."
    )
