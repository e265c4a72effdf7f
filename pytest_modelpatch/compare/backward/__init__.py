"""Backward equivalence: one seeded training step of both models, its loss and every gradient.

``step`` runs the one forward and backward; ``equivalence`` is ``assert_backward_equivalent``;
``divergence`` names the first module in backward order whose gradient parts. Its property check,
``check_backward_equivalent``, shares ``check_equivalent``'s loop in :mod:`..forward.properties`.
"""
