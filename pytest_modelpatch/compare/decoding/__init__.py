"""Decoding equivalence: greedy decoding of both models step by step through their KV caches.

``equivalence`` is ``assert_generates_equivalent``; ``properties`` is
``check_generates_equivalent`` over drawn prompts.
"""
