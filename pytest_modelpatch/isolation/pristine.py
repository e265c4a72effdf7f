"""Run the reference model in the world before the test's patches, while the test runs in the patched one.

Class mappings and conversions only act while a model is built, so building the reference
with none registered is enough for them. Method patches and ``context=`` patches are
different: they rebind methods on transformers' classes and globals in its modules, which
the reference shares with the patched model. A :class:`PristineScope` records exactly what
the test's patches changed (a :class:`NamespaceDelta`: owner, name, value before, value
after, compared by identity) and swaps those entries back for the length of a block, then
re-applies them. The reference model enters the current test's scope around every call
(:func:`running_pristine`, from ``models/reference.py``), so a session-cached reference runs
unpatched whatever the test that asks for it registered, and however often a hypothesis run
calls it.

Nothing here imports torch or transformers: modules are read from ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from pytest_modelpatch.isolation.library_state import as_imported, watch_imports

_MISSING: Any = object()
_WATCHED_PREFIX = "transformers."


def _watched_modules() -> list[ModuleType]:
    return [
        m for name, m in list(sys.modules.items()) if name.startswith(_WATCHED_PREFIX) and isinstance(m, ModuleType)
    ]


def _namespaces() -> dict[int, tuple[Any, dict[str, Any]]]:
    """``id(owner) -> (owner, copy of its __dict__)`` for transformers' modules and the classes they define."""
    found: dict[int, tuple[Any, dict[str, Any]]] = {}
    for module in _watched_modules():
        try:
            values = dict(vars(module))
        except TypeError:  # a lazy module proxy without a plain __dict__
            continue
        found[id(module)] = (module, values)
        name = module.__name__
        for value in values.values():
            if isinstance(value, type) and value.__module__ == name and id(value) not in found:
                found[id(value)] = (value, dict(vars(value)))
    return found


def _label(owner: Any) -> str:
    if isinstance(owner, ModuleType):
        return owner.__name__.rpartition(".")[2]
    return getattr(owner, "__qualname__", repr(owner))


def _name_of(value: Any) -> str:
    if value is _MISSING:
        return "absent"
    inner = getattr(value, "__func__", value)  # classmethod / staticmethod
    return getattr(inner, "__qualname__", None) or type(value).__name__


@dataclass
class NamespaceChange:
    """One attribute a patch rebound: ``modeling_llama.LlamaRMSNorm`` or ``LlamaMLP.forward``."""

    owner: Any
    name: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{_label(self.owner)}.{self.name}: {_name_of(self.before)} -> {_name_of(self.after)}"

    def apply(self, value: Any) -> None:
        if value is _MISSING:
            if self.name in vars(self.owner):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)


@dataclass
class NamespaceDelta:
    """What changed in transformers' module globals and class dicts between two moments."""

    changes: list[NamespaceChange] = field(default_factory=list)

    @classmethod
    def between(cls, before: dict[int, tuple[Any, dict[str, Any]]]) -> NamespaceDelta:
        """Entries of the owners in ``before`` that are no longer the same objects now."""
        changes = []
        for owner, was in before.values():
            now = vars(owner)
            for name in was.keys() | now.keys():
                old, new = was.get(name, _MISSING), now.get(name, _MISSING)
                if old is not new and not name.startswith("__"):
                    changes.append(NamespaceChange(owner, name, old, new))
        return cls(changes)

    def __bool__(self) -> bool:
        return bool(self.changes)


class PristineScope:
    """The test's patches, reversible on demand: ``with scope.pristine(): reference(**inputs)``."""

    def __init__(self) -> None:
        watch_imports()
        self._before = _namespaces()
        self.delta = NamespaceDelta()
        self._depth = 0

    def settle(self) -> None:
        """Record what the test's method and context patches changed since this scope was opened.

        A patch may import the modeling module it rebinds (Liger-Kernel's ``apply_liger_kernel_to_*``
        does, inside the test's ``context=``): that module's "before" is what importing it built, or
        the reference would be built from the patch and compared with itself.
        """
        before = dict(self._before)
        for module in _watched_modules():
            if id(module) in before:
                continue
            imported = as_imported(module)
            if imported is None:
                continue
            namespace, classes = imported
            before[id(module)] = (module, namespace)
            for klass, own in classes:
                before.setdefault(id(klass), (klass, own))
        self.delta = NamespaceDelta.between(before)

    @contextmanager
    def pristine(self) -> Iterator[None]:
        """Swap the test's changes out for the block (re-entrant), and back in after it."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        changes = self.delta.changes
        for change in changes:
            change.apply(change.before)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for change in changes:
                change.apply(change.after)


# the open scopes, innermost last: per-test state, so a context variable (as the test's tolerance and
# record sink), not a module global; a tuple, so a scope opened in a copied context stays there
_SCOPES: ContextVar[tuple[PristineScope, ...]] = ContextVar("modelpatch_pristine_scopes", default=())


def open_scope() -> PristineScope:
    """Start recording a test's method and context patches; the scope becomes current."""
    scope = PristineScope()
    _SCOPES.set((*_SCOPES.get(), scope))
    return scope


def close_scope(scope: PristineScope) -> None:
    _SCOPES.set(tuple(open_ for open_ in _SCOPES.get() if open_ is not scope))


def current_scope() -> PristineScope | None:
    scopes = _SCOPES.get()
    return scopes[-1] if scopes else None


@contextmanager
def pristine() -> Iterator[None]:
    """The world before the test's patches: no registered patches, no method or context patches.

    Example::

        with pristine():
            reference = LlamaForCausalLM.from_pretrained(path)
    """
    from pytest_modelpatch.isolation.guard import builtin_patch_state

    scope = current_scope()
    with builtin_patch_state():
        if scope is None:
            yield
        else:
            with scope.pristine():
                yield


@contextmanager
def running_pristine() -> Iterator[None]:
    """:func:`pristine` for running a model that is already built: the method and context patches swapped out.

    What :func:`pristine` does beyond this, emptying the patch and conversion registries and
    putting the class-level recorder tables back, matters only while a model is built: transformers
    reads those registries in ``from_pretrained``/``__init__`` (5.x ``apply_patches``, the
    conversion mapping, ``patch_output_recorders``), never in a forward or backward, and a reference
    pins its capture hooks at build time (``models/reference.py``). A model's call sees exactly the
    module globals and class attributes this swaps, so it computes what it computes in
    :func:`pristine`, without two copies of the registries per call (several times a tiny model's
    forward overhead). Build models in :func:`pristine`, never in this.
    """
    scope = current_scope()
    if scope is None:
        yield
        return
    with scope.pristine():
        yield
