"""Where a patched model's backward parts from the reference's: the first diverging module in backward order.

Full backward hooks on every submodule of both models record, in the order the backward
reaches them, the gradient flowing into each module's outputs and the gradient it passes
back to its (positional) inputs. The module named is the first whose incoming gradient
agrees but whose outgoing gradient, or the gradient of a parameter inside it, does not:
the module that introduced the difference, as ``first_divergence`` does for the forward.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.blame import Blame
from pytest_modelpatch.compare._engine.hints import class_pair
from pytest_modelpatch.compare._engine.outputs import (
    TensorComparison,
    compare_flat,
    describe_tolerances,
    flatten_outputs,
)
from pytest_modelpatch.compare._engine.tolerance import ToleranceSpec


@dataclass
class BackwardCall:
    """One module reached by the backward: the gradient into its outputs and out to its inputs."""

    name: str
    index: int  # 0 for the first time the backward reaches this module, 1 for the second, ...
    module_class: str
    grad_output: dict[str, Any]
    grad_input: dict[str, Any]


def _flat(value: Any, path: str) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flatten_outputs(value, path)}


@contextmanager
def backward_calls(model: torch.nn.Module, calls: list[BackwardCall]) -> Iterator[None]:
    """Append a :class:`BackwardCall` to ``calls`` each time a backward through ``model`` reaches a submodule."""
    counts: dict[str, int] = defaultdict(int)

    def hook(name: str, module: torch.nn.Module) -> Callable[..., None]:
        def record(_: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
            calls.append(
                BackwardCall(
                    name,
                    counts[name],
                    type(module).__name__,
                    _flat(grad_output, "grad_output"),
                    _flat(grad_input, "grad_input"),
                )
            )
            counts[name] += 1

        return record

    # The root is skipped: its output gradient is the loss's, and its parameters are all compared.
    handles = [m.register_full_backward_hook(hook(n, m)) for n, m in model.named_modules() if n]
    try:
        with warnings.catch_warnings():
            # Modules returning a ModelOutput get no backward hook call (torch warns once per such
            # module), and a first layer whose inputs need no gradient reports its output gradient
            # only: both are expected here, and not the user's concern.
            warnings.filterwarnings("ignore", message="For backward hooks to be called", category=UserWarning)
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class BackwardDivergence:
    """The first module in backward order whose gradient differs, and whether its incoming gradient agreed."""

    name: str
    index: int
    reference_class: str
    patched_class: str
    incoming_agrees: bool
    differences: list[TensorComparison]
    incoming_differences: list[TensorComparison] = field(default_factory=list)
    profile: list[tuple[str, float]] = field(default_factory=list, repr=False)
    blame: Blame | None = None  # replaced modules whose own gradients differ, replayed on the reference's arguments

    def __str__(self) -> str:
        call = f" (reached {self.index + 1} times)" if self.index else ""
        classes = class_pair(self.reference_class, self.patched_class)
        lines = [str(self.blame)] if self.blame is not None else []
        lines.append(f"first module in backward order whose gradient diverges: {self.name}{call} ({classes})")
        if self.incoming_agrees:
            lines.append("  the gradient flowing into its output agrees; the gradients it computes differ:")
        else:
            lines.append(
                "  no shared module diverges on an agreeing incoming gradient: the difference starts in code "
                "outside any module both models share. The gradient flowing into its output differs:"
            )
            lines += [f"    {c}" for c in self.incoming_differences[:3]]
            lines.append("  and the gradients it computes:")
        lines += [f"    {c}" for c in self.differences[:6]]
        if len(self.differences) > 6:
            lines.append(f"    ... and {len(self.differences) - 6} more")
        lines += [f"  {line}" for line in describe_tolerances(self.differences)]
        return "\n".join(lines)


def first_backward_divergence(
    reference_calls: list[BackwardCall],
    patched_calls: list[BackwardCall],
    gradient_failures: Mapping[str, TensorComparison],
    spec: ToleranceSpec,
) -> BackwardDivergence | None:
    """The first module, in backward order, present in both models whose computed gradient differs.

    A module's computed gradients are the gradient to its inputs and those of the parameters
    inside it (``gradient_failures``: parameter name -> failing comparison, reference names).
    Prefers a module whose incoming gradient agrees; else the first whose incoming one differs.
    ``None`` when no shared module differs.

    Example::

        first_backward_divergence(ref_calls, pat_calls, {}, resolve_tolerance()).name  # "model.layers.1.mlp"
    """
    others = {(c.name, c.index): c for c in patched_calls}
    found = fallback = None
    profile: list[tuple[str, float]] = []
    for call in reference_calls:
        other = others.get((call.name, call.index))
        if other is None:
            continue
        incoming = compare_flat(call.grad_output, other.grad_output, spec)
        outgoing = compare_flat(call.grad_input, other.grad_input, spec, common_only=True)
        label = call.name if not call.index else f"{call.name}#{call.index}"
        profile.append((label, max((c.max_abs for c in outgoing + incoming if c.problem is None), default=0.0)))
        if found is not None:
            continue
        prefix = f"{call.name}."
        differences = [c for c in outgoing if not c.passed]
        differences += [c for name, c in gradient_failures.items() if name.startswith(prefix)]
        incoming_bad = [c for c in incoming if not c.passed]
        if differences and not incoming_bad:
            found = BackwardDivergence(call.name, call.index, call.module_class, other.module_class, True, differences)
        elif (differences or incoming_bad) and fallback is None:
            fallback = BackwardDivergence(
                call.name,
                call.index,
                call.module_class,
                other.module_class,
                False,
                differences or incoming_bad,
                incoming_bad,
            )
    result = found or fallback
    if result is not None:
        result.profile = profile
    return result
