"""Does the patched model compute what the reference computes? One comparison, several checks.

:mod:`.outputs` is the tensor-tree comparison everything else uses and :mod:`.running` runs the
models it compares; :mod:`.check_report` is the one way a check ends (its row, then its failure)
and :mod:`.property_loop` the one hypothesis loop. :mod:`.equivalence` (``assert_equivalent``),
:mod:`.divergence` (first diverging module, module replay), :mod:`.property_checks`
(``check_equivalent``), :mod:`.backward`, :mod:`.decoding`, :mod:`.export` and :mod:`.compile`
build on them, with :mod:`.tolerance` (policies). Imports ``errors``, ``families``,
``isolation``, ``models`` and ``reporting.records``; never ``reporting.session``, ``roundtrip``
or pytest hooks.
"""
