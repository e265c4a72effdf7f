"""Patch isolation: what transformers' global patch state is, how a test changes it, and how it is put back.

Owns the snapshot and restore of every registry (patch mappings, conversions, fusion
config, output recorders), the interception of transformers' entry points, the leak
guard, parsing ``@pytest.mark.patch`` into a :class:`~.per_test.patch_spec.PatchSpec`, registering
it for one test, method patches, and the plugin object that holds each test's scope
(``per_test/scopes.py``). Imports only ``errors`` and ``lint`` (the registration-time lint): never
models, compare, roundtrip or reporting.
"""
