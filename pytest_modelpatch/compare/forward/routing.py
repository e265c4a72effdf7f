"""Mixture-of-experts routing near-ties: compare two models with the reference's routing where it was a coin toss.

A correct kernel changes round-off. Where a router's k-th and (k+1)-th expert scores are
within that round-off of each other (a near-tie), the patched model may pick the other
expert, and that token's output then differs by far more than any tolerance: a bf16 Mixtral
whose experts run as a per-expert loop fails after ~15-190 examples for that reason alone.

:func:`compare_routed` runs both models with forward hooks on their routers (modules whose
class name contains ``Router``, found once per model), recording each router call's
``(logits, scores, indices)`` (transformers 5.23 ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``,
``Qwen3MoeTopKRouter``). When the outputs differ and the patched model chose other experts
at some token whose reference margin ``logit[k-th] - logit[new expert]`` is at most twice
the logits' tolerance (each of the two logits may be off by the tolerance), the patched model
runs again with the reference's indices and scores forced at exactly those tokens, and the
outputs are compared again. A flip at a clear margin is never forced: a router that sends
tokens to the wrong experts still fails, and the report names where.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.outputs import TensorComparison, compare_outputs
from pytest_modelpatch.compare._engine.running import forward, oracle_outputs
from pytest_modelpatch.compare._engine.tolerance import ToleranceSpec

_ROUTERS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()
_SHOWN = 3  # clear flips described in a report


def router_names(model: torch.nn.Module) -> tuple[str, ...]:
    """Names of the model's router modules, found once per model (``()`` for a dense model).

    Example: ``router_names(mixtral) == ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")``.
    """
    if model not in _ROUTERS:
        _ROUTERS[model] = tuple(name for name, m in model.named_modules() if "Router" in type(m).__name__)
    return _ROUTERS[model]


@dataclass
class RouterCall:
    """One call of one router: its output tuple and where in it the logits, scores and indices are."""

    name: str
    output: Any
    logits: int | None = None  # position of the (tokens, experts) float tensor
    scores: int | None = None  # position of the (tokens, k) float tensor
    indices: int | None = None  # position of the (tokens, k) integer tensor

    @classmethod
    def of(cls, name: str, output: Any) -> RouterCall:
        call = cls(name, output)
        values = output if isinstance(output, (tuple, list)) else ()
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() == 2 and call.indices is None:
                call.indices = i
        if call.indices is None:
            return call
        k_shape = values[call.indices].shape
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 2 and v.shape[0] == k_shape[0]:
                if v.shape == k_shape and call.scores is None:
                    call.scores = i
                elif v.shape[1] > k_shape[1] and call.logits is None:
                    call.logits = i
        return call

    def part(self, position: int | None) -> torch.Tensor | None:
        return None if position is None else self.output[position]


@dataclass
class RoutingFlips:
    """Tokens a patched model sent to other experts than the reference did, by how clear the reference's choice was."""

    near_ties: int = 0  # flips where the reference's margin was within twice the logits' tolerance
    clear: int = 0  # flips at a clear margin: the patched router really chose other experts
    examples: list[str] = field(default_factory=list)  # the first clear flips, described
    forced: bool = False  # the outputs were compared with the reference's routing forced at the near-ties

    def __str__(self) -> str:
        lines = []
        if self.near_ties:
            how = "forced to the reference's routing and compared again" if self.forced else "not forced"
            lines.append(
                f"routing: {self.near_ties} near-tie expert choice(s) flipped (reference top-k margin within tolerance); {how}"
            )
        if self.clear:
            lines.append(
                f"routing: {self.clear} token(s) sent to other experts at a clear reference margin (not a near-tie):"
            )
            lines += [f"  {text}" for text in self.examples]
        return "\n".join(lines)


def find_flips(reference: RouterCall, patched: RouterCall, spec: ToleranceSpec) -> tuple[list[int], list[str]]:
    """Tokens where ``patched`` chose other experts than ``reference``: (near-tie tokens, descriptions of clear ones)."""
    ref_idx, pat_idx = reference.part(reference.indices), patched.part(patched.indices)
    if ref_idx is None or pat_idx is None or ref_idx.shape != pat_idx.shape:
        return [], []
    differ = (ref_idx.sort(dim=-1).values != pat_idx.sort(dim=-1).values).any(dim=-1)
    tokens = differ.nonzero().flatten().tolist()
    logits = reference.part(reference.logits)
    if not tokens:
        return [], []
    if logits is None:  # no scores over every expert: no margin to judge by, every flip counts
        return [], [
            f"{reference.name} token {t}: experts {ref_idx[t].tolist()} -> {pat_idx[t].tolist()}" for t in tokens
        ]
    tolerance = spec.for_dtype(logits.dtype)
    wide = logits.detach().double()
    amax = float(wide.abs().max())
    near, clear = [], []
    for t in tokens:
        chosen = set(ref_idx[t].tolist())
        taken = [e for e in pat_idx[t].tolist() if e not in chosen]
        kth = min(float(wide[t, e]) for e in chosen)
        margin = kth - min((float(wide[t, e]) for e in taken), default=kth)
        allowed = 2 * (tolerance.abs_term(amax) + tolerance.rtol * abs(kth))
        if margin <= allowed:
            near.append(t)
        else:
            clear.append(
                f"{reference.name} token {t}: experts {sorted(chosen)} -> {sorted(pat_idx[t].tolist())}, "
                f"reference margin {margin:.4g} > {allowed:.3g} (twice the logits' tolerance)"
            )
    return near, clear


@contextmanager
def _hooked(model: torch.nn.Module, hook: Any) -> Iterator[None]:
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(hook(name)) for name in router_names(model) if name in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _recording(calls: list[RouterCall]) -> Any:
    def hook(name: str) -> Any:
        return lambda module, args, output: calls.append(RouterCall.of(name, output))

    return hook


def _forcing(reference_calls: list[RouterCall], spec: ToleranceSpec, flips: RoutingFlips) -> Any:
    """Hooks that put the reference's indices and scores into the patched router's output at near-tie flips."""
    pending = {name: [c for c in reference_calls if c.name == name] for name in {c.name for c in reference_calls}}

    def hook(name: str) -> Any:
        def replace(module: torch.nn.Module, args: Any, output: Any) -> Any:
            queue = pending.get(name)
            if not queue:
                return None
            reference, patched = queue.pop(0), RouterCall.of(name, output)
            near, clear = find_flips(reference, patched, spec)
            flips.near_ties += len(near)
            flips.clear += len(clear)
            flips.examples += clear[: max(0, _SHOWN - len(flips.examples))]
            if not near or patched.scores is None or reference.scores is None:
                return None
            # a call has scores only where it found indices (RouterCall.of)
            assert patched.indices is not None and reference.indices is not None
            values = list(output)
            rows = torch.tensor(near, device=values[patched.indices].device)
            for ours, theirs in ((patched.indices, reference.indices), (patched.scores, reference.scores)):
                values[ours] = values[ours].clone()
                values[ours][rows] = reference.output[theirs][rows].to(values[ours])
            return type(output)(values)

        return replace

    return hook


def compare_routed(
    reference: torch.nn.Module, patched: torch.nn.Module, inputs: Mapping[str, Any], spec: ToleranceSpec
) -> tuple[list[TensorComparison], RoutingFlips | None]:
    """Compare both models' outputs on ``inputs``; for MoE models, force the reference's routing at near-tie flips.

    Returns the comparisons and, for models with routers, the flips seen (``None`` for dense models,
    which run exactly as :func:`~pytest_modelpatch.compare._engine.outputs.compare_outputs` would).

    Example::

        comparisons, flips = compare_routed(reference, patched, {"input_ids": ids}, resolve_tolerance())
        assert all(c.passed for c in comparisons), flips
    """
    oracle = oracle_outputs(reference, inputs, spec)  # None unless the policy is 'oracle'
    if not router_names(reference):
        return compare_outputs(forward(reference, inputs), forward(patched, inputs), spec, oracle), None
    reference_calls: list[RouterCall] = []
    with _hooked(reference, _recording(reference_calls)):
        expected = forward(reference, inputs)
    flips = RoutingFlips()
    patched_calls: list[RouterCall] = []
    with _hooked(patched, _recording(patched_calls)):
        comparisons = compare_outputs(expected, forward(patched, inputs), spec, oracle)
    if all(c.passed for c in comparisons):
        return comparisons, flips
    seen = [find_flips(r, p, spec) for r, p in zip(reference_calls, patched_calls) if r.name == p.name]
    if not any(near for near, _ in seen):
        flips.clear = sum(len(clear) for _, clear in seen)
        flips.examples = [text for _, clear in seen for text in clear][:_SHOWN]
        return comparisons, flips
    # Near-ties flipped: run again forcing them, call by call (a forced flip changes what later layers see).
    flips.forced = True
    with _hooked(patched, _forcing(reference_calls, spec, flips)):
        comparisons = compare_outputs(expected, forward(patched, inputs), spec, oracle)
    return comparisons, flips
