"""What transformers' global patch state looks like, and how to put it back.

``PatchStateSnapshot.take()`` records, on every transformers version the package
supports, the monkey-patch mapping and compiled-pattern cache, the checkpoint
conversion registry and ``USER_REGISTERED_MAPPINGS``, the fusion caches (5.10+),
class-level ``_can_record_outputs`` tables and attributes saved by method patches.
Nothing here imports torch or transformers: state is read from ``sys.modules``,
and a part whose module is not loaded yet is recorded as pristine.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

MONKEY_PATCHING = "transformers.monkey_patching"
CONVERSION_MAPPING = "transformers.conversion_mapping"
FUSION_MAPPING = "transformers.fusion_mapping"
MODELING_UTILS = "transformers.modeling_utils"
# The module globals PatchStateSnapshot restores: the leak guard's walk of transformers' registries leaves them to it.
RESTORED_GLOBALS = (
    (MONKEY_PATCHING, "_monkey_patch_mapping_cache"),
    (MONKEY_PATCHING, "_compiled_patterns_cache"),
    (CONVERSION_MAPPING, "_checkpoint_conversion_mapping_cache"),
    (CONVERSION_MAPPING, "USER_REGISTERED_MAPPINGS"),
    (FUSION_MAPPING, "_FUSION_DISCOVERY_CACHE"),
    (FUSION_MAPPING, "_REGISTERED_FUSION_SOURCE_PATTERNS"),
)

_MISSING: Any = object()


def _class_name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)


@dataclass
class _RecorderTable:
    """The first-seen state of one class-level ``_can_record_outputs`` dict."""

    owner: str
    table: dict[str, Any]
    items: dict[str, Any]
    lists: list[tuple[list[Any], list[Any]]]
    targets: list[tuple[Any, Any, Any]]

    @classmethod
    def capture(cls, owner: str, table: dict[str, Any]) -> _RecorderTable:
        lists: list[tuple[list[Any], list[Any]]] = []
        targets: list[tuple[Any, Any, Any]] = []
        for value in table.values():
            members = value if isinstance(value, list) else [value]
            if isinstance(value, list):
                lists.append((value, list(value)))
            for recorder in members:
                if hasattr(recorder, "target_class") and hasattr(recorder, "class_name"):
                    targets.append((recorder, recorder.target_class, recorder.class_name))
        return cls(owner, table, dict(table), lists, targets)

    def changes(self) -> list[str]:
        found = []
        for key in self.table.keys() | self.items.keys():
            now, was = self.table.get(key, _MISSING), self.items.get(key, _MISSING)
            if now is not was and now != was:
                found.append(f"{self.owner}._can_record_outputs[{key!r}] is {_describe(now)} (was {_describe(was)})")
        for lst, copy in self.lists:
            if lst != copy:
                found.append(f"{self.owner}._can_record_outputs: a recorder list became {_describe(lst)}")
        for recorder, target, name in self.targets:
            if recorder.target_class is not target or recorder.class_name != name:
                found.append(
                    f"{self.owner}._can_record_outputs: OutputRecorder.target_class is "
                    f"{_describe(recorder.target_class)} (was {_describe(target)})"
                )
        return found

    def restore(self) -> None:
        self.table.clear()
        self.table.update(self.items)
        for lst, copy in self.lists:
            lst[:] = copy
        for recorder, target, name in self.targets:
            recorder.target_class = target
            recorder.class_name = name


def _describe(value: Any) -> str:
    if value is _MISSING:
        return "absent"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, list):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if hasattr(value, "target_class"):
        return f"OutputRecorder({_describe(value.target_class)})"
    return repr(value)


@dataclass
class _SavedAttribute:
    owner: Any
    name: str
    value: Any  # _MISSING when the attribute was not in the owner's own __dict__

    def restore(self) -> None:
        if self.value is _MISSING:
            if self.name in vars(self.owner):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.value)


@dataclass(eq=False)  # identity: the active stack must remove this very snapshot
class PatchStateSnapshot:
    """What transformers' global patch state looked like when it was taken.

    ``None`` for a part means its module was not imported yet: the pristine state.
    """

    mapping: dict[str, type] | None = None
    compiled: dict[str, Any] | None = None
    conversions: dict[str, Any] | None = None
    conversions_loaded: bool = False
    conversion_lists: dict[str, list[Any]] = field(default_factory=dict)
    user_registered: set[str] | None = None
    fusion_discovery: dict[str, dict[Any, Any]] | None = None
    fusion_sources: dict[Any, set[Any]] | None = None
    recorder_tables: dict[int, _RecorderTable] = field(default_factory=dict)
    attributes: list[_SavedAttribute] = field(default_factory=list)
    _saved_keys: set[tuple[int, str]] = field(default_factory=set)
    _settled: tuple[Any, ...] | None = None  # the live state settle() saw: see unchanged()

    # -- taking -------------------------------------------------------------
    @classmethod
    def take(cls) -> PatchStateSnapshot:
        snap = cls()
        mp = sys.modules.get(MONKEY_PATCHING)
        if mp is not None:
            snap.mapping = dict(mp._monkey_patch_mapping_cache)
            snap.compiled = dict(getattr(mp, "_compiled_patterns_cache", {}))
        cm = sys.modules.get(CONVERSION_MAPPING)
        if cm is not None:
            snap.conversions_loaded = True
            cache = cm._checkpoint_conversion_mapping_cache
            if cache is not None:
                snap.conversions = dict(cache)
                snap.conversion_lists = {k: list(v) for k, v in cache.items() if isinstance(v, list)}
            registered = getattr(cm, "USER_REGISTERED_MAPPINGS", None)
            snap.user_registered = set(registered) if registered is not None else None
        fm = sys.modules.get(FUSION_MAPPING)
        if fm is not None:
            discovery = getattr(fm, "_FUSION_DISCOVERY_CACHE", None)
            if discovery is not None:
                snap.fusion_discovery = {k: dict(v) for k, v in discovery.items()}
            sources = getattr(fm, "_REGISTERED_FUSION_SOURCE_PATTERNS", None)
            if sources is not None:
                snap.fusion_sources = {k: set(v) for k, v in sources.items()}
        for owner, table in _loaded_recorder_tables():
            snap.remember_recorder_table(owner, table)
        return snap

    def remember_recorder_table(self, owner: type, table: Any) -> None:
        """Record a ``_can_record_outputs`` dict the first time it is seen."""
        if isinstance(table, dict) and id(table) not in self.recorder_tables:
            self.recorder_tables[id(table)] = _RecorderTable.capture(_class_name(owner), table)

    def save_attribute(self, owner: Any, name: str) -> None:
        """Remember ``owner.name`` (from its own ``__dict__``) so restore() puts it back."""
        key = (id(owner), name)
        if key not in self._saved_keys:
            self._saved_keys.add(key)
            self.attributes.append(_SavedAttribute(owner, name, vars(owner).get(name, _MISSING)))

    # -- comparing ----------------------------------------------------------
    def changes(self) -> list[str]:
        """Human-readable differences between this snapshot and the live state."""
        found: list[str] = []
        mp = sys.modules.get(MONKEY_PATCHING)
        if mp is not None:
            now, was = mp._monkey_patch_mapping_cache, self.mapping or {}
            for key in sorted(now.keys() - was.keys()):
                found.append(f"patch mapping: {key!r} -> {_describe(now[key])} was registered and not removed")
            for key in sorted(was.keys() - now.keys()):
                found.append(f"patch mapping: {key!r} was removed")
            for key in sorted(now.keys() & was.keys()):
                if now[key] is not was[key]:
                    found.append(
                        f"patch mapping: {key!r} now maps to {_describe(now[key])} (was {_describe(was[key])})"
                    )
        cm = sys.modules.get(CONVERSION_MAPPING)
        if cm is not None:
            found += self._conversion_changes(cm)
        for table in self.recorder_tables.values():
            found += table.changes()
        return found

    def _conversion_changes(self, cm: types.ModuleType) -> list[str]:
        registered = getattr(cm, "USER_REGISTERED_MAPPINGS", None)
        new_keys = sorted(registered - (self.user_registered or set())) if registered is not None else []
        found = [f"checkpoint conversions: {key!r} was registered and not removed" for key in new_keys]
        cache = cm._checkpoint_conversion_mapping_cache
        if cache is None:
            return found
        if self.conversions is None:
            if registered is not None:
                return found
            # transformers < 5.x without USER_REGISTERED_MAPPINGS: compare with the built-in table
            builtin = builtin_conversions(cm)
            changed = [k for k in sorted(cache) if k not in builtin or repr(cache[k]) != repr(builtin[k])]
            return found + [
                f"checkpoint conversions: the mapping for {key!r} was registered or changed" for key in changed
            ]
        for key in sorted(cache.keys() | self.conversions.keys()):
            if key in new_keys:
                continue
            now, was = cache.get(key, _MISSING), self.conversions.get(key, _MISSING)
            if now is not was or (isinstance(now, list) and now != self.conversion_lists.get(key)):
                found.append(f"checkpoint conversions: the mapping for {key!r} was replaced or changed")
        return found

    # -- the fast path for a test that changed nothing ------------------------
    def settle(self) -> None:
        """Remember the live state, just after take() or restore(), for ``unchanged()``."""
        self._settled = _copy_lists(self._probe())

    def unchanged(self) -> bool:
        """True when everything restore() writes is as settle() saw it: restore() and changes() have nothing to do.

        Restoring is idempotent, so a state equal to the one it left needs no second pass.
        One list comparison, in C and identity first, so a rebound class always differs;
        conversion and recorder lists are compared member by member with copies, as
        restore() writes them back. A distinct object equal to the one it replaced (a
        re-created list holding the same converters) passes: restoring would change nothing
        a later test can see. Never true before settle().
        """
        if self._settled is None:
            return False
        try:
            return self._probe() == self._settled
        except Exception:  # noqa: BLE001 - a value whose == raises: let changes() look closer
            return False

    def _probe(self) -> list[Any]:
        """Every object restore() puts back, as nested tuples and lists built by C-level calls.

        C-level calls because a Python loop over the built-in conversion entries (over a thousand
        converters) costs every test of a session once any model has loaded.
        """
        mp, cm, fm = (sys.modules.get(name) for name in (MONKEY_PATCHING, CONVERSION_MAPPING, FUSION_MAPPING))
        parts: list[Any] = [mp, cm, fm, [vars(a.owner).get(a.name, _MISSING) for a in self.attributes]]
        if mp is not None:
            parts += [_view(mp._monkey_patch_mapping_cache), _view(getattr(mp, "_compiled_patterns_cache", None))]
        if cm is not None:
            registered = getattr(cm, "USER_REGISTERED_MAPPINGS", None)
            parts += [
                _view(cm._checkpoint_conversion_mapping_cache),
                None if registered is None else frozenset(registered),
            ]
        if fm is not None:
            discovery = getattr(fm, "_FUSION_DISCOVERY_CACHE", None)
            sources = getattr(fm, "_REGISTERED_FUSION_SOURCE_PATTERNS", None)
            parts += [
                _view(discovery),
                None if discovery is None else list(map(_view, discovery.values())),
                _view(sources),
                None if sources is None else list(map(frozenset, sources.values())),
            ]
        for table in self.recorder_tables.values():
            parts += [
                _view(table.table),
                [lst for lst, _ in table.lists],
                [_TARGET(recorder) for recorder, _, _ in table.targets],
            ]
        return parts

    # -- restoring ----------------------------------------------------------
    def restore(self) -> None:
        """Put every recorded part back, in place where transformers holds references."""
        for saved in reversed(self.attributes):
            saved.restore()
        mp = sys.modules.get(MONKEY_PATCHING)
        if mp is not None:
            with mp._monkey_patch_lock:
                mp._monkey_patch_mapping_cache.clear()
                mp._monkey_patch_mapping_cache.update(self.mapping or {})
                compiled = getattr(mp, "_compiled_patterns_cache", None)
                if compiled is not None:
                    compiled.clear()
                    compiled.update(self.compiled or {})
        cm = sys.modules.get(CONVERSION_MAPPING)
        if cm is not None:
            self._restore_conversions(cm)
        fm = sys.modules.get(FUSION_MAPPING)
        if fm is not None:
            _restore_nested(getattr(fm, "_FUSION_DISCOVERY_CACHE", None), self.fusion_discovery, dict)
            _restore_nested(getattr(fm, "_REGISTERED_FUSION_SOURCE_PATTERNS", None), self.fusion_sources, set)
        for table in self.recorder_tables.values():
            table.restore()

    def _restore_conversions(self, cm: Any) -> None:  # transformers.conversion_mapping, whose cache it sets
        registered = getattr(cm, "USER_REGISTERED_MAPPINGS", None)
        dirty_registration = registered is not None and bool(registered - (self.user_registered or set()))
        if registered is not None:
            registered.clear()
            registered.update(self.user_registered or set())
        cache = cm._checkpoint_conversion_mapping_cache
        if self.conversions is None:
            # The cache was not built yet: drop it only when something was registered
            # into it, since rebuilding it costs more than most tests.
            if cache is not None and (dirty_registration or registered is None):
                cm._checkpoint_conversion_mapping_cache = None
            return
        if cache is None:
            cm._checkpoint_conversion_mapping_cache = cache = {}
        cache.clear()
        cache.update(self.conversions)
        for key, items in self.conversion_lists.items():
            cache[key][:] = items


_TARGET = attrgetter("target_class", "class_name")


def _view(table: dict[Any, Any] | None) -> tuple[Any, ...] | None:
    """A dict as (itself, its keys, its values): compared identity first, in C."""
    return None if table is None else (table, tuple(table), list(table.values()))


def _copy_lists(value: Any) -> Any:
    """``value`` with every list in it copied (tuples rebuilt around them): a probe's live lists, frozen."""
    if isinstance(value, list):
        return [_copy_lists(member) for member in value]
    if isinstance(value, tuple):
        return tuple(_copy_lists(member) for member in value)
    return value


def _restore_nested(live: dict[Any, Any] | None, saved: dict[Any, Any] | None, kind: type) -> None:
    if live is None:
        return
    live.clear()
    for key, value in (saved or {}).items():
        live[key] = kind(value)


def _loaded_recorder_tables() -> Iterator[tuple[type, dict[str, Any]]]:
    """Every class-level ``_can_record_outputs`` dict of the loaded PreTrainedModel subclasses."""
    mu = sys.modules.get(MODELING_UTILS)
    base = getattr(mu, "PreTrainedModel", None) if mu is not None else None
    if base is None:
        return
    seen: set[type] = set()
    stack = [base]
    while stack:
        cls = stack.pop()
        table = cls.__dict__.get("_can_record_outputs")
        if isinstance(table, dict):
            yield cls, table
        for sub in type.__subclasses__(cls):
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)


_BUILTIN_CONVERSIONS: dict[str, Any] = {}


def builtin_conversions(cm: types.ModuleType) -> dict[str, Any]:
    """transformers' own conversion table, built once per process (a build costs more than most tests)."""
    if not _BUILTIN_CONVERSIONS:
        _BUILTIN_CONVERSIONS.update(cm._build_checkpoint_conversion_mapping())
    return _BUILTIN_CONVERSIONS
