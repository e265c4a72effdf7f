"""Property checks: run hypothesis inside one call against models that are already built.

``check_equivalence`` draws many inputs (batch sizes, lengths, padding) and compares
the two models on each, with no model rebuilt per example. It is deterministic: the
seed is fixed (``seed=``, else the session seed the plugin sets, else 0) and printed
in every failure, so every xdist worker and every rerun draws the same examples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from pytest_modelpatch.compare.backward import compare_training
from pytest_modelpatch.compare.equivalence import EquivalenceReport, compare_models
from pytest_modelpatch.compare.outputs import describe_inputs, evaluating, placement
from pytest_modelpatch.compare.routing import RoutingFlips, compare_routed
from pytest_modelpatch.compare.same_model import check_same_model
from pytest_modelpatch.compare.timing import timing_if_enabled
from pytest_modelpatch.compare.tolerance import TolerancePolicy, ToleranceSpec, resolve_tolerance
from pytest_modelpatch.compare.training import has_loss_targets, with_labels
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.strategies import DrawnBytes, drawn_bytes
from pytest_modelpatch.models.usage import patch_usage, unused_message
from pytest_modelpatch.reporting.records import SETTINGS, configure_checks

DEFAULT_MAX_EXAMPLES = 25
# At most this many inputs per hypothesis example, for model_inputs' strategies.
# hypothesis' own cost per example (its engine, seeding and restoring every PRNG, drawing the
# group's bytes one by one, bookkeeping: ~0.5 ms here) is as much as a default tiny model's
# forward, so a group pays it once. 32 rather than 16: 1.23x against 1.32x a check of 50
# examples over the bare forwards (31 alternating pairs), and the same minimal example shrunk.
# ``max_examples`` still counts inputs compared, each once; a failing group shrinks to the
# fewest inputs that end with a failing one, and that input, shrunk too, is the one reported.
GROUP_SIZE = 32


def set_default_seed(seed: int | None) -> None:
    """Seed used when a property check gets none (the plugin sets ``SETTINGS.seed`` to the session seed)."""
    configure_checks(seed=seed)


def set_default_max_examples(max_examples: int | None) -> None:
    """Examples per property check when it gets no ``max_examples``."""
    configure_checks(max_examples=max_examples)


@dataclass
class PropertyReport:
    """How a property check went: examples run, seed, worst error seen, and the minimal failure if any."""

    reference: str
    patched: str
    seed: int
    max_examples: int
    examples: int = 0  # model comparisons run, shrinking included
    first_failure: int = 0  # the example that failed first, counting from 1
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    tolerance: ToleranceSpec | None = None
    worst: EquivalenceReport | None = None  # the passing example with the largest error, for the report row
    failure: Any = None  # EquivalenceReport, or BackwardReport with backward=True
    error: str = ""  # an exception a model raised on the minimal example, when that was the failure
    minimal_inputs: str = ""
    duration_s: float = 0.0
    backward: bool = False  # each example ran a training step (assert_backward_equivalent's comparison)
    routing_near_ties: int = 0  # MoE: near-tie expert choices forced to the reference's, over all examples
    routing_examples: int = 0  # examples that needed such forcing

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.error

    @property
    def header(self) -> str:
        backward = ", backward=True" if self.backward else ""
        return f"check_equivalence(seed={self.seed}, max_examples={self.max_examples}{backward})"

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

    def record(self) -> None:
        """Hand this outcome to the running test's report rows."""
        if self.failure is not None:
            self.failure.duration_s = self.duration_s
            self.failure.record(kind="property", examples=self.examples, detail=str(self))
            return
        if self.worst is not None and self.passed:
            # a passing row shows its worst example's figures: device, dtype, tolerance, output
            self.worst.duration_s = self.duration_s
            if self.routing_near_ties:  # the row counts them over every example, not just the worst one
                self.worst.routing = RoutingFlips(near_ties=self.routing_near_ties, forced=True)
            self.worst.record(kind="property", examples=self.examples, detail=self._routing_text.strip())
            return
        from pytest_modelpatch.reporting.records import CheckRecord, record_check

        record_check(
            CheckRecord(
                kind="property", outcome="passed" if self.passed else "failed", model=self.reference,
                examples=self.examples, max_abs_error=self.max_abs_error, max_rel_error=self.max_rel_error,
                duration_s=self.duration_s, detail=self.error,
            )
        )  # fmt: skip


def _inputs_strategy(reference: torch.nn.Module, inputs: Any, backward: bool = False) -> SearchStrategy[Mapping[str, Any]]:
    if inputs is None:
        from pytest_modelpatch.families.strategies import model_inputs

        # a causal LM's loss scores tokens after the first: one token trains nothing
        return model_inputs(reference.config, min_seq_len=2) if backward else model_inputs(reference.config)
    if isinstance(inputs, SearchStrategy):
        return inputs
    if isinstance(inputs, Mapping):
        return st.just(inputs)
    raise PatchUsageError(
        f"check_equivalence: inputs= must be a hypothesis strategy of input dicts (got {type(inputs).__name__}); "
        "e.g. inputs=pytest_modelpatch.families.strategies.model_inputs(config, max_seq_len=16)."
    )


def check_equivalence(
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
    backward: bool = False,
) -> PropertyReport:
    """Compare the two models on many drawn inputs; on failure, shrink and show the minimal example.

    A replacement class that ran in none of the examples fails the check, unless ``allow_unused=True``.
    ``backward=True``: each example is a training step compared as ``assert_backward_equivalent``
    does (labels added where the model takes them; loss, outputs and every gradient).

    Example::

        check_equivalence(reference_model, patched_model, max_examples=50)
        check_equivalence(ref, pat, inputs=model_inputs(ref.config, padding="left"), seed=1234)
    """
    __tracebackhide__ = True
    check_same_model(reference, patched, "check_equivalence")
    strategy = _inputs_strategy(reference, inputs, backward)
    spec = resolve_tolerance(atol, rtol, policy)  # read the test's overrides here, once
    report = PropertyReport(
        type(reference).__name__, type(patched).__name__,
        seed=seed if seed is not None else SETTINGS.seed or 0,
        max_examples=max_examples or SETTINGS.max_examples or DEFAULT_MAX_EXAMPLES,
        tolerance=spec, backward=backward,
    )  # fmt: skip
    # model_inputs' strategies draw each input from one byte string: draw groups of distinct ones
    drawn = drawn_bytes(strategy)
    if drawn is not None:
        drawing: SearchStrategy[list[Any]] = input_groups(drawn)
        make: Callable[[Any], Mapping[str, Any]] = drawn.build
    else:
        drawing, make = strategy.map(lambda example: [example]), lambda example: example
    passed: set[bytes] = set()  # the bytes of inputs that passed: the models are deterministic
    differed: dict[bytes, Mapping[str, Any]] = {}  # the bytes and inputs of those that did not
    last_failing: list[Mapping[str, Any]] = []
    worst_example: list[Mapping[str, Any]] = []  # the inputs of report.worst, timed under --modelpatch-timing
    # replacement classes in the patched model that have not run in any example yet: once all
    # have, no example needs to look (a walk of every module, ~4% of a tiny model's two forwards)
    unran = {u.replacement for u in patch_usage(patched) if u.instances}
    start = time.perf_counter()

    def remember_failure(example: Mapping[str, Any]) -> None:
        # hypothesis replays the minimal example last, so this ends up holding it.
        last_failing[:] = [example]
        report.first_failure = report.first_failure or report.examples

    def differs(example: Mapping[str, Any]) -> NoReturn:
        # one raise site, whether the models ran or the input was known to differ: hypothesis
        # tells failures apart by where they were raised, and calls a replay that raises
        # elsewhere flaky
        remember_failure(example)
        raise _ExampleFailed()

    @settings(
        # a group of inputs is one hypothesis example: max_examples groups are an upper bound,
        # and the run ends when max_examples inputs have passed (_BudgetSpent)
        max_examples=report.max_examples,
        database=None,
        deadline=None,
        derandomize=False,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
    )
    @hypothesis_seed(report.seed)
    @given(drawing)
    def one_group(items: list[Any]) -> None:
        usable = False
        # Until an input fails, a group runs to its end or to the budget's: build the new inputs
        # it will run before any model runs. Built just after a forward, an input costs ~2.5x as
        # much (~0.13 against ~0.05 ms for a tiny Llama), its memory gone cold. While shrinking,
        # a group stops at the failing input, and what comes after it is built only if reached.
        built: dict[Any, Mapping[str, Any]] = {}
        if drawn is not None and not last_failing:
            budget = report.max_examples - report.examples
            for item in items:
                if len(built) >= budget:
                    break
                if item not in passed and item not in differed and item not in built:
                    built[item] = make(item)
        for item in items:
            if drawn is not None and item in passed:
                usable = True  # drawn in an earlier group, and it passed
                continue
            if drawn is not None and item in differed:
                # while shrinking, most candidates keep the failing input and change others
                differs(differed[item])
            example = built[item] if built and item in built else make(item)
            if backward:
                example = with_labels(reference, example)
                if not has_loss_targets(reference, example):
                    continue  # nothing for the loss to score (one token): a vacuous example, not a passing one
            usable = True
            try:
                one_example(example)
            except _ExampleFailed:
                if drawn is not None:
                    differed[item] = example
                raise
            if drawn is not None:
                passed.add(item)
                if report.examples >= report.max_examples and not report.first_failure:
                    raise _BudgetSpent()  # (while a failure shrinks, every input runs)
        if not usable and backward:
            reject()  # vacuous examples only; when every group is, hypothesis raises Unsatisfiable

    def one_example(example: Mapping[str, Any]) -> None:
        report.examples += 1
        try:
            if backward:
                comparisons = compare_training(reference, patched, example, spec, locate=False).comparisons
            else:
                comparisons, routing = compare_routed(reference, patched, example, spec)
                if routing is not None and routing.forced and all(c.passed for c in comparisons):
                    report.routing_near_ties += routing.near_ties
                    report.routing_examples += 1
            if unran:
                unran.difference_update(u.replacement for u in patch_usage(patched) if u.calls_in_last_forward)
        except Exception:
            remember_failure(example)
            raise
        if not all(c.passed for c in comparisons):
            differs(example)
        worst = max((c.max_abs for c in comparisons), default=0.0)
        if report.worst is None or worst > report.worst.max_abs_error:
            report.worst = example_report(reference, patched, comparisons, spec, example)
            worst_example[:] = [example]
        report.max_abs_error = max([report.max_abs_error, *(c.max_abs for c in comparisons)])
        report.max_rel_error = max([report.max_rel_error, *(c.max_rel for c in comparisons)])

    # as hypothesis.find() does: with no database the key is unused, and deriving it (a digest of
    # one_group's tokenized source) cost every call ~2 ms, as much as ten tiny forwards
    one_group._hypothesis_internal_database_key = None  # type: ignore[attr-defined]
    try:
        with evaluating(reference, patched):
            one_group()
    except _BudgetSpent:
        pass  # max_examples inputs compared, all passed
    except Unsatisfiable:
        raise PatchUsageError(
            "check_equivalence(backward=True): no drawn example gave the loss a token to score (a causal LM "
            "scores each token from the ones before it, so one-token rows train nothing); draw sequences of "
            "two or more tokens, e.g. inputs=model_inputs(config, min_seq_len=2)."
        ) from None
    except Exception as error:  # noqa: BLE001 - every failure is turned into the report
        if not last_failing:
            raise
        minimal = last_failing[0]
        report.minimal_inputs = describe_inputs(minimal)
        if isinstance(error, _ExampleFailed):
            report.failure = (
                compare_training(reference, patched, with_labels(reference, minimal), spec)
                if backward
                else compare_models(reference, patched, minimal, spec)
            )
            if not backward:
                report.failure.timing = timing_if_enabled(reference, patched, minimal)
        else:
            report.error = f"a model raised {type(error).__name__}: {error}"
        report.duration_s = time.perf_counter() - start
        report.record()
        raise AssertionError(str(report)) from (None if isinstance(error, _ExampleFailed) else error)
    report.duration_s = time.perf_counter() - start
    if report.worst is not None and worst_example and not backward:
        report.worst.timing = timing_if_enabled(reference, patched, worst_example[0])
    unused = sorted(unran)
    if unused and not allow_unused:
        report.error = unused_message(unused, where=f"any of the {report.examples} examples")
        report.record()
        raise AssertionError(str(report))
    report.record()
    return report


def input_groups(drawn: DrawnBytes) -> SearchStrategy[list[bytes]]:
    """What one hypothesis example of ``check_equivalence`` draws: the bytes of 1 to ``GROUP_SIZE`` inputs."""
    size = drawn.size
    # One byte string, not a list: hypothesis' cost per list element (~0.1 ms) is as much as
    # building the input. Its first byte is the count, scaled so that shrinking it drops the
    # inputs after a failing one; the passing ones before it shrink to zero bytes. No integer
    # strategy: hypothesis sometimes draws integers from the literals of the modules loaded, so
    # the same seed would draw other groups in another session.
    length = 1 + size * GROUP_SIZE

    def cut(blob: bytes) -> list[bytes]:
        count = 1 + (blob[0] * GROUP_SIZE >> 8)
        return [blob[start : start + size] for start in range(1, 1 + count * size, size)]

    return st.binary(min_size=length, max_size=length).map(cut)


def example_report(
    reference: torch.nn.Module, patched: torch.nn.Module, comparisons: list[Any], spec: ToleranceSpec, example: Mapping[str, Any]
) -> EquivalenceReport:
    """One passing example as an equivalence report (no divergence search: it passed)."""
    return EquivalenceReport(
        reference=type(reference).__name__, patched=type(patched).__name__, comparisons=comparisons,
        tolerance=spec, inputs=describe_inputs(example),
        **placement(reference),
    )  # fmt: skip


class _BudgetSpent(BaseException):
    """Ends hypothesis' run once ``max_examples`` inputs passed (not an ``Exception``: not a failure).

    hypothesis stops after a number of groups, and how many new inputs a group holds varies;
    like ``KeyboardInterrupt``, this passes through its engine untouched.
    """


class _ExampleFailed(Exception):
    """Raised inside hypothesis for a difference; the full report is built once, after shrinking."""
