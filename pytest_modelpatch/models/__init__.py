"""The models a check compares: tiny configs, seeded checkpoints, the reference/patched builder, inputs.

Owns config shrinking (:mod:`.tiny_configs`), per-family classes and example inputs
(:mod:`.families`), the checkpoint cache (:mod:`.checkpoints`), the session's model builder
(:mod:`.builder`), hypothesis strategies and device/dtype selection. Imports ``errors``,
``isolation`` (to build the reference with no patches active) and ``compare.usage`` (to
count replacement calls); never reporting or roundtrip.
"""
