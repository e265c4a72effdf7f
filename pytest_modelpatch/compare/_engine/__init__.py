"""What every check in ``compare`` shares: compare, judge, run, report; it imports no capability room.

``outputs`` walks and compares tensor trees (``batched`` many small ones at once), ``tolerance``
holds every built-in tolerance policy and resolves a test's, ``reports`` is the one way a check
ends, ``property_loop`` the one hypothesis loop, ``sharded`` gathers a sharded model's tensors;
running the models is split by what it sets up (``precision``, ``devices``, ``inputs``,
``running``, ``train_mode``) and what it says on failure (``hints``); ``same_model`` refuses two
different models, ``divergence`` and ``blame`` name where two models part, ``ties`` compares
tied parameters.
"""
