"""Leave no compiled code behind: dynamo's caches and the globals it writes into traced modules.

Dynamo caches compiled code on the code objects it traced and writes helper globals into their
modules (``__import_torch``, ``__resume_at_40_11``, ``__builtins_dict___9``). Left in place,
one test's compiled graphs and guards would serve the next test's models, and the leak guard
reports the globals as transformers patch state the test leaked. ``fresh_dynamo`` resets dynamo
before and after a block and removes what it wrote.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# prefixes of the globals dynamo installs (torch 2.4 to 2.13: symbolic_convert.import_source,
# output_graph.install_global)
_DYNAMO_GLOBALS = ("__import_", "__resume_at_", "__builtins_dict__", "__compiled_fn_")


def _module_names() -> dict[str, set[str]]:
    return {name: set(vars(module)) for name, module in list(sys.modules.items()) if module is not None}


def _run_cleanup_hooks() -> None:
    """Run dynamo's own removal of the globals it installed, now rather than when its code is collected.

    torch 2.13 keeps the transformed code objects alive after ``reset()``, so its cleanup hooks
    (``utils.CleanupManager``) would not run before the test ends. Each hook list is emptied after
    running, so a later collection does not delete the same names twice.
    """
    try:
        from torch._dynamo.utils import CleanupManager
    except ImportError:  # a torch without it: the import aliases below are still removed
        return
    for hooks in list(getattr(CleanupManager.instance, "values", {}).values()):
        for hook in list(hooks):
            if getattr(hook, "name", None) in getattr(hook, "scope", {}):
                hook()
        hooks[:] = []


@contextmanager
def fresh_dynamo() -> Iterator[None]:
    """``torch._dynamo.reset()`` before and after the block, and dynamo's globals removed after it.

    Example::

        with fresh_dynamo():
            torch.compile(model, backend="eager")(inputs)
    """
    torch._dynamo.reset()
    before = _module_names()
    try:
        yield
    finally:
        torch._dynamo.reset()
        _run_cleanup_hooks()
        for name, module in list(sys.modules.items()):
            namespace = vars(module) if module is not None else {}
            for key in set(namespace) - before.get(name, set()):
                # import aliases have no cleanup hook, and some builtins dicts outlive theirs
                if key.startswith(_DYNAMO_GLOBALS):
                    del namespace[key]
