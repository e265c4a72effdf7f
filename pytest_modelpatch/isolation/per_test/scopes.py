"""Each test's isolation scope and each wider fixture's leak guard, held by one plugin object.

``plugin.py`` registers an :class:`IsolationScopes` in ``pytest_configure``, as it registers
``reporting/session.py``'s objects; the object holds whatever stays open between hooks, so no
per-test state lives in module globals. A test's :class:`ItemScope` holds its leak guard, the
patches of its ``@pytest.mark.patch`` marks and its tolerance, from just before its first
function-scoped fixture to just after their teardown. A fixture of wider scope gets a leak guard
of its own, from its setup to its teardown, so its patches are charged to it.

What needs the rooms above this one (the registration lint against the test's model family,
the test's tolerance, which tests opted in to the plugin) comes in as callables from
``plugin.py``: isolation imports only errors and lint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_modelpatch.errors import PatchLeakError, PatchUsageError
from pytest_modelpatch.isolation.per_test.leaks import LeakGuard, LeakTally, ReusableSnapshots, parse_leak_mode
from pytest_modelpatch.isolation.per_test.patch_spec import collect_patch_spec

if TYPE_CHECKING:
    from pytest_modelpatch.isolation.per_test.patch_spec import PatchSpec
    from pytest_modelpatch.isolation.registration import ActivePatches

# the registration lint for one test's marks: (item, the marks' allow) -> the lint ActivePatches calls
LintFor = Callable[[pytest.Item, dict[str, list[str]]], Any]

_SCOPE = pytest.StashKey["ItemScope"]()
_LEAKS = pytest.StashKey[list[str]]()  # this phase's leak outcomes, for its report


def leak_mode(config: pytest.Config) -> str:
    """``--modelpatch-leaks``, else ``modelpatch_leaks``; ``"auto"`` when neither is set."""
    return parse_leak_mode(config.getoption("modelpatch_leaks", None) or config.getini("modelpatch_leaks"))


def patch_spec(item: pytest.Item) -> PatchSpec | None:
    """The test's ``@pytest.mark.patch`` spec once its scope is open; ``None`` without patch marks."""
    scope = item.stash.get(_SCOPE, None)
    return scope.spec if scope is not None else None


class ItemScope:
    """What is held open for one test: its leak guard, its patches, its tolerance."""

    __slots__ = ("active", "failure", "guard", "item", "reset_tolerance", "spec")

    def __init__(self, guard: LeakGuard | None, item: pytest.Item) -> None:
        self.guard, self.item = guard, item
        self.spec: PatchSpec | None = None
        self.active: ActivePatches | None = None
        self.reset_tolerance: Any = None
        self.failure: Exception | None = None  # raised once setup is over

    def raise_failure(self) -> None:
        """Raise what opening the scope kept for the end of setup; a usage error fails without a traceback."""
        if isinstance(self.failure, PatchUsageError):
            pytest.fail(f"PatchUsageError: {self.failure}", pytrace=False)
        if self.failure is not None:
            raise self.failure


class IsolationScopes:
    """pytest hooks that open and close each test's :class:`ItemScope` and guard each wider fixture.

    ``lint_for(item, allow)`` gives the registration lint for the test's marks, ``tolerance_for(item)``
    sets the test's tolerance and returns its undo (or ``None``), ``opted_in(item)`` says whether the
    test uses the plugin (asked only after a leak, in ``auto`` mode); ``plugin_fixtures`` are the
    fixture names by which a wider fixture opts in.
    """

    def __init__(
        self,
        mode: str,
        *,
        lint_for: LintFor,
        tolerance_for: Callable[[pytest.Item], Any],
        opted_in: Callable[[pytest.Item], bool],
        plugin_fixtures: frozenset[str],
    ) -> None:
        self.mode = mode
        self._lint_for, self._tolerance_for, self._opted_in = lint_for, tolerance_for, opted_in
        self._plugin_fixtures = plugin_fixtures
        self._open: ItemScope | None = None  # the running test's, while it is open
        self._fixture_guards: dict[Any, LeakGuard] = {}  # fixtures of wider scope, setup to teardown
        self._reusable = ReusableSnapshots()  # what one test's guard leaves the next

    def open(self, item: pytest.Item) -> ItemScope:
        """Open the test's guard, patches and tolerance; the item's teardown closes them.

        Opened just before the test's first function-scoped fixture (else once setup is done),
        so fixtures of wider scope set up for it are outside it (each has its own guard), and
        closed by a finalizer registered then, so it runs after the function-scoped fixtures'
        teardown and before any wider fixture's. A hook, not an autouse fixture: pytest's
        fixture machinery alone would cost every test of the session more than the guard. An error (a bad
        marker) is kept for the end of setup: raised inside pytest_fixture_setup, before the
        fixture ran, it would leave pytest's fixture cache inconsistent for every later test.
        """
        scope = item.stash[_SCOPE] = ItemScope(
            LeakGuard(self.mode, reuse=self._reusable) if self.mode != "off" else None, item
        )
        self._open = scope
        item.addfinalizer(lambda: self.close(scope))
        try:
            # keywords hold every marker name of the node and its parents: a cheap test before the marker walk
            spec = scope.spec = collect_patch_spec(item) if "patch" in item.keywords else None
            if spec is not None:
                from pytest_modelpatch.isolation.registration import ActivePatches

                scope.active = ActivePatches(spec, lint=self._lint_for(item, spec.allow))
            scope.reset_tolerance = self._tolerance_for(item)
        except Exception as exc:  # noqa: BLE001 - kept, and raised when setup is over
            scope.failure = exc
        return scope

    def close(self, scope: ItemScope) -> None:
        """Undo the test's tolerance and patches, then restore and judge what leaked."""
        if self._open is scope:
            self._open = None
        try:
            if scope.reset_tolerance is not None:
                scope.reset_tolerance()
            if scope.active is not None:
                scope.active.close()
        finally:
            item = scope.item
            self._finish_guard(scope.guard, item.nodeid, item, lambda: self._opted_in(item))

    @staticmethod
    def _finish_guard(guard: LeakGuard | None, nodeid: str, item: pytest.Item, opted_in: Callable[[], bool]) -> None:
        if guard is None:
            return
        outcome, message = guard.finish(nodeid, opted_in)
        if outcome:
            item.stash.setdefault(_LEAKS, []).append(outcome)
        if message is not None:
            raise PatchLeakError(message)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        try:
            result = yield
        except (Exception, pytest.skip.Exception, pytest.fail.Exception):
            # a fixture that ran without the test's patches may fail (or skip) for that reason: the
            # scope's error comes first, as it did when the guard was the first function fixture
            scope = item.stash.get(_SCOPE, None)
            if scope is not None:
                scope.raise_failure()
            raise
        # a test without function-scoped fixtures: nothing opened its scope yet
        scope = item.stash.get(_SCOPE, None)
        (scope if scope is not None else self.open(item)).raise_failure()
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[Any]:
        # A fixture of wider scope answers for its own patches, from its setup to its teardown;
        # the tests it serves take it as their baseline.
        if fixturedef.scope == "function":
            if _SCOPE not in request.node.stash:
                self.open(request.node)
        elif fixturedef not in self._fixture_guards:
            self._reusable.scope_changed()
            if self.mode != "off":
                self._fixture_guards[fixturedef] = LeakGuard(self.mode)
                # asked for from a test's body (request.getfixturevalue): what it sets up is the baseline
                # of the tests it serves, this one included, unless the test had changed something first
                test = self._open.guard if self._open is not None else None
                if test is not None and test.untouched():
                    result = yield
                    test.rebase()
                    return result
        return (yield)

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
        if fixturedef.scope != "function":
            self._reusable.scope_changed()
        guard = self._fixture_guards.pop(fixturedef, None)
        if guard is not None:
            uses = lambda: not self._plugin_fixtures.isdisjoint((fixturedef.argname, *fixturedef.argnames))  # noqa: E731
            self._finish_guard(guard, f"{fixturedef.scope}-scoped fixture {fixturedef.argname!r}", request.node, uses)

    def stamp_report(self, item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
        """Put this phase's leaks on its report; a leak error fails the test, even an xfail one.

        Not a hook: ``plugin.py``'s one outermost ``pytest_runtest_makereport`` calls it, last, once
        pytest's xfail handling has made the report.
        """
        leaks = item.stash.get(_LEAKS, None)
        if leaks:
            LeakTally.stamp(report, leaks)
            leaks.clear()
        if call.excinfo is not None and call.excinfo.errisinstance(PatchLeakError):
            report.longrepr = f"PatchLeakError: {call.excinfo.value}"  # the message says it all; no plugin traceback
            if hasattr(report, "wasxfail"):  # pytest turns any error of an xfail test into an xfail: a leak is not one
                del report.wasxfail
                report.outcome = "failed"
