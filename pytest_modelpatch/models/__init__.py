"""The models a check compares: seeded checkpoints, the reference/patched builder, structures.

Owns resolving what ``@pytest.mark.model`` names (:mod:`.specs`), the checkpoint cache
(:mod:`.checkpoints`, :mod:`.cache`), non-degenerate weights, the
session's model builder (:mod:`.builder`) and its reference cache, device/dtype selection and the
tiny structures the contract lint compares. What each family needs to be tiny and fed comes from
``families``. Imports ``errors``, ``families``, ``isolation`` (to build the reference with no
patches active) and ``lint``; never compare, reporting or roundtrip.
"""
