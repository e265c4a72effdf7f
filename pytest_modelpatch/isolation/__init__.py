"""Patch isolation: what transformers' global patch state is, how a test changes it, and how it is put back.

Owns the snapshot and restore of every registry (patch mappings, conversions, fusion
config, output recorders), the interception of transformers' entry points, the leak
guard, parsing ``@pytest.mark.patch`` into a :class:`~.per_test.patch_spec.PatchSpec`, registering
it for one test, method patches, and the plugin object that holds each test's scope
(``per_test/scopes.py``). Imports only ``errors`` and ``lint`` (the registration-time lint): never
models, compare, roundtrip or reporting.

Public (docs/reference.md): the patch state snapshot, ``pristine``, the registry, reversibility.
"""

from __future__ import annotations

from pytest_modelpatch import lazy_exports

_EXPORTS: dict[str, str] = {
    "isolated_patch_state": "isolation.guard",
    "PatchStateSnapshot": "isolation.guard",
    "pristine": "isolation.pristine",
    "PatchRegistry": "isolation.registration",
    "validate_mapping": "isolation.registration",
    "reversibility_problems": "isolation.reversibility",
    "ReversibilityProblem": "isolation.reversibility",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
