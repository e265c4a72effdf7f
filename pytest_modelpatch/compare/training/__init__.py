"""Training equivalence: ``assert_trains_equivalent`` runs optimizer steps on both models and compares each.

``steps`` is the check; ``drift`` measures how far a low-precision reference's own training
drifts, the yardstick the patched model's steps are judged by.
"""
