"""Does the patched model compute what the reference computes? One engine, one room a capability.

The rooms are cut as docs/ is: :mod:`.forward` (``assert_equivalent``, ``check_equivalent``),
:mod:`.backward` (one training step's loss and gradients), :mod:`.training` (optimizer steps),
:mod:`.decoding` (greedy decoding through KV caches) and :mod:`.graph` (``torch.export`` and
``torch.compile`` parity). Each builds on the private :mod:`._engine`: the tensor-tree comparison,
the tolerance policies, the one way a check ends, the property loop, running the models, first
divergence. The engine imports no capability room. ``compare`` imports ``errors``, ``families``,
``isolation``, ``models`` and ``reporting.records``; never ``reporting.session``, ``roundtrip``
or pytest hooks.
"""
