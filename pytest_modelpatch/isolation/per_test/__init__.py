"""The pytest side of isolation: what each test's marks ask for, and what is held open and counted for it.

``patch_spec.py`` reads ``@pytest.mark.patch`` into a ``PatchSpec``; ``scopes.py`` is the plugin
object ``IsolationScopes`` that ``plugin.py`` registers, holding each test's scope and each wider
fixture's leak guard between hooks; ``leaks.py`` is the leak guard, its opt-in policy
(``modelpatch_leaks``) and the tally the terminal summary prints. Built on the state engine in
``isolation/`` (snapshot, guard, library state, registration), which takes from here only the
``PatchSpec`` it registers.
"""
