"""Does the patched model compute what the reference computes? One comparison, several checks.

:mod:`.outputs` is the tensor-tree comparison everything else uses; :mod:`.equivalence`
(``assert_equivalent``), :mod:`.divergence` (first diverging module, module replay),
:mod:`.property_checks` (``check_equivalence``), :mod:`.tolerance` (policies) and
:mod:`.usage` (which replacements ran) build on it. Imports ``errors``, ``models`` and
``reporting.records``; never ``reporting.session``, ``roundtrip`` or pytest hooks.
"""
