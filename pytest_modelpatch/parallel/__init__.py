"""Running a test on ``torch.distributed``: ``@pytest.mark.parallel(kind, world_size=2, timeout=...)``.

A pool of rank processes, started once per session (per xdist worker) and kept, runs the marked
test's whole pytest protocol in every rank (``pool.py`` on the controller's side, ``rank.py`` in
each rank); the controller merges the ranks' reports into the test's (``outcomes.py``). In the
ranks the patched model is sharded the way the test's kind says, the reference stays whole
(``sharding.py``). ``marker.py`` reads the marker.

PYTEST_DONT_REWRITE: imported by a rank before its pytest starts, as the package is (``__init__.py``).
"""
