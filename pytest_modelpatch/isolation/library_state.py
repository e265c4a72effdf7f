"""What kernel libraries change in transformers, beyond the patch mapping.

Liger-Kernel, Unsloth and their kin rebind module globals
(``modeling_llama.LlamaRMSNorm = LigerRMSNorm``), rebind class attributes
(``LlamaMLP.forward = fast_forward``) and register into transformers' registries (attention
functions, losses, activations, ``ALL_LAYERNORM_LAYERS``); tensor-parallel patches set a config
class's plan (``LlamaConfig.base_model_tp_plan = {...}``).
``LibraryState.take()`` records, by reference, the globals of every loaded
``transformers.models.*.modeling_*`` and ``configuration_*`` module, the ``__dict__`` of the
classes defined there (and a copy of each config class's parallelism plans, which a patch may
edit in place), and a shallow copy of every registry of the other loaded transformers modules
(found by ``registries.py``); ``reconcile()`` compares by identity and puts the recorded objects
back. A module imported after the snapshot is compared with what importing it produced
(recorded by an import hook on every ``transformers.*`` module, which also logs what an import
writes into the registries: no leak), and a module re-executed by ``importlib.reload`` is a
revert, not a leak: its re-created definitions (told from patches by ``redefinition.py``) are
replaced by the original objects, which the rest of transformers (auto mappings,
``transformers.LlamaForCausalLM``) still holds.
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import importlib.abc
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from pytest_modelpatch.isolation import registries
from pytest_modelpatch.isolation.redefinition import redefined
from pytest_modelpatch.isolation.registries import MISSING as _MISSING
from pytest_modelpatch.isolation.registries import RegistrySnapshot, copy_container, is_modeling_module, is_name_table
from pytest_modelpatch.isolation.registries import describe as _label

# a config class's parallelism plans: dicts a patch may assign or edit in place
_PLAN_ATTRIBUTES = ("base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan", "base_model_fsdp_plan")
# PreTrainedModel caches answers on the class (5.x: _can_set_attn_implementation_cached_value).
_CACHE_SUFFIX = "_cached_value"
# Set by Python itself at run time, not by a patch (warnings' per-module registry).
_IGNORED_GLOBALS = frozenset({"__warningregistry__", "__spec__", "__loader__", "__file__", "__cached__"})
# ...and on a class: copyreg's cache of a class's slots, written when an instance is pickled or deep-copied
_IGNORED_CLASS_KEYS = frozenset({"__slotnames__"})


def _same(live: Any, saved: dict[str, Any]) -> bool:
    """Same keys and values, compared in C: dict equality tries identity before ``==``.

    Functions and classes compare by identity, so a rebound one is always caught; an
    equal but distinct data value (a rebuilt string) is no patch worth reporting.
    """
    try:
        return bool(live == saved)
    except Exception:  # noqa: BLE001 - a distinct tensor's ambiguous truth value: look closer
        return False


def _recreated(original: Any, fresh: Any) -> bool:
    """``fresh`` is ``original`` defined again by re-executing its module (a reload)."""
    return original is not _MISSING and fresh is not _MISSING and redefined(original, fresh)


@dataclass
class _ModuleRecord:
    """One modeling or configuration module's globals, the ``__dict__`` of each class it defines, its plans' contents."""

    module: types.ModuleType
    spec: Any
    globals: dict[str, Any]
    classes: dict[str, tuple[type, dict[str, Any]]]
    plans: list[tuple[str, dict[Any, Any], dict[Any, Any]]] = field(default_factory=list)  # (owner.attr, live, copy)

    @classmethod
    def capture(cls, module: types.ModuleType) -> _ModuleRecord:
        namespace = module.__dict__
        keys = _CLASS_KEYS.get(module.__name__)
        if keys is None:  # the classes a module defines: found once, not scanned per test
            name = module.__name__
            keys = _CLASS_KEYS[name] = [k for k, v in namespace.items() if isinstance(v, type) and v.__module__ == name]
        classes = {k: (v, dict(v.__dict__)) for k in keys if isinstance(v := namespace.get(k), type)}
        plans = [(f"{klass.__qualname__}.{attr}", plan, dict(plan)) for klass, own in classes.values()
                 for attr in _PLAN_ATTRIBUTES if isinstance(plan := own.get(attr), dict)]  # fmt: skip
        return cls(module, namespace.get("__spec__"), dict(namespace), classes, plans)

    @property
    def short(self) -> str:
        return self.module.__name__.rpartition(".")[2]

    def reconcile(self) -> list[str]:
        """Put the recorded objects back; return what changed, less re-created definitions."""
        namespace = self.module.__dict__
        # importlib.reload re-executes into the same namespace and sets a new __spec__
        reloaded = namespace.get("__spec__") is not self.spec
        fresh_classes = {key: namespace.get(key) for key in self.classes} if reloaded else {}
        found: list[str] = []
        if not _same(namespace, self.globals):
            found += self._reconcile_globals(namespace, reloaded)
        for key, (klass, saved) in self.classes.items():
            owner = key if key == klass.__qualname__ else f"{self.short}.{key}"
            found += _reconcile_class(owner, klass, saved, fresh_classes.get(key))
        for owner, plan, saved_plan in self.plans:
            if plan != saved_plan:  # edited in place: the same dict, other entries
                found.append(f"{owner} edited ({_plan_change(saved_plan, plan)})")
                plan.clear()
                plan.update(saved_plan)
        return found

    def _reconcile_globals(self, namespace: dict[str, Any], reloaded: bool) -> list[str]:
        found = []
        for key in namespace.keys() - self.globals.keys():
            if key not in _IGNORED_GLOBALS:
                found.append(f"{self.short}.{key} added ({_label(namespace[key])})")
                del namespace[key]
        for key, was in self.globals.items():
            now = namespace.get(key, _MISSING)
            if now is was or key in _IGNORED_GLOBALS:
                continue
            if not (reloaded and _recreated(was, now)):
                found.append(f"{self.short}.{key}: {_label(was)} -> {_label(now)}")
            namespace[key] = was
        return found


def _plan_change(saved: dict[Any, Any], live: dict[Any, Any]) -> str:
    changed = [f"{k!r} added" for k in live.keys() - saved.keys()] + [
        f"{k!r} removed" for k in saved.keys() - live.keys()
    ]
    changed += [f"{k!r}: {saved[k]!r} -> {live[k]!r}" for k in saved.keys() & live.keys() if saved[k] != live[k]]
    return ", ".join(sorted(changed))


def _reconcile_class(owner: str, klass: type, saved: dict[str, Any], fresh: Any) -> list[str]:
    live = klass.__dict__
    if _same(live, saved):
        return []
    found = []
    for key in list(live.keys() - saved.keys()):
        if key.endswith(_CACHE_SUFFIX) or key in _IGNORED_CLASS_KEYS:
            continue
        found.append(f"{owner}.{key} added")
        delattr(klass, key)
    for key, was in saved.items():
        now = live.get(key, _MISSING)
        if now is was:
            continue
        # After a reload the fresh class holds the definitions the reload meant to restore.
        if fresh is None or not _recreated(was, fresh.__dict__.get(key, _MISSING)):
            found.append(f"{owner}.{key} {'removed' if now is _MISSING else 'replaced'}")
        setattr(klass, key, was)
    return found


@dataclass(eq=False)
class LibraryState:
    """References to what libraries patch; ``reconcile()`` restores and reports."""

    registries: RegistrySnapshot
    modules: dict[str, _ModuleRecord] = field(default_factory=dict)
    executions: int = 0  # the import counter when taken: unchanged means no module to look for
    _watched: list[Any] = field(default_factory=list)  # module and class __dict__s, plans: see unchanged()
    _registries: list[Any] = field(default_factory=list)  # the registries' containers, copied by copy_container
    _settled: list[Any] | None = None
    _live: list[Any] = field(default_factory=list)  # _watched then the registries, compared with _settled at once
    _names: list[Any] = field(default_factory=list)  # the registries that are tables of names
    _names_settled: list[Any] = field(default_factory=list)
    _names_lengths: list[int] = field(default_factory=list)

    @classmethod
    def take(cls) -> LibraryState:
        _install_import_hook()
        state = cls(RegistrySnapshot.take(_HOOK.executions), executions=_HOOK.executions)
        for name in _MODELING_NAMES:
            module = sys.modules.get(name)
            if module is not None:
                state.modules[name] = _ModuleRecord.capture(module)
        return state

    def reconcile(self) -> list[str]:
        """Restore every recorded object; return the changes that were leaks."""
        found: list[str] = []
        for record in self.modules.values():
            found += record.reconcile()
        found += self.registries.reconcile(_HOOK.executions)
        if _HOOK.executions != self.executions:
            found += self._reconcile_imported()
        return found

    def settle(self) -> None:
        """Copy what reconcile() reads, just after take() or reconcile(), for ``unchanged()``."""
        if not self._watched:
            self._watched = [r.module.__dict__ for r in self.modules.values()]
            self._watched += [klass.__dict__ for r in self.modules.values() for klass, _ in r.classes.values()]
            self._watched += [plan for r in self.modules.values() for _, plan, _ in r.plans]
            self._registries = self.registries.live()
            self._names = [c for c in self._registries if is_name_table(c)]
            named = set(map(id, self._names))
            self._live = [*self._watched, *(c for c in self._registries if id(c) not in named)]
        self._settled = [*map(dict, self._watched), *map(copy_container, self._live[len(self._watched) :])]
        self._names_settled = list(map(copy_container, self._names))
        self._names_lengths = list(map(len, self._names))

    def unchanged(self, names: bool = True) -> bool:
        """True when every watched dict equals what settle() copied and no watched module was executed.

        reconcile() is idempotent, so it would find and change nothing. Equality, as ``_same``
        compares: identity first, so a rebound function or class always differs. One C-level
        comparison a dict, where reconcile() walks each module and class in Python.
        ``names=False``: the registries that are tables of names (:func:`~registries.is_name_table`)
        are compared by length only, for a test that does not use the plugin.
        """
        if self._settled is None or _HOOK.executions != self.executions:
            return False
        try:
            if self._live != self._settled:  # one list comparison in C
                return False
            if names:
                return self._names == self._names_settled
            return list(map(len, self._names)) == self._names_lengths
        except Exception:  # noqa: BLE001 - a distinct tensor's ambiguous truth value: let reconcile() look
            return False

    def _reconcile_imported(self) -> list[str]:
        """Modeling modules first imported after the snapshot, against what importing built."""
        found: list[str] = []
        for name, fresh in list(_IMPORTED.items()):
            if name not in self.modules and sys.modules.get(name) is fresh.module:
                found += fresh.reconcile()
        return found


# -- modules imported after a snapshot -------------------------------------------
_IMPORTED: dict[str, _ModuleRecord] = {}  # state right after the last execution, by module name
# Every modeling module ever loaded: scanning sys.modules (thousands of names) per test costs too much.
_MODELING_NAMES: set[str] = set()
_CLASS_KEYS: dict[str, list[str]] = {}


def watch_imports() -> None:
    """Record each modeling module as importing produces it, from now on (``as_imported``)."""
    _install_import_hook()


def as_imported(module: types.ModuleType) -> tuple[dict[str, Any], list[tuple[type, dict[str, Any]]]] | None:
    """``module``'s globals and its classes' ``__dict__``s as importing left them, if the hook saw it executed."""
    record = _IMPORTED.get(module.__name__)
    if record is None or record.module is not module or module.__dict__.get("__spec__") is not record.spec:
        return None
    return record.globals, list(record.classes.values())


def executions() -> int:
    """A counter that moves whenever a watched module is imported or reloaded: snapshots go stale."""
    return _HOOK.executions


class _RecordingLoader(importlib.abc.Loader):
    """Runs the real loader, then records the module as importing produced it."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: inspect and linecache use them
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # what the outermost execution (and the imports it makes) writes into the registries is transformers' own
        before = registries.before_import() if _HOOK.depth == 0 else None
        _HOOK.depth += 1
        try:
            self._loader.exec_module(module)
        finally:
            _HOOK.depth -= 1
            _HOOK.executions += 1
            registries.forget(module.__name__)
            if before is not None:
                registries.after_import(before, _HOOK.executions)
        if is_modeling_module(module.__name__):
            _MODELING_NAMES.add(module.__name__)
            _CLASS_KEYS.pop(module.__name__, None)
            _IMPORTED[module.__name__] = _ModuleRecord.capture(module)


class _TransformersImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loaders of transformers' modules; counts what they executed, a mirror of the import system."""

    def __init__(self) -> None:
        self.executions = 0  # transformers modules executed (imported or reloaded) so far
        self.depth = 0  # executions under way, nested: imports made by an import
        self.resolving: set[str] = set()  # names whose spec this hook is looking for now

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "transformers" and not fullname.startswith("transformers.") or fullname in self.resolving:
            return None
        # another hook that asks the finders after it (interception.py's) asks this one back: answer it None
        self.resolving.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is None:
                    continue
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RecordingLoader(spec.loader)
                return spec
            return None
        finally:
            self.resolving.discard(fullname)


_HOOK = _TransformersImportHook()


def _install_import_hook() -> None:
    if _HOOK in sys.meta_path:
        return
    sys.meta_path.insert(0, _HOOK)
    _MODELING_NAMES.update(name for name in list(sys.modules) if is_modeling_module(name))
