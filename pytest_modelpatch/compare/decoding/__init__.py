"""Decoding equivalence: greedy decoding of both models step by step through their KV caches.

``equivalence`` is ``assert_decodes_equivalent``; ``properties`` is
``check_decodes_equivalent`` over drawn prompts.
"""
