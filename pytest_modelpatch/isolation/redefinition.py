"""Whether an object is another one defined again, as ``importlib.reload`` builds it anew.

A reload re-executes a module into its namespace: every function and class it defines, and
every object a decorator built from them, is a new object. The leak guard takes such a
re-creation for a revert and anything else for a patch. Decorators build more than functions:
``functools.wraps`` wrappers, callable objects holding the function and, for kernels 0.16's
``use_kernel_forward_from_hub`` on a function (transformers 5.17 with kernels installed:
``apply_rotary_pos_emb`` in most modeling modules), an instance of an ``nn.Module`` subclass
made per call, ``Func``, whose ``forward`` closes over the function. ``redefined()`` follows
types, closures, ``__wrapped__`` and instance state down to the decorated function, which must
be the module's own again. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import types
from typing import Any

_ABSENT: Any = object()


class _PlainObject:
    pass


# How an instance of a class statement without __slots__ is laid out: its __dict__ is all it holds.
_PLAIN_LAYOUT = (_PlainObject.__basicsize__, _PlainObject.__dictoffset__, _PlainObject.__weakrefoffset__)
# Made by Python for each class statement, never by a patch.
_CLASS_SLOTS = frozenset({"__dict__", "__weakref__"})


def redefined(original: Any, fresh: Any) -> bool:
    """``fresh`` is ``original``'s definition executed again: the same code, holding alike objects.

    For example ``redefined(was, modeling_llama.apply_rotary_pos_emb)`` after
    ``importlib.reload(modeling_llama)``, whichever decorator built the two.
    """
    return _alike(original, fresh, set())


def _alike(original: Any, fresh: Any, seen: set[tuple[int, int]]) -> bool:
    if original is fresh:
        return True
    pair = (id(original), id(fresh))
    if pair in seen:  # a cycle (a method's __class__ cell): alike unless something else differs
        return True
    seen.add(pair)
    # a decorator that makes a class per call (kernels' Func): alike types, defined again
    if type(original) is not type(fresh) and not _alike(type(original), type(fresh), seen):
        return False
    if hasattr(original, "__qualname__"):
        return _definition_alike(original, fresh, seen)
    try:  # module-level data (strings, dicts) built again
        if original == fresh:
            return True
    except Exception:  # noqa: BLE001 - e.g. a tensor's ambiguous truth value: data, not a patch
        return True
    # unequal containers may hold definitions built again (a dict of attention classes)
    if isinstance(original, (tuple, list)):
        return len(original) == len(fresh) and all(_alike(a, b, seen) for a, b in zip(original, fresh))
    if isinstance(original, dict):
        return original.keys() == fresh.keys() and all(_alike(v, fresh[k], seen) for k, v in original.items())
    # An object compared by identity (a callable a decorator returned) is alike if its state is,
    # and only where __dict__ is all of it: functools.partial keeps its function in a C field.
    layout = type(original)
    if (layout.__basicsize__, layout.__dictoffset__, layout.__weakrefoffset__) != _PLAIN_LAYOUT:
        return False
    return _alike(vars(original), getattr(fresh, "__dict__", _ABSENT), seen)


def _definition_alike(original: Any, fresh: Any, seen: set[tuple[int, int]]) -> bool:
    """A function, class or wrapper: same module, name and file, wrapping alike objects."""
    if getattr(original, "__module__", _ABSENT) != getattr(fresh, "__module__", None):
        return False
    if getattr(original, "__qualname__", _ABSENT) != getattr(fresh, "__qualname__", None):
        return False
    code, fresh_code = getattr(original, "__code__", None), getattr(fresh, "__code__", None)
    if code is not None and getattr(fresh_code, "co_filename", None) != code.co_filename:
        return False
    # functools.wraps and lru_cache wrappers, staticmethod: a name copied from the wrapped function
    wrapped = getattr(original, "__wrapped__", _ABSENT)
    if wrapped is not _ABSENT and not _alike(wrapped, getattr(fresh, "__wrapped__", _ABSENT), seen):
        return False
    if isinstance(original, types.FunctionType):
        return _closures_alike(original.__closure__ or (), fresh.__closure__ or (), seen)
    if not isinstance(original, type):
        return True
    # A class patched by subclassing the original keeps module and name: not a re-creation.
    # (__mro__, not issubclass: that raises on a TypedDict, GraniteFlashAttentionKwargs in 5.24.)
    if original in fresh.__mro__:
        return False
    # A class a function makes holds what it was made from (kernels' Func: the decorated function,
    # in forward's closure); a module's own class the guard compares attribute by attribute.
    if "<locals>" not in original.__qualname__:
        return True
    if not _alike(original.__bases__, fresh.__bases__, seen):
        return False
    attributes, fresh_attributes = vars(original), vars(fresh)
    keys = attributes.keys() - _CLASS_SLOTS
    return keys == fresh_attributes.keys() - _CLASS_SLOTS and all(
        _alike(attributes[k], fresh_attributes[k], seen) for k in keys
    )


def _closures_alike(cells: tuple[Any, ...], fresh_cells: tuple[Any, ...], seen: set[tuple[int, int]]) -> bool:
    """What two functions close over: the function a wrapper calls, a decorator's arguments."""
    if len(cells) != len(fresh_cells):
        return False
    return all(_alike(_contents(a), _contents(b), seen) for a, b in zip(cells, fresh_cells))


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: a name the enclosing function had not bound yet
        return _ABSENT


def held_function(value: Any) -> types.FunctionType | None:
    """The function a decorator's callable object runs: in its state, or in its class's
    ``forward``/``__call__`` closure (kernels' ``Func``); None when it holds none."""
    for held in (getattr(value, "__dict__", None) or {}).values():
        if isinstance(held, types.FunctionType):
            return held
    for method in ("forward", "__call__"):
        for cell in getattr(getattr(type(value), method, None), "__closure__", None) or ():
            if isinstance(held := _contents(cell), types.FunctionType):
                return held
    return None
