"""pytest wiring for pytest-modelpatch: options, ini keys, markers, fixtures, hooks.

Nothing here imports torch or transformers at module level; the modules that do
the work are imported inside the hooks and fixtures that need them.
"""

from __future__ import annotations
