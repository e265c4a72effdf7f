"""Wrappers on transformers' patch entry points, in place while a snapshot is active.

``patch_output_recorders`` is wrapped to record a class-level recorder table the
first time it is seen (classes imported mid-test are not in the snapshot taken at
its start); ``apply_patches`` is replaced by an exception-safe copy of its loop.
When ``transformers.monkey_patching`` is not imported yet, a meta-path hook installs
the wrappers as it loads, before ``modeling_utils`` binds the names.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pytest_modelpatch.isolation.snapshot import MODELING_UTILS, MONKEY_PATCHING, PatchStateSnapshot

ACTIVE: list[PatchStateSnapshot] = []
_ORIGINALS: dict[str, Any] = {}
_HELD: list[bool] = []  # non-empty while the plugin keeps the wrappers in place for the whole session


def _tracking_patch_output_recorders(model: Any) -> None:
    # Record each class table before transformers mutates it: classes first imported
    # during a test are not in the snapshot taken at its start.
    for submodule in model.modules():
        table = getattr(submodule, "_can_record_outputs", None)
        if isinstance(table, dict):
            owner = next((c for c in type(submodule).__mro__ if c.__dict__.get("_can_record_outputs") is table), None)
            for snap in ACTIVE:
                snap.remember_recorder_table(owner or type(submodule), table)
    return _ORIGINALS["patch_output_recorders"](model)


@contextmanager
def _guarded_apply_patches() -> Iterator[None]:
    """transformers' ``apply_patches`` loop, restoring the classes on every exit.

    transformers (5.3-5.23) restores the swapped classes only after a clean exit:
    a replacement whose ``__init__`` raises leaves them swapped for the rest of the
    process. Same matching rules (``_find_replacement_class`` on the name of every class
    bound in a loaded ``transformers*`` module); one pass, so it costs what the original
    costs. It reads each module's own ``__dict__`` and never ``dir()``: on transformers
    5.17, ``dir()`` of a backward-compat alias module imports image processors and
    crashes with ``ModuleNotFoundError: torchvision`` when torchvision is absent. A lazy
    module's names that were never imported hold no class a loaded model uses.
    """
    mp = sys.modules[MONKEY_PATCHING]
    mapping = mp.get_patch_mapping()
    originals: dict[tuple[str, str], type] = {}
    try:
        if mapping:
            for module in list(sys.modules.values()):
                try:
                    namespace = vars(module)
                except TypeError:  # not a module: nothing to list
                    continue
                name = namespace.get("__name__")
                if not isinstance(name, str) or not name.startswith("transformers"):
                    continue
                for attr, value in list(namespace.items()):
                    if not isinstance(value, type):
                        continue
                    replacement = mp._find_replacement_class(attr, mapping)
                    if replacement is None:
                        continue
                    try:
                        setattr(module, attr, replacement)
                    except (AttributeError, TypeError):  # a read-only alias object: transformers skips it too
                        continue
                    originals[(name, attr)] = value
        yield
    finally:
        for (module_name, attr), value in originals.items():
            loaded = sys.modules.get(module_name)
            if loaded is not None:
                setattr(loaded, attr, value)


_WRAPPERS: dict[str, Any] = {
    "patch_output_recorders": _tracking_patch_output_recorders,
    "apply_patches": _guarded_apply_patches,
}


def _install_wrappers(mp: types.ModuleType) -> None:
    for name, wrapper in _WRAPPERS.items():
        current = getattr(mp, name, None)
        if current is None or current is wrapper:
            continue
        _ORIGINALS[name] = current
        setattr(mp, name, wrapper)
        mu = sys.modules.get(MODELING_UTILS)
        if mu is not None and getattr(mu, name, None) is current:
            setattr(mu, name, wrapper)


def _uninstall_wrappers() -> None:
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("transformers") or module is None:
            continue
        namespace = getattr(module, "__dict__", {})
        for name, wrapper in _WRAPPERS.items():
            if namespace.get(name) is wrapper:
                setattr(module, name, _ORIGINALS[name])


class _MonkeyPatchingImportHook(importlib.abc.MetaPathFinder):
    """Installs the tracking wrappers the moment ``transformers.monkey_patching`` loads.

    ``modeling_utils`` binds ``patch_output_recorders`` by name at import, so the
    wrappers must be in place before it does.
    """

    def __init__(self) -> None:
        self.resolving = False  # looking for the spec now: library_state.py's hook asks this one back

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != MONKEY_PATCHING or self.resolving:
            return None
        self.resolving = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappingLoader(spec.loader)
                    return spec
            return None
        finally:
            self.resolving = False


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        if ACTIVE or _HELD:
            _install_wrappers(module)


_IMPORT_HOOK = _MonkeyPatchingImportHook()


def activate(snap: PatchStateSnapshot) -> None:
    ACTIVE.append(snap)
    if len(ACTIVE) > 1 or _HELD:
        return
    _install()


def hold_for_session(on: bool) -> None:
    """Keep the exception-safe ``apply_patches`` in place from configure to unconfigure.

    Patched loads in conftest code and in fixtures of any scope run outside every
    snapshot; transformers leaves classes swapped when such a load fails.
    """
    if on and not _HELD:
        _HELD.append(True)
        if not ACTIVE:
            _install()
    elif not on and _HELD:
        _HELD.clear()
        if not ACTIVE:
            _uninstall()


def _install() -> None:
    mp = sys.modules.get(MONKEY_PATCHING)
    if mp is not None:
        _install_wrappers(mp)
    elif _IMPORT_HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _IMPORT_HOOK)


def deactivate(snap: PatchStateSnapshot) -> None:
    if snap in ACTIVE:
        ACTIVE.remove(snap)
    if not ACTIVE and not _HELD:
        _uninstall()


def _uninstall() -> None:
    if _IMPORT_HOOK in sys.meta_path:
        sys.meta_path.remove(_IMPORT_HOOK)
    _uninstall_wrappers()
