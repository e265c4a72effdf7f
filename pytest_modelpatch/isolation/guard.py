"""Isolate tests from transformers' global patch state.

``isolated_patch_state()`` is the one context manager the rest of the plugin
stands on: it snapshots every piece of global state a patch can touch (see
``snapshot.py``), keeps the tracking wrappers in place while it is open (see
``interception.py``), and restores all of it on exit, whether the block passed,
failed, errored or was interrupted. ``builtin_patch_state()`` runs a block against
transformers' built-in state. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pytest_modelpatch.isolation.interception import ACTIVE, activate, deactivate
from pytest_modelpatch.isolation.snapshot import (
    CONVERSION_MAPPING,
    MONKEY_PATCHING,
    PatchStateSnapshot,
    builtin_conversions,
)

__all__ = ["PatchStateGuard", "PatchStateSnapshot", "isolated_patch_state", "builtin_patch_state"]


class PatchStateGuard:
    """An open snapshot: take it with ``start()``, end it with ``restore()``.

    The same thing as ``isolated_patch_state()`` for callers (pytest fixtures and
    hooks) that cannot hold a ``with`` block open.
    """

    def __init__(self, snapshot: PatchStateSnapshot | None = None) -> None:
        self.snapshot = snapshot if snapshot is not None else PatchStateSnapshot.take()
        self._open = True
        activate(self.snapshot)

    def changes(self) -> list[str]:
        """What differs from the snapshot now."""
        return self.snapshot.changes()

    def close(self) -> None:
        """End the guard without restoring: for a caller that knows nothing changed (``snapshot.unchanged()``)."""
        if self._open:
            self._open = False
            deactivate(self.snapshot)

    def restore(self, *, report: bool = True) -> list[str]:
        """Restore everything; returns what had changed (``[]`` unasked: ``report=False``). Safe to call twice."""
        if not self._open:
            return []
        self._open = False
        try:
            # changes() only reads, and costs more than restoring: skip it when no one reads the answer
            # (every call of a shared reference model enters builtin_patch_state())
            found = self.snapshot.changes() if report else []
            self.snapshot.restore()
        finally:
            deactivate(self.snapshot)
        return found


@contextmanager
def isolated_patch_state() -> Iterator[PatchStateSnapshot]:
    """Snapshot transformers' global patch state; restore all of it on exit.

    Example::

        with isolated_patch_state():
            register_patch_mapping({"LlamaAttention": MyAttention})
            model = LlamaForCausalLM.from_pretrained(path)
        # mapping, conversions, _can_record_outputs: all as before
    """
    guard = PatchStateGuard()
    try:
        yield guard.snapshot
    finally:
        guard.restore(report=False)


@contextmanager
def builtin_patch_state() -> Iterator[PatchStateSnapshot]:
    """Run a block against transformers' built-in state: no patches, no user conversions.

    Everything registered before is back on exit. Used to build reference models
    while a test's patches are registered.

    Example::

        with builtin_patch_state():
            reference = LlamaForCausalLM.from_pretrained(path)
    """
    with isolated_patch_state() as snap:
        mp = sys.modules.get(MONKEY_PATCHING)
        if mp is not None:
            mp.clear_patch_mapping()
        cm: Any = sys.modules.get(CONVERSION_MAPPING)  # a transformers module, read as Any as transformers is
        if cm is not None:
            registered = getattr(cm, "USER_REGISTERED_MAPPINGS", None)
            if registered is not None:
                registered.clear()
            # a shallow copy of the built-in table: readers deep-copy what they get
            cm._checkpoint_conversion_mapping_cache = dict(builtin_conversions(cm))
        # Put class-level recorder tables back to the earliest state any active
        # snapshot saw (outermost last, so it wins): a patched model built earlier in
        # the test re-pointed them at the replacement classes.
        for active in reversed(ACTIVE):
            for table in active.recorder_tables.values():
                table.restore()
        yield snap
