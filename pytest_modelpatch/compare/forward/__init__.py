"""Forward equivalence: ``assert_equivalent`` on given inputs, ``check_equivalent`` over drawn ones.

``equivalence`` runs both models and compares every output tensor; ``properties`` draws inputs
through the engine's property loop, for ``check_equivalent`` and, each example a training step of
:mod:`..backward`, ``check_backward_equivalent``; ``routing`` forces mixture-of-experts near-ties
back to the reference's choice; ``timing`` times both models when ``--modelpatch-timing`` asks.
"""
