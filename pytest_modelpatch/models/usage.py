"""Proof that a patch ran: per replacement class, which instances ran in the last forward and on how many tokens.

Counted only while the model itself runs (a module replay calls a submodule directly and is
not the model's call). For mixture-of-experts models the routers' top-k choices are counted
too, so a check can say which experts got no tokens: a replaced expert that never saw a
token was never compared.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

_COUNTS = "_modelpatch_call_counts"


@dataclass(frozen=True)
class PatchUsage:
    """How one replacement class is used by a model in its last forward."""

    replacement: str
    instances: int
    calls_in_last_forward: int
    instances_run: int = 0
    tokens: int = 0  # rows of the first tensor argument, summed over the calls

    def __str__(self) -> str:
        return (
            f"{self.replacement}: {self.instances_run} of {self.instances} instance(s) ran in the last forward "
            f"({self.calls_in_last_forward} calls, {self.tokens} tokens)"
        )


@dataclass
class _Tracking:
    classes: frozenset[type]
    counts: Counter[type] = field(default_factory=Counter)
    tokens: Counter[type] = field(default_factory=Counter)
    ran: set[int] = field(default_factory=set)  # id() of the instances that ran
    experts: dict[str, tuple[int, Counter[int]]] = field(default_factory=dict)  # router -> (experts, tokens each)
    depth: int = 0  # > 0 while the model itself runs: module replays call submodules directly

    def clear(self) -> None:
        self.counts.clear()
        self.tokens.clear()
        self.ran.clear()
        for _, per_expert in self.experts.values():
            per_expert.clear()


def _rows(args: Any) -> int:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return int(first.numel() // first.shape[-1]) if first is not None and first.dim() else 0


def _expert_count(module: torch.nn.Module, model: torch.nn.Module) -> int:
    for owner in (module, getattr(model, "config", None)):
        for name in ("num_experts", "n_routed_experts", "num_local_experts"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and value > 1:
                return value
    return 0


def _chosen_experts(output: Any) -> torch.Tensor | None:
    """The integer top-k index tensor among a router's outputs (transformers 5.x routers return one)."""
    values = output if isinstance(output, (tuple, list)) else (output,)
    return next((v for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim()), None)


def track_patch_usage(model: torch.nn.Module, classes: set[type]) -> None:
    """Count calls of instances of ``classes`` made by the model's own forwards, reset at each one."""
    tracking = _Tracking(frozenset(classes))
    setattr(model, _COUNTS, tracking)

    def enter(module: torch.nn.Module, args: Any) -> None:
        if not tracking.depth:
            tracking.clear()
        tracking.depth += 1

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        tracking.depth -= 1

    def count(module: torch.nn.Module, args: Any) -> None:
        if tracking.depth:
            tracking.counts.update([type(module)])
            tracking.tokens[type(module)] += _rows(args)
            tracking.ran.add(id(module))

    def route(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            chosen = _chosen_experts(output)
            if tracking.depth and chosen is not None:
                tracking.experts[name][1].update(chosen.flatten().tolist())

        return hook

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    for name, module in model.named_modules():
        if type(module) in classes and module is not model:
            module.register_forward_pre_hook(count)
        elif "Router" in type(module).__name__ and _expert_count(module, model):
            tracking.experts[name] = (_expert_count(module, model), Counter())
            module.register_forward_hook(route(name))


def _tracking(model: torch.nn.Module) -> _Tracking | None:
    """The counts of the tracked model ``model`` is or wraps: a wrapper (DDP, PEFT) holds it as a submodule."""
    return next((m.__dict__[_COUNTS] for m in model.modules() if _COUNTS in m.__dict__), None)


def unused_replacements(model: torch.nn.Module) -> list[PatchUsage]:
    """Replacement classes with instances in ``model`` that did not run in its last forward."""
    return [u for u in patch_usage(model) if u.instances and not u.calls_in_last_forward]


def patch_usage(model: torch.nn.Module) -> list[PatchUsage]:
    """Per replacement class: instances in ``model`` and how many ran in its last forward.

    Example::

        patched_model(**inputs)
        assert all(u.calls_in_last_forward == u.instances for u in patch_usage(patched_model))
    """
    tracked = _tracking(model) or _Tracking(frozenset())
    classes = tracked.classes
    members = [m for m in model.modules() if type(m) in classes]
    instances = Counter(type(m) for m in members)
    ran = Counter(type(m) for m in members if id(m) in tracked.ran)
    return [
        PatchUsage(
            f"{cls.__module__}.{cls.__qualname__}", instances[cls], tracked.counts[cls], ran[cls], tracked.tokens[cls]
        )
        for cls in sorted(classes, key=lambda c: c.__qualname__)
    ]


def coverage_lines(model: torch.nn.Module) -> list[str]:
    """What the last forward reached: replacements that ran only partly, experts that got no tokens.

    Example: ``["ModuleListExperts: 1 of 2 instance(s) ran ...", "model.layers.0.mlp.gate: experts 3, 7 of 8 got no tokens"]``.
    """
    lines = [str(u) for u in patch_usage(model) if u.instances and u.instances_run < u.instances]
    tracked = _tracking(model)
    if tracked is not None and tracked.classes:
        for name, (experts, per_expert) in tracked.experts.items():
            idle = [e for e in range(experts) if not per_expert[e]]
            if idle and per_expert:
                lines.append(f"{name}: experts {', '.join(map(str, idle))} of {experts} got no tokens")
    return lines


def unused_message(unused: list[str], *, where: str) -> str:
    """Why a check that never ran a replacement proves nothing about it, and the opt-out."""
    names = ", ".join(unused)
    return (
        f"replacement class(es) {names} never ran in {where}: the check compared nothing they compute. "
        "Give inputs that reach them (an MoE expert needs tokens routed to it, a branch its condition), "
        "or pass allow_unused=True when that is expected."
    )
