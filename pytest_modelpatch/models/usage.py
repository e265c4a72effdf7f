"""Proof that a patch ran: instances of each replacement class and calls in the last forward."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
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


def track_patch_usage(model: torch.nn.Module, classes: set[type]) -> None:
    """Count forward calls of instances of ``classes``, reset at each top-level forward."""
    counts: Counter[type] = Counter()
    setattr(model, _COUNTS, (counts, frozenset(classes)))
    model.register_forward_pre_hook(lambda module, args: counts.clear())
    for module in model.modules():
        if type(module) in classes:
            module.register_forward_pre_hook(lambda m, args: counts.update([type(m)]))


def patch_usage(model: torch.nn.Module) -> list[PatchUsage]:
    """Per replacement class: instances in ``model`` and how many ran in its last forward.

    Example::

        patched_model(**inputs)
        assert all(u.calls_in_last_forward == u.instances for u in patch_usage(patched_model))
    """
    tracked: Any = getattr(model, _COUNTS, None)
    counts, classes = tracked if tracked is not None else (Counter(), frozenset())
    instances = Counter(type(m) for m in model.modules() if type(m) in classes)
    return [
        PatchUsage(f"{cls.__module__}.{cls.__qualname__}", instances[cls], counts[cls])
        for cls in sorted(classes, key=lambda c: c.__qualname__)
    ]
