"""The one hypothesis loop every property check runs: settings, seed, budget, groups of inputs, shrinking.

A property check (``check_equivalent``, ``check_backward_equivalent``, ``check_decodes_equivalent``) hands :meth:`PropertyLoop.run` its
inputs and a function that checks one of them: ``True`` when the models agree, ``False`` when they
differ; anything a model raises is a failure too. The loop draws the inputs in groups, stops when
``max_examples`` inputs passed, and on a failure lets hypothesis shrink it, then hands back the
minimal failing input. The check builds its report on that one input; every property check's report
is a :class:`PropertyOutcome`, which turns it into its row. Deterministic: a fixed seed, no example
database.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from pytest_modelpatch.compare._engine.precision import ieee_float32
from pytest_modelpatch.families.strategies import DrawnBytes, drawn_bytes
from pytest_modelpatch.reporting.records import CheckRecord

# At most this many inputs per hypothesis example, on every route inputs come by.
# hypothesis' own cost per example (its engine, seeding and restoring every PRNG, drawing the
# group's bytes one by one, bookkeeping) is as much as a default tiny model's forward, so a
# group pays it once. 32 rather than 16: a check costs less over the bare forwards, and the same
# minimal example is shrunk (docs/benchmarks.md, property checks).
# ``max_examples`` still counts inputs compared, each once; a failing group shrinks to the
# fewest inputs that end with a failing one, and that input, shrunk too, is the one reported.
GROUP_SIZE = 32


@dataclass
class Failure:
    """The minimal failing input hypothesis shrank to, and what a model raised on it (``None``: they differed)."""

    minimal: Any
    raised: BaseException | None


class PropertyLoop:
    """One property check's hypothesis run: its seed and budget, and what it ran and found.

    Example::

        loop = PropertyLoop(seed=0, max_examples=25)
        failure = loop.run(model_inputs(config), lambda inputs: compare(inputs).passed)
    """

    def __init__(self, seed: int, max_examples: int) -> None:
        self.seed = seed
        self.max_examples = max_examples
        self.examples = 0  # inputs checked, shrinking included; an input drawn again is not checked again
        self.first_failure = 0  # the input that failed first, counting from 1
        self.started = time.perf_counter()
        self._passed: set[Hashable] = set()  # the keys of inputs that passed: the models are deterministic
        self._differed: dict[Hashable, Any] = {}  # the keys and (prepared) inputs of those that did not
        self._last_failing: list[Any] = []

    def elapsed(self) -> float:
        """Seconds since the loop was made: the check's duration."""
        return time.perf_counter() - self.started

    def run(
        self,
        inputs: SearchStrategy[Any] | DrawnBytes[Any],
        check: Callable[[Any], bool],
        *,
        prepare: Callable[[Any], Any] | None = None,
        grouped: bool = True,
    ) -> Failure | None:
        """Check drawn inputs until ``max_examples`` passed or one fails; ``None`` when none failed.

        ``inputs``: a strategy (``model_inputs``' are drawn as bytes), or the bytes an input is built from.

        ``prepare`` turns a drawn input into the one checked (``None``: nothing to check in it; when
        every input of every group is, hypothesis raises ``Unsatisfiable``). ``grouped=False`` draws one
        input per hypothesis example (a fixed input is run once).
        """
        route = _route(inputs, grouped)

        @settings(
            # a group of inputs is one hypothesis example: max_examples groups are an upper bound,
            # and the run ends when max_examples inputs have passed (_BudgetSpent)
            max_examples=self.max_examples,
            database=None,
            deadline=None,
            derandomize=False,
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            report_multiple_bugs=False,
            print_blob=False,
        )
        @hypothesis_seed(self.seed)
        @given(route.groups)
        def one_group(items: list[Any]) -> None:
            self._one_group(items, route, check, prepare)

        # as hypothesis.find() does: with no database the key is unused, and deriving it (a digest of
        # one_group's tokenized source) costs every call as much as several tiny forwards
        one_group._hypothesis_internal_database_key = None  # type: ignore[attr-defined]
        try:
            with ieee_float32():  # once for the loop: each example's own block is then free
                one_group()
        except _BudgetSpent:
            return None  # max_examples inputs checked, all passed
        except _ExampleDiffers:
            return Failure(self._last_failing[0], None)
        except Exception as error:
            if not self._last_failing:
                raise  # not raised by a check (Unsatisfiable, a usage error): the caller's to handle
            return Failure(self._last_failing[0], error)
        return None

    def _one_group(
        self, items: list[Any], route: _Route, check: Callable[[Any], bool], prepare: Callable[[Any], Any] | None
    ) -> None:
        usable = False
        built = route.build_ahead(items, self) if not self._last_failing else {}
        for item in items:
            key = route.key(item)
            if key is not None and key in self._passed:
                usable = True  # drawn in an earlier group, and it passed
                continue
            if key is not None and key in self._differed:
                # while shrinking, most candidates keep the failing input and change others
                self._differs(self._differed[key])
            example = built[key] if key in built else route.build(item)
            if prepare is not None:
                example = prepare(example)
                if example is None:
                    continue  # nothing to check in it: a vacuous input, not a passing one
            usable = True
            self.examples += 1
            try:
                agreed = check(example)
            except Exception:
                self._remember(example)
                raise
            if not agreed:
                if key is not None:
                    self._differed[key] = example
                self._differs(example)
            if key is not None:
                self._passed.add(key)
            if self.examples >= self.max_examples and not self.first_failure:
                raise _BudgetSpent()  # (while a failure shrinks, every input runs)
        if not usable:
            reject()  # vacuous inputs only; when every group is, hypothesis raises Unsatisfiable

    def _remember(self, example: Any) -> None:
        # hypothesis replays the minimal example last, so this ends up holding it
        self._last_failing[:] = [example]
        self.first_failure = self.first_failure or self.examples

    def _differs(self, example: Any) -> None:
        # one raise site, whether the models ran or the input was known to differ: hypothesis
        # tells failures apart by where they were raised, and calls a replay that raises
        # elsewhere flaky
        self._remember(example)
        raise _ExampleDiffers()


# ---------------------------------------------------------------------------
# Routes: how the inputs of one hypothesis example are drawn
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Route:
    """A group strategy, each item's key (``None``: not recognised again) and how an item becomes an input."""

    groups: SearchStrategy[list[Any]]
    key: Callable[[Any], Hashable | None]
    build: Callable[[Any], Any]
    drawn: DrawnBytes[Any] | None = None

    def build_ahead(self, items: list[Any], loop: PropertyLoop) -> dict[Hashable, Any]:
        """The new inputs of a ``model_inputs`` group, built before any model runs.

        Built just after a forward, an input costs more, its memory gone cold. Inputs other strategies draw are built as they are drawn.
        """
        if self.drawn is None:
            return {}
        built: dict[Hashable, Any] = {}
        budget = loop.max_examples - loop.examples
        for item in items:
            if len(built) >= budget:
                break
            if item not in loop._passed and item not in loop._differed and item not in built:
                built[item] = self.build(item)
        return built


def _route(inputs: SearchStrategy[Any] | DrawnBytes[Any], grouped: bool) -> _Route:
    drawn = inputs if isinstance(inputs, DrawnBytes) else drawn_bytes(inputs)
    if not grouped:
        strategy = inputs.raw.map(inputs.build) if isinstance(inputs, DrawnBytes) else inputs
        return _Route(strategy.map(lambda example: [example]), input_key, _same)
    if isinstance(inputs, DrawnBytes):  # bytes a check composed (a prompt and a count): each its own draw
        return _Route(counted_groups(inputs.raw), _same, inputs.build, inputs)
    if drawn is not None:  # model_inputs: each input is one byte string, its own key
        return _Route(input_groups(drawn), _same, drawn.build, drawn)
    return _Route(counted_groups(inputs), input_key, _same)  # any other strategy: its values


def _same(value: Any) -> Any:
    return value


def _group_count(first_byte: int) -> int:
    # scaled, not taken modulo: shrinking the byte drops the inputs after a failing one
    return 1 + (first_byte * GROUP_SIZE >> 8)


def input_groups(drawn: DrawnBytes[Any]) -> SearchStrategy[list[bytes]]:
    """What one hypothesis example draws from ``model_inputs``: the bytes of 1 to ``GROUP_SIZE`` inputs."""
    size = drawn.size
    # One byte string, not a list: hypothesis' cost per list element is as much as
    # building the input. Its first byte is the count, scaled so that shrinking it drops the
    # inputs after a failing one; the passing ones before it shrink to zero bytes. No integer
    # strategy: hypothesis sometimes draws integers from the literals of the modules loaded, so
    # the same seed would draw other groups in another session.
    length = 1 + size * GROUP_SIZE

    def cut(blob: bytes) -> list[bytes]:
        return [blob[start : start + size] for start in range(1, 1 + _group_count(blob[0]) * size, size)]

    return st.binary(min_size=length, max_size=length).map(cut)


def counted_groups(strategy: SearchStrategy[Any]) -> SearchStrategy[list[Any]]:
    """A count byte, then that many values of ``strategy``, each its own draw.

    For a user's strategy and for inputs of two parts (``check_decodes_equivalent``'s prompt and token
    count). Not ``st.lists``: hypothesis draws lists of ~6 values on average (11 examples for
    40 inputs), where the count byte averages 16. Not one blob for the group, as
    ``input_groups`` draws: for two-part inputs it shrank the prompt less far (a five-token
    prompt where one of two tokens fails as well).
    """

    @st.composite
    def group(draw: st.DrawFn) -> list[Any]:
        count = _group_count(draw(st.binary(min_size=1, max_size=1))[0])
        return [draw(strategy) for _ in range(count)]

    return group()


def input_key(value: Any) -> Hashable | None:
    """What an input is, by value (tensors by dtype, shape and bytes); ``None`` for what cannot be told apart.

    The models are deterministic, so an input drawn again is not checked again.
    """
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().flatten()
        return ("tensor", str(value.dtype), tuple(value.shape), data.view(torch.uint8).numpy().tobytes())
    if isinstance(value, Mapping):
        items = [(str(k), input_key(v)) for k, v in value.items()]
        return None if any(k is None for _, k in items) else ("mapping", tuple(sorted(items)))
    if isinstance(value, (tuple, list)):
        keys = [input_key(v) for v in value]
        return None if any(k is None for k in keys) else (type(value).__name__, tuple(keys))
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value if value is not None else ("none",)
    return None


# ---------------------------------------------------------------------------
# The report every property check returns
# ---------------------------------------------------------------------------


@dataclass
class PropertyOutcome:
    """How a property check went: the models, seed and budget, inputs checked, and the minimal failure if any.

    Each check's report adds its own figures and its message (``__str__``); the row is built here.
    """

    row_kind: ClassVar[str] = "property"

    reference: str
    patched: str
    seed: int
    max_examples: int
    examples: int = 0  # inputs checked, shrinking included
    first_failure: int = 0  # the input that failed first, counting from 1
    max_abs_error: float = 0.0
    failure: Any = None  # the minimal failing input's report (a CheckReport), when the models differed on it
    error: str = ""  # an exception a model raised on the minimal input, when that was the failure
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.error

    def counted(self, loop: PropertyLoop) -> None:
        """Take the loop's counts: inputs checked and the first that failed."""
        self.examples, self.first_failure = loop.examples, loop.first_failure

    def to_record(self) -> CheckRecord:
        """This outcome as one report row: the minimal failure's figures, else the passing ones."""
        if self.failure is not None:
            self.failure.duration_s = self.duration_s
            return self.failure.to_record(self.row_kind, self.examples, str(self))
        return self.passing_record() or CheckRecord(
            kind=self.row_kind, outcome="passed" if self.passed else "failed", model=self.reference,
            examples=self.examples, max_abs_error=self.max_abs_error, duration_s=self.duration_s,
            detail=self.error, **self.row_figures(),
        )  # fmt: skip

    def passing_record(self) -> CheckRecord | None:
        """A row drawn from a passing example's report, where the check keeps one (``None``: the figures alone)."""
        return None

    def row_figures(self) -> dict[str, Any]:
        """Figures this check adds to a row built from its figures alone."""
        return {}


class _BudgetSpent(BaseException):
    """Ends hypothesis' run once ``max_examples`` inputs passed (not an ``Exception``: not a failure).

    hypothesis stops after a number of groups, and how many new inputs a group holds varies;
    like ``KeyboardInterrupt``, this passes through its engine untouched.
    """


class _ExampleDiffers(Exception):
    """Raised inside hypothesis for a difference; the full report is built once, after shrinking."""
