"""Backward equivalence: one seeded training step of both models, its loss and every gradient.

``step`` runs the one forward and backward; ``equivalence`` is ``assert_backward_equivalent``;
``properties`` is ``check_backward_equivalent`` over drawn inputs; ``divergence`` names the
first module in backward order whose gradient parts.
"""
