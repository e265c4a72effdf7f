"""transformers' process-global registries, found by walking its loaded modules, compared and put back.

A registry is a dict, list or set a loaded ``transformers.*`` module holds at module level
(``transformers.loss.loss_utils.LOSS_MAPPING``, ``transformers.pytorch_utils.ALL_LAYERNORM_LAYERS``),
the two mappings of a ``GeneralInterface`` (the class's ``_global_mapping``, which ``register`` writes,
and a singleton's own ``_local_mapping``), what ``AutoConfig.register`` and ``AutoModel.register``
write (a lazy auto mapping's ``_extra_content``), and the dicts, lists and sets a registry dict
holds (``transformers.exporters.utils._PATCHES['onnx']``). They are found by walking
``sys.modules``, not read from a list, so a registry a release adds is watched the day it ships.
Not walked: the modeling and configuration modules of ``transformers.models`` (``library_state.py``
holds their globals by identity), lazy modules (a namespace of import structure and attributes
cached from the submodules walked here) and the tables ``snapshot.py`` restores.

What transformers writes itself is no leak:

- while importing: a module registers into another's table as it executes (a cache layer class
  into ``DYNAMIC_LAYER_TYPE_MAPPING``, an exporter's patches into ``_PATCHES``). ``library_state.py``'s
  import hook calls :func:`before_import` and :func:`after_import` around each outermost transformers
  module it executes; what changed in between is logged, and a snapshot expects it. A registry
  first found after an import is compared with what that import built.
- while running: its memo tables. A name ending in ``cache`` says so; :data:`FILLED_WHILE_RUNNING`
  names those whose names do not. And a remote-code load (``trust_remote_code``) registers the
  classes it loaded, defined in ``transformers_modules.*``, with the Auto classes.

A snapshot is shallow copies, compared with ``==`` (identity first, in C) and diffed by identity.
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import operator
import re
import sys
import types
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_modelpatch.isolation.redefinition import held_function
from pytest_modelpatch.isolation.snapshot import RESTORED_GLOBALS

MISSING: Any = object()
_MODELS_PREFIX = "transformers.models."
_WATCHED_PREFIXES = ("modeling_", "configuration_")
_GENERIC = "transformers.utils.generic"  # GeneralInterface's module (5.x)
_REMOTE_CODE = "transformers_modules."  # where transformers puts the code a trust_remote_code load runs
# Tables transformers fills while it runs whose names do not end in "cache": the writes inside its
# functions (transformers 5.24), less the register* functions a user calls.
FILLED_WHILE_RUNNING = {
    "_CAN_RECORD_REGISTRY": "PreTrainedModel.post_init records each model class's _can_record_outputs",
    "_registered_model_output_types": "a ModelOutput's first instance registers its class with torch's pytree, "
    "once: emptied, the next instance would register it again and torch refuses",
    "_KERNEL_MODULE_MAPPING": "integrations.hub_kernels.lazy_load_kernel: the kernels it loaded",
    "_GRIDS": "integrations.gguf.dequant: lookup tables built on first use",
    "_SIGN_TABLES": "integrations.gguf.dequant: lookup tables built on first use",
    "_SYMM_BUFFERS": "integrations.deepgemm: symmetric-memory buffers",
}
_PLAIN = frozenset({dict, list, set, OrderedDict, defaultdict})
# a subclass that keeps the built-in == keeps its data where the built-in type does (ClassInstantier)
_BUILTIN_EQ = (dict.__eq__, OrderedDict.__eq__, list.__eq__, set.__eq__)


def is_modeling_module(name: str) -> bool:
    """``transformers.models.llama.modeling_llama``, ``configuration_llama`` and the like; not the auto classes' tables."""
    return (
        name.startswith(_MODELS_PREFIX)
        and name.rpartition(".")[2].startswith(_WATCHED_PREFIXES)
        and ".auto." not in name
    )


def describe(value: Any) -> str:
    """A value as a leak report names it: a function or class by name, a decorator's object by what it runs, a scalar by repr."""
    if value is MISSING:
        return "absent"
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if isinstance(name, str):
        return name
    inner = held_function(value)  # a decorator's callable object (kernels' Func): name what it runs
    if inner is not None:
        return f"{type(value).__name__}({inner.__qualname__})"
    if isinstance(value, str | bytes | int | float | bool | type(None)):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return type(value).__name__


@dataclass(eq=False)
class Registry:
    """One registry: the live container and where it is held, for its qualified name."""

    container: Any
    places: list[tuple[str, str]] = field(default_factory=list)  # (module, global) holding it or what holds it
    path: str = ""  # from that global to it: "", "._local_mapping", "._extra_content", "['onnx']"
    owner: str | None = None  # the GeneralInterface class whose _global_mapping it is

    @property
    def name(self) -> str:
        """``transformers.loss.loss_utils.LOSS_MAPPING``: named by the module that assigns it, not one that imports it."""
        if self.owner is not None:
            return f"{self.owner}{self.path}"
        module, key = _home(self.places)
        return f"{module}.{key}{self.path}"


def _home(places: list[tuple[str, str]]) -> tuple[str, str]:
    """The place that defines a registry: the module whose source assigns the name (the rest import it)."""
    ordered = sorted(places)
    if len(ordered) > 1:
        for module_name, key in ordered:
            path = getattr(sys.modules.get(module_name), "__file__", None)
            try:
                source = (
                    Path(path).read_text(encoding="utf-8") if isinstance(path, str) and path.endswith(".py") else ""
                )
            except OSError:
                source = ""
            if re.search(rf"^{re.escape(key)}\s*(?::[^=\n]*)?=(?!=)", source, re.M):
                return module_name, key
    return ordered[0]


# -- discovery --------------------------------------------------------------------
# (global, container, path, owner, skipped: a table left to snapshot.py or one transformers fills itself)
_Held = tuple[str, Any, str, str | None, bool]
_WALKED: dict[str, tuple[types.ModuleType, list[_Held]]] = {}  # each module's registries, found once an execution


def _is_container(value: Any) -> bool:
    kind = type(value)
    return kind in _PLAIN or (isinstance(value, dict | list | set) and kind.__eq__ in _BUILTIN_EQ)


def _skipped(module_name: str, key: str) -> bool:
    return key.lower().endswith("cache") or key in FILLED_WHILE_RUNNING or (module_name, key) in RESTORED_GLOBALS


def _walk(module: types.ModuleType) -> list[_Held]:
    """The registries one module holds at module level, and what its interfaces and lazy auto mappings hold."""
    generic = sys.modules.get(_GENERIC)
    base = vars(generic).get("GeneralInterface") if generic is not None else None
    name = module.__name__
    found: list[_Held] = []
    for key, value in list(vars(module).items()):
        if key.startswith("__"):
            continue
        skip = _skipped(name, key)
        if _is_container(value):
            extra = getattr(value, "__dict__", {}).get("_extra_content")  # _LazyAutoMapping, _LazyConfigMapping
            found.append((key, extra, "._extra_content", None, skip) if isinstance(extra, dict) else
                         (key, value, "", None, skip))  # fmt: skip
            continue
        if base is None:
            continue
        kind = value if isinstance(value, type) else type(value)
        if base not in kind.__mro__:
            continue
        if kind is not value and isinstance(local := getattr(value, "__dict__", {}).get("_local_mapping"), dict):
            found.append((key, local, "._local_mapping", None, skip))
        for klass in kind.__mro__:  # each class of the interface that has a mapping of its own
            if isinstance(mapping := vars(klass).get("_global_mapping"), dict):
                found.append((key, mapping, "._global_mapping", f"{klass.__module__}.{klass.__qualname__}", skip))
    return found


def forget(module_name: str) -> None:
    """``module_name`` executed (imported or reloaded): walk it again."""
    _WALKED.pop(module_name, None)


def registries() -> list[Registry]:
    """Every registry of the loaded transformers modules, one entry a container, its nested ones after it."""
    by_id: dict[int, Registry] = {}
    skipped: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not (name == "transformers" or name.startswith("transformers.")) or type(module) is not types.ModuleType:
            continue  # a lazy module (a ModuleType subclass): its attributes are cached from modules walked here
        if is_modeling_module(name):
            continue
        walked = _WALKED.get(name)
        if walked is None or walked[0] is not module:
            walked = _WALKED[name] = (module, _walk(module))
        for key, container, path, owner, skip in walked[1]:
            if skip:
                skipped.add(id(container))
                continue
            registry = by_id.get(id(container))
            if registry is None:
                registry = by_id[id(container)] = Registry(container, path=path, owner=owner)
            registry.places.append((name, key))
    found = [r for i, r in by_id.items() if i not in skipped]
    for parent in list(found):
        holder = parent.container
        if isinstance(holder, dict) and not _PLAIN.isdisjoint(map(type, dict.values(holder))):
            for key, value in dict.items(holder):
                if type(value) in _PLAIN and id(value) not in by_id and id(value) not in skipped:
                    by_id[id(value)] = nested = Registry(value, parent.places, f"{parent.path}[{key!r}]", parent.owner)
                    found.append(nested)
    return found


# -- copies, comparisons, restores ------------------------------------------------
def _is_name(item: Any) -> bool:
    return type(item) is str or (type(item) is tuple and all(type(part) is str for part in item))


def is_name_table(container: Any) -> bool:
    """Every key and value a string (or a tuple of strings): the auto classes' model type -> class name
    tables, docs and dependency tables; no code in them.

    4,000 of the ~5,500 entries of transformers 5.24's registries: comparing them cost every test
    ~45 us, more than the rest of the guard. ``LibraryState.unchanged`` compares them in full for a
    test that uses the plugin, and by length for any other (an addition or removal shows there; a
    name replaced in place shows at the next test that uses the plugin). An empty one is no table:
    what is first written into it may be code.
    """
    if not container:
        return False
    items = [*dict.keys(container), *dict.values(container)] if isinstance(container, dict) else container
    return all(map(_is_name, items))


def copy_container(container: Any) -> Any:
    """A plain shallow copy of what the container holds, read from its storage (not through a subclass's ``__getitem__``)."""
    if isinstance(container, dict):
        return container.copy() if type(container) is dict else dict(zip(dict.keys(container), dict.values(container)))
    return list.copy(container) if isinstance(container, list) else set.copy(container)


def _equal(live: Any, saved: Any) -> bool:
    try:
        return bool(live == saved)
    except Exception:  # noqa: BLE001 - a distinct tensor's ambiguous truth value: look closer
        return False


def _restore(live: Any, saved: Any) -> None:
    if isinstance(live, OrderedDict):  # through OrderedDict's own methods: its order is kept beside the dict
        OrderedDict.clear(live)
        for key, value in saved.items():
            OrderedDict.__setitem__(live, key, value)
    elif isinstance(live, dict):
        dict.clear(live)
        dict.update(live, saved)
    elif isinstance(live, list):
        list.__setitem__(live, slice(None), saved)
    else:
        set.clear(live)
        set.update(live, saved)


def _from_remote_code(*values: Any) -> bool:
    """A class or function defined by code a ``trust_remote_code`` load ran: transformers registers those itself."""
    return any(str(getattr(v, "__module__", "")).startswith(_REMOTE_CODE) for v in values)


def _changes(name: str, live: Any, saved: Any) -> tuple[list[str], Any]:
    """What differs, by identity, and the state to restore (``saved`` plus what transformers registered itself)."""
    if isinstance(saved, dict):
        now, keep = copy_container(live), dict(saved)
        found = []
        for key in sorted(now.keys() | saved.keys(), key=repr):
            was, new = saved.get(key, MISSING), now.get(key, MISSING)
            if new is was:
                continue
            if was is MISSING and _from_remote_code(key, new):
                keep[key] = new
            elif was is MISSING:
                found.append(f"{name}[{key!r}] added ({describe(new)})")
            elif new is MISSING:
                found.append(f"{name}[{key!r}] removed (was {describe(was)})")
            else:
                found.append(f"{name}[{key!r}]: {describe(was)} -> {describe(new)}")
        return found, keep
    if isinstance(saved, set):
        added, removed = sorted(map(describe, live - saved)), sorted(map(describe, saved - live))
        return [f"{name}: {item} added" for item in added] + [f"{name}: {item} removed" for item in removed], saved
    ids = {id(item) for item in saved}
    kept = {id(item) for item in live}
    appended = len(live) >= len(saved) and all(map(operator.is_, live, saved))
    found = [
        f"{name}: {describe(item)} {'appended' if appended else 'inserted'}" for item in live if id(item) not in ids
    ]
    found += [f"{name}: {describe(item)} removed" for item in saved if id(item) not in kept]
    return found or [f"{name}: reordered"], saved


def _reconcile(registry: Registry, expected: Any) -> list[str]:
    live = registry.container
    if _equal(live, expected):
        return []
    found, restored = _changes(registry.name, live, expected)
    _restore(live, restored)
    return found


# -- what importing transformers' modules writes ------------------------------------
# per registry: (the container, [(moment, before, after)]) for each import that changed it
_IMPORT_WRITES: dict[int, tuple[Any, list[tuple[int, Any, Any]]]] = {}
# registries first found after an import: (the registry, that moment, as importing built it)
_AS_IMPORTED: dict[int, tuple[Registry, int, Any]] = {}


def before_import() -> list[tuple[Registry, Any]]:
    """The registries as they are, just before the hook executes an outermost transformers module."""
    return [(registry, copy_container(registry.container)) for registry in registries()]


def after_import(before: list[tuple[Registry, Any]], moment: int) -> None:
    """Log what that execution wrote into the registries there were, and keep the new ones as it built them."""
    for registry, was in before:
        if not _equal(registry.container, was):
            log = _IMPORT_WRITES.setdefault(id(registry.container), (registry.container, []))[1]
            log.append((moment, was, copy_container(registry.container)))
    known = {id(registry.container) for registry, _ in before}
    for registry in registries():
        key = id(registry.container)
        if key not in known and key not in _AS_IMPORTED:
            _AS_IMPORTED[key] = (registry, moment, copy_container(registry.container))


def _expected(container: Any, saved: Any, since: int) -> Any:
    """``saved`` with what importing wrote into ``container`` after the moment ``since``."""
    logged = _IMPORT_WRITES.get(id(container))
    if logged is None or logged[0] is not container:
        return saved
    for moment, before, after in logged[1]:
        if moment > since:
            saved = _replayed(saved, before, after)
    return saved


def _replayed(state: Any, before: Any, after: Any) -> Any:
    if isinstance(after, dict):
        replayed = {k: v for k, v in state.items() if k in after or k not in before}
        replayed.update({k: v for k, v in after.items() if before.get(k, MISSING) is not v})
        return replayed
    if isinstance(after, set):
        return (state - (before - after)) | (after - before)
    if len(after) >= len(before) and all(map(operator.is_, after, before)):
        return state + after[len(before) :]  # what the import appended, after whatever was there
    return list(after)


@dataclass(eq=False)
class RegistrySnapshot:
    """Copies of every registry at one moment (the import hook's count); ``reconcile()`` restores and reports."""

    moment: int
    saved: list[tuple[Registry, Any]]

    @classmethod
    def take(cls, moment: int) -> RegistrySnapshot:
        return cls(moment, [(registry, copy_container(registry.container)) for registry in registries()])

    def live(self) -> list[Any]:
        """The containers, for a caller's fast path (compare each with :func:`copy_container` of it)."""
        return [registry.container for registry, _ in self.saved]

    def reconcile(self, moment: int) -> list[str]:
        """Put back what differs from the snapshot and what transformers' imports since wrote; return the leaks."""
        found: list[str] = []
        for registry, saved in self.saved:
            found += _reconcile(registry, _expected(registry.container, saved, self.moment))
        if moment != self.moment:  # modules imported since: their registries against what importing built
            seen = {id(registry.container) for registry, _ in self.saved}
            for registry, built_at, built in list(_AS_IMPORTED.values()):
                if built_at > self.moment and id(registry.container) not in seen:
                    found += _reconcile(registry, _expected(registry.container, built, built_at))
        return found
