"""The leak guard: global patch state changed by a test and not restored.

Around every test the plugin snapshots transformers' patch state (``snapshot.py``)
and what kernel libraries patch directly (``library_state.py``: modeling module
globals, their classes' attributes, and every registry of transformers' other modules,
found by ``registries.py``); whatever is
different after the test's own fixtures are torn down leaked. It is restored, then
reported according to ``modelpatch_leaks``. A fixture of wider scope gets its own
guard, from its setup to its teardown, so its patches are charged to it.

The plugin loads wherever it is installed, so by default (``modelpatch_leaks`` unset) a
leak fails only a test that opted in, by using one of the plugin's markers or fixtures;
any other test's leak is restored and warned, and its outcome stays what it was.
:class:`LeakTally` counts the leaks either way for the terminal summary.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from pytest_modelpatch.errors import ModelPatchWarning, PatchUsageError
from pytest_modelpatch.isolation.guard import PatchStateGuard
from pytest_modelpatch.isolation.library_state import LibraryState, executions
from pytest_modelpatch.isolation.snapshot import PatchStateSnapshot

LEAK_MODES = ("error", "warn", "off")
AUTO = "auto"  # unset: error for tests that use the plugin, warn for the rest


def parse_leak_mode(value: str | None) -> str:
    """Validate ``--modelpatch-leaks``/``modelpatch_leaks``; unset is ``"auto"``."""
    mode = (value or "").strip().lower()
    if not mode:
        return AUTO
    if mode not in LEAK_MODES:
        raise PatchUsageError(f"modelpatch_leaks = {value!r}: use one of {', '.join(LEAK_MODES)}.")
    return mode


def leak_message(nodeid: str, changes: list[str], *, opted_in: bool = True) -> str:
    """The report for one leaking test or fixture: which one, and every leaked key or class."""
    lines = "\n".join(f"  - {change}" for change in changes)
    policy = (
        "Set modelpatch_leaks = warn or off to relax this check." if opted_in else
        "It uses none of pytest-modelpatch's markers or fixtures, so this is a warning and its outcome is "
        "unchanged: set modelpatch_leaks = error to fail such tests, or off to stop checking them."
    )  # fmt: skip
    return (
        f"{nodeid} leaked transformers patch state (restored now, so later tests are unaffected):\n{lines}\n"
        "Register patches with @pytest.mark.patch(...) or the patch_registry fixture, which clean up after "
        f"themselves, or undo them in a finally block. {policy}"
    )


class LeakTally:
    """Leaks per outcome (``error``/``warn``), counted on the reports so xdist's controller sees the workers'.

    Registered as a plugin: ``pytest_runtest_logreport`` reads ``report.modelpatch_leaks``
    (set on a report by :meth:`stamp`), ``pytest_terminal_summary`` prints the count.
    """

    ATTRIBUTE = "modelpatch_leaks"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.counts = {"error": 0, "warn": 0}

    @classmethod
    def stamp(cls, report: Any, leaks: list[str]) -> None:
        """Carry this phase's leaks (``"error"``/``"warn"`` each) on its report; xdist serializes the attribute."""
        setattr(report, cls.ATTRIBUTE, list(leaks))

    def pytest_runtest_logreport(self, report: Any) -> None:
        for mode in getattr(report, self.ATTRIBUTE, ()):
            self.counts[mode] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        errors, warned = self.counts["error"], self.counts["warn"]
        if errors or warned:
            why = (" (tests that use no modelpatch marker or fixture; modelpatch_leaks = error fails them too)"
                   if warned and self.mode == AUTO else "")  # fmt: skip
            terminalreporter.write_line(
                f"modelpatch: {errors + warned} leak(s) of transformers patch state restored: {errors} failed their "
                f"test, {warned} warned{why}"
            )


class ReusableSnapshots:
    """The snapshots a finished test guard left equal to the live state, and the moment they hold for.

    Retaking them for every test is most of the guard's cost. The session's
    ``IsolationScopes`` holds one (session state on the plugin object, not in module globals);
    its moment moves when a wider-scoped fixture sets up or tears down, or a watched module is
    executed (``library_state.executions()``, which mirrors the import system and stays there).
    """

    def __init__(self) -> None:
        self.scope_changes = 0
        self._kept: tuple[tuple[int, int], PatchStateSnapshot, LibraryState] | None = None

    def scope_changed(self) -> None:
        """A wider-scoped fixture set up or tore down: the state between tests may have moved."""
        self.scope_changes += 1

    def _moment(self) -> tuple[int, int]:
        return self.scope_changes, executions()

    def take(self) -> tuple[PatchStateSnapshot, LibraryState] | None:
        """The kept snapshots when nothing could have moved since they were kept; once only."""
        kept, self._kept = self._kept, None
        return (kept[1], kept[2]) if kept is not None and kept[0] == self._moment() else None

    def keep(self, snapshot: PatchStateSnapshot, library: LibraryState) -> None:
        self._kept = (self._moment(), snapshot, library)


class LeakGuard:
    """Watches one test: creating it imports nothing; ``finish()`` restores and reports.

    With ``reuse``, the snapshots of the previous test's guard are taken over when nothing
    could have changed since it restored them: no wider-scoped fixture set up or tore down
    and no watched module was imported (function-scoped fixtures run inside the guard).
    ``finish()`` restores and diffs only when the state is not the one the last restore left.
    """

    def __init__(self, mode: str, *, reuse: ReusableSnapshots | None = None) -> None:
        self.mode = mode
        self._reuse = reuse
        kept = reuse.take() if reuse is not None else None
        if kept is not None:
            self._guard, self._library = PatchStateGuard(kept[0]), kept[1]
        else:
            self._take()

    def _take(self) -> None:
        # settled at once: untouched() and finish()'s fast path compare with it
        self._guard, self._library = PatchStateGuard(), LibraryState.take()
        self._guard.snapshot.settle()
        self._library.settle()

    def untouched(self) -> bool:
        """Nothing changed since the guard opened (as far as its fast path can tell: False when unsure)."""
        return self._guard.snapshot.unchanged() and self._library.unchanged()

    def rebase(self) -> None:
        """Take the live state as the baseline: what a fixture of wider scope set up inside the test.

        Only for a guard that was ``untouched()`` just before that fixture ran, so nothing of
        the test's own is taken in with it.
        """
        self._guard.close()
        self._take()

    def finish(self, nodeid: str, opted_in: Callable[[], bool] = lambda: True) -> tuple[str, str | None]:
        """Restore what leaked and judge it: ``(outcome, message to raise)``.

        ``outcome`` is ``""`` (nothing leaked), ``"error"`` (the message is returned) or ``"warn"``
        (warned here). In ``auto`` mode ``opted_in()`` decides, asked only when something leaked.
        """
        snapshot, library = self._guard.snapshot, self._library
        # The common test changes nothing: a comparison with the state the last restore left
        # stands in for restoring and diffing (both idempotent, so they would find nothing).
        changes: list[str] = []
        if snapshot.unchanged():
            self._guard.close()
        else:
            changes += self._guard.restore()
            snapshot.settle()
        # the tables of names in full for a test the plugin judges (ms of models beside ~60 us), by length for any
        # other: a plain test that rewrites a model type's class name in place is not seen
        if not library.unchanged(names=self.mode != AUTO or opted_in()):
            changes += library.reconcile()
            library.settle()
        # restored: the live state equals the snapshots again. Not after an import: the next
        # guard takes a library state that holds the new module, so its fast path can see it.
        if self._reuse is not None and library.executions == executions():
            self._reuse.keep(snapshot, library)
        if not changes:
            return "", None
        chosen = self.mode if self.mode != AUTO else ("error" if opted_in() else "warn")
        message = leak_message(nodeid, changes, opted_in=self.mode != AUTO or chosen == "error")
        if chosen == "error":
            return chosen, message
        warnings.warn(message, ModelPatchWarning, stacklevel=2)
        return chosen, None
