"""Property checks: run hypothesis inside one call against models that are already built.

``check_equivalent`` and ``check_backward_equivalent`` draw many inputs (batch sizes, lengths,
padding) and compare the two models on each as ``assert_equivalent`` and
``assert_backward_equivalent`` do, with no model rebuilt per example. It is deterministic: the
seed is fixed (``seed=``, else the session seed the plugin sets, else 0) and printed
in every failure, so every xdist worker and every rerun draws the same examples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from hypothesis.strategies import SearchStrategy

from pytest_modelpatch.compare._engine.devices import evaluating, placement, unwrapped
from pytest_modelpatch.compare._engine.inputs import describe_inputs
from pytest_modelpatch.compare._engine.outputs import TensorComparison
from pytest_modelpatch.compare._engine.property_loop import PropertyLoop, PropertyOutcome
from pytest_modelpatch.compare._engine.reports import conclude
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.tolerance import TolerancePolicy, ToleranceSpec, resolve_tolerance
from pytest_modelpatch.compare.backward.equivalence import compare_training
from pytest_modelpatch.compare.backward.step import has_loss_targets, with_labels
from pytest_modelpatch.compare.forward.equivalence import EquivalenceReport, compare_models
from pytest_modelpatch.compare.forward.routing import RoutingFlips, compare_routed
from pytest_modelpatch.compare.forward.timing import timing_if_enabled
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.models.usage import patch_usage, unused_message
from pytest_modelpatch.reporting.records import CheckRecord
from pytest_modelpatch.settings import SETTINGS

DEFAULT_MAX_EXAMPLES = 25


@dataclass
class PropertyReport(PropertyOutcome):
    """How ``check_equivalent`` or ``check_backward_equivalent`` went: its worst error, worst passing
    example, and the minimal failure if any (an ``EquivalenceReport``, or a ``BackwardReport``).
    """

    max_rel_error: float = 0.0
    tolerance: ToleranceSpec | None = None
    worst: EquivalenceReport | None = None  # the passing example with the largest error, for the report row
    worst_inputs: Mapping[str, Any] | None = None  # its inputs, timed under --modelpatch-timing
    minimal_inputs: str = ""
    backward: bool = False  # each example ran a training step (assert_backward_equivalent's comparison)
    routing_near_ties: int = 0  # MoE: near-tie expert choices forced to the reference's, over all examples
    routing_examples: int = 0  # examples that needed such forcing

    @property
    def header(self) -> str:
        return f"{_check_name(self.backward)}(seed={self.seed}, max_examples={self.max_examples})"

    def __str__(self) -> str:
        if self.passed:
            return (
                f"{self.header}: patched {self.patched} matches reference {self.reference} on {self.examples} "
                f"examples, max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g} "
                f"({self.tolerance}); {self.duration_s:.2f}s{self._routing_text}"
            )
        lines = [
            f"{self.header}: example {self.first_failure} of {self.max_examples} failed; shrunk in "
            f"{self.examples - self.first_failure} more runs to the minimal example below (seed={self.seed} draws it again)"
        ]
        if self.error and not self.first_failure:
            lines = [f"{self.header}: {self.error}"]
        elif self.error:
            lines += [f"minimal failing inputs: {self.minimal_inputs}", self.error]
        else:
            lines.append(str(self.failure))
        return "\n".join(lines)

    @property
    def _routing_text(self) -> str:
        if not self.routing_near_ties:
            return ""
        return (
            f"\nrouting: {self.routing_near_ties} near-tie expert choice(s) flipped in {self.routing_examples} example(s) "
            "(reference top-k margin within tolerance); forced to the reference's routing and compared again"
        )

    def add_passing(
        self, reference: torch.nn.Module, patched: torch.nn.Module, comparisons: list[TensorComparison],
        spec: ToleranceSpec, example: Mapping[str, Any], routing: RoutingFlips | None,
    ) -> None:  # fmt: skip
        """Count a passing example's figures: the worst error so far, and near-tie routing it needed."""
        if routing is not None and routing.forced:
            self.routing_near_ties += routing.near_ties
            self.routing_examples += 1
        worst = max((c.max_abs for c in comparisons), default=0.0)
        if self.worst is None or worst > self.worst.max_abs_error:
            self.worst = example_report(reference, patched, comparisons, spec, example)
            self.worst_inputs = example
        self.max_abs_error = max([self.max_abs_error, *(c.max_abs for c in comparisons)])
        self.max_rel_error = max([self.max_rel_error, *(c.max_rel for c in comparisons)])

    def passing_record(self) -> CheckRecord | None:
        """A passing row shows its worst example's figures: device, dtype, tolerance, output."""
        if self.worst is None or not self.passed:
            return None
        self.worst.duration_s = self.duration_s
        if self.routing_near_ties:  # the row counts them over every example, not just the worst one
            self.worst.routing = RoutingFlips(near_ties=self.routing_near_ties, forced=True)
        return self.worst.to_record(self.row_kind, self.examples, self._routing_text.strip())

    def row_figures(self) -> dict[str, Any]:
        return {"max_rel_error": self.max_rel_error}


def _inputs_strategy(
    reference: torch.nn.Module, inputs: Any, backward: bool = False
) -> tuple[SearchStrategy[Mapping[str, Any]], bool]:
    """The strategy ``inputs=`` stands for, and whether it is drawn in groups (a fixed dict is run once)."""
    if inputs is None:
        from pytest_modelpatch.families.strategies import model_inputs

        # a causal LM's loss scores tokens after the first: one token trains nothing
        return (model_inputs(reference.config, min_seq_len=2) if backward else model_inputs(reference.config)), True
    if isinstance(inputs, SearchStrategy):
        return inputs, True
    if isinstance(inputs, Mapping) and any(isinstance(value, SearchStrategy) for value in inputs.values()):
        # a mapping of strategies: each key drawn from its own (fixed values kept as they are)
        fields = {k: v if isinstance(v, SearchStrategy) else st.just(v) for k, v in inputs.items()}
        return st.fixed_dictionaries(fields), True
    if isinstance(inputs, Mapping):
        return st.just(inputs), False
    raise PatchUsageError(
        f"{_check_name(backward)}: inputs= must be a hypothesis strategy of input dicts (got {type(inputs).__name__}); "
        "e.g. inputs=pytest_modelpatch.strategies.model_inputs(config, max_seq_len=16)."
    )


def check_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    *,
    inputs: SearchStrategy[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> PropertyReport:
    """``assert_equivalent`` over many drawn inputs; on failure, shrink and show the minimal example.

    ``inputs=``: a strategy of input dicts, a dict of strategies (one per key) or a fixed dict (run once).
    A replacement class that ran in none of the examples fails the check, unless ``allow_unused=True``.

    Example::

        check_equivalent(reference_model, patched_model, max_examples=50)
        check_equivalent(ref, pat, inputs=model_inputs(ref.config, padding="left"), seed=1234)
    """
    __tracebackhide__ = True
    return _check_property(
        reference, patched, inputs, max_examples, seed, atol, rtol, policy, allow_unused, backward=False
    )


def check_backward_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    *,
    inputs: SearchStrategy[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    allow_unused: bool = False,
) -> PropertyReport:
    """``assert_backward_equivalent`` over many drawn inputs: each example a training step (labels added
    where the model takes them; loss, outputs and every gradient), the failing one shrunk.

    Example::

        check_backward_equivalent(reference_model, patched_model, max_examples=20)
    """
    __tracebackhide__ = True
    return _check_property(
        reference, patched, inputs, max_examples, seed, atol, rtol, policy, allow_unused, backward=True
    )


def _check_name(backward: bool) -> str:
    """The public check a property run is, for its messages."""
    return "check_backward_equivalent" if backward else "check_equivalent"


def _check_property(
    reference: torch.nn.Module, patched: torch.nn.Module, inputs: Any, max_examples: int | None, seed: int | None,
    atol: float | None, rtol: float | None, policy: str | TolerancePolicy | None, allow_unused: bool, *, backward: bool,
) -> PropertyReport:  # fmt: skip
    __tracebackhide__ = True
    require_same_model(reference, patched, _check_name(backward))
    strategy, grouped = _inputs_strategy(reference, inputs, backward)
    spec = resolve_tolerance(atol, rtol, policy)  # read the test's overrides here, once
    report = PropertyReport(
        type(reference).__name__, type(patched).__name__,
        seed=seed if seed is not None else SETTINGS.seed or 0,
        max_examples=max_examples or DEFAULT_MAX_EXAMPLES,
        tolerance=spec, backward=backward,
    )  # fmt: skip
    loop = PropertyLoop(report.seed, report.max_examples)
    # replacement classes in the patched model that have not run in any example yet: once all
    # have, no example needs to look (a walk of every module)
    unran = {u.replacement for u in patch_usage(unwrapped(patched)) if u.instances}

    def compare_one(example: Mapping[str, Any]) -> bool:
        if backward:
            comparisons, routing = compare_training(reference, patched, example, spec, locate=False).comparisons, None
        else:
            comparisons, routing = compare_routed(reference, patched, example, spec)
        if unran:
            unran.difference_update(u.replacement for u in patch_usage(unwrapped(patched)) if u.calls_in_last_forward)
        if not all(c.passed for c in comparisons):
            return False
        report.add_passing(reference, patched, comparisons, spec, example, routing)
        return True

    try:
        with evaluating(reference, patched):
            failure = loop.run(
                strategy, compare_one, prepare=_training_example(reference) if backward else None, grouped=grouped
            )
    except Unsatisfiable:
        raise PatchUsageError(
            "check_backward_equivalent: no drawn example gave the loss a token to score (a causal LM "
            "scores each token from the ones before it, so one-token rows train nothing); draw sequences of "
            "two or more tokens, e.g. inputs=model_inputs(config, min_seq_len=2)."
        ) from None
    report.counted(loop)
    if failure is not None:
        report.minimal_inputs = describe_inputs(failure.minimal)
        if failure.raised is None:
            report.failure = (
                compare_training(reference, patched, with_labels(reference, failure.minimal), spec)
                if backward
                else compare_models(reference, patched, failure.minimal, spec)
            )
            if not backward:
                report.failure.timing = timing_if_enabled(reference, patched, failure.minimal)
        else:
            report.error = f"a model raised {type(failure.raised).__name__}: {failure.raised}"
        report.duration_s = loop.elapsed()
        return conclude(report, report.to_record(), failure.raised)
    report.duration_s = loop.elapsed()  # before timing: the timing forwards are not the check's
    if report.worst is not None and report.worst_inputs is not None and not backward:
        report.worst.timing = timing_if_enabled(reference, patched, report.worst_inputs)
    unused = sorted(unran)
    if unused and not allow_unused:
        report.error = unused_message(unused, where=f"any of the {report.examples} examples")
    return conclude(report, report.to_record())


def _training_example(reference: torch.nn.Module) -> Callable[[Mapping[str, Any]], Mapping[str, Any] | None]:
    """Labels added where the model takes them; ``None`` for an input with nothing for the loss to score."""

    def prepare(example: Mapping[str, Any]) -> Mapping[str, Any] | None:
        example = with_labels(reference, example)
        return example if has_loss_targets(reference, example) else None  # one token: vacuous, not passing

    return prepare


def example_report(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    comparisons: list[Any],
    spec: ToleranceSpec,
    example: Mapping[str, Any],
) -> EquivalenceReport:
    """One passing example as an equivalence report (no divergence search: it passed)."""
    return EquivalenceReport(
        reference=type(reference).__name__, patched=type(patched).__name__, comparisons=comparisons,
        tolerance=spec, inputs=describe_inputs(example),
        **placement(reference),
    )  # fmt: skip
