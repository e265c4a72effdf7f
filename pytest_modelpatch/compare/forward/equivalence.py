"""Compare a patched model's outputs with the reference's, tensor by tensor, and say where they part.

``assert_equivalent`` runs both models on the same inputs, walks every tensor of the
outputs (``ModelOutput`` fields, tuples, dicts, cache layers) and fails with a report
naming each differing output and the first module whose output diverges.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import evaluating, placement, unwrapped
from pytest_modelpatch.compare._engine.divergence import Divergence, find_divergence
from pytest_modelpatch.compare._engine.hints import cache_hint_for, implementations_line
from pytest_modelpatch.compare._engine.inputs import default_inputs, describe_inputs
from pytest_modelpatch.compare._engine.outputs import TensorComparison, describe_tolerances
from pytest_modelpatch.compare._engine.reports import CheckReport, given_inputs
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.sharded import mesh_fusion_hint, sharding_line
from pytest_modelpatch.compare._engine.ties import tie_differences
from pytest_modelpatch.compare._engine.tolerance import TolerancePolicy, ToleranceSpec, resolve_tolerance
from pytest_modelpatch.compare.forward.routing import RoutingFlips, compare_routed
from pytest_modelpatch.compare.forward.timing import timing_if_enabled
from pytest_modelpatch.models.usage import coverage_lines, unused_message, unused_replacements

# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


@dataclass
class EquivalenceReport(CheckReport):
    """The outcome of comparing a patched model with its reference on one set of inputs."""

    reference: str
    patched: str
    comparisons: list[TensorComparison]
    tolerance: ToleranceSpec
    inputs: str = ""
    device: str = ""
    dtype: str = ""
    divergence: Divergence | None = None
    duration_s: float = 0.0
    extra: list[str] = field(default_factory=list)
    unused: str = ""  # why the check proves nothing about some replacement, when one never ran
    ties: list[str] = field(default_factory=list)  # parameters the two models tie differently (compare._engine.ties)
    coverage: list[str] = field(default_factory=list)  # what the compared forward reached only partly
    routing: RoutingFlips | None = None  # MoE models: expert choices that differed from the reference's
    timing: dict[str, Any] | None = None  # --modelpatch-timing: both models' forwards timed on these inputs

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons) and not self.unused and not self.ties

    def __str__(self) -> str:
        where = f" ({self.dtype} on {self.device})" if self.device else ""
        if self.passed:
            head = (
                f"patched {self.patched} matches reference {self.reference}{where}: {len(self.comparisons)} outputs, "
                f"max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}"
            )
            coverage = [f"coverage: {line}" for line in self.coverage]
            return "\n".join([head, f"tolerance: {self.tolerance}", *self._routing_lines, *coverage])
        head = f"in {len(self.failures)} of {len(self.comparisons)} outputs"
        if not self.failures and self.ties:
            head = f"in how it ties its parameters (its {len(self.comparisons)} outputs agree, for now)"
        lines = [
            f"patched {self.patched} differs from reference {self.reference}{where} {head}",
            *self.extra,
            *self._routing_lines,
            *([self.unused] if self.unused else []),
            *(f"tie: {line}" for line in self.ties),
            *(f"coverage: {line}" for line in self.coverage),
            f"inputs: {self.inputs}",
            *describe_tolerances(self.failures),
            *(f"  {c}" for c in self.failures),
        ]
        if self.divergence is not None:
            lines.append(str(self.divergence))
        return "\n".join(lines)

    @property
    def _routing_lines(self) -> list[str]:
        text = str(self.routing) if self.routing is not None else ""
        return text.splitlines()

    def judged_comparison(self) -> TensorComparison | None:
        """The logits' tolerance when they were compared: the figure a reader looks for."""
        judged = [c for c in self.comparisons if c.tolerance is not None]
        return next((c for c in judged if c.path.endswith("logits")), judged[0] if judged else None)

    def row_fields(self) -> dict[str, Any]:
        return {
            "coverage": self.coverage, "timing": self.timing,
            "routing_near_ties": self.routing.near_ties if self.routing is not None else 0,
        }  # fmt: skip


def compare_models(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any],
    spec: ToleranceSpec,
    *,
    locate: bool = True,
) -> EquivalenceReport:
    """Run both models on ``inputs`` and compare; on a difference, find the first diverging module."""
    start = time.perf_counter()
    with evaluating(reference, patched):
        # MoE models: near-tie expert choices that flipped are forced to the reference's (compare/forward/routing.py)
        comparisons, routing = compare_routed(reference, patched, inputs, spec)
    report = EquivalenceReport(
        reference=type(reference).__name__, patched=type(patched).__name__, comparisons=comparisons,
        tolerance=spec, inputs=describe_inputs(inputs), routing=routing,
        **placement(reference),
    )  # fmt: skip
    if not report.passed:
        found = (
            implementations_line(reference, patched), cache_hint_for(patched, comparisons), sharding_line(patched),
            mesh_fusion_hint(unwrapped(patched)),
        )  # fmt: skip
        report.extra += [line for line in found if line]
    if locate and not report.passed:
        report.divergence = find_divergence(reference, patched, inputs, spec)
    report.duration_s = time.perf_counter() - start
    return report


def assert_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any] | torch.Tensor | None = None,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> EquivalenceReport:
    """Fail unless ``patched`` computes what ``reference`` computes on ``inputs``; returns the report.

    A replacement class of the patched model that never ran on ``inputs`` fails the check too,
    unless ``allow_unused=True``.

    Example::

        report = assert_equivalent(reference_model, patched_model)            # inputs from the config
        assert_equivalent(reference_model, patched_model, {"input_ids": ids}, atol=1e-4)
    """
    __tracebackhide__ = True
    require_same_model(reference, patched, "assert_equivalent")
    inputs = given_inputs(inputs, lambda: default_inputs(reference))
    report = compare_models(reference, patched, inputs, resolve_tolerance(atol, rtol, policy))
    unused = [u.replacement for u in unused_replacements(unwrapped(patched))]
    if unused and not allow_unused:
        report.unused = unused_message(unused, where="the compared forward")
    report.coverage = coverage_lines(unwrapped(patched))
    report.ties = tie_differences(reference, patched)  # equal outputs now, but untied weights train apart
    report.timing = timing_if_enabled(reference, patched, inputs)
    return report.conclude()
