"""Method patches in onnx-diagnostic's convention: ``_PATCHED_CLASS_`` and ``_PATCHES_``.

A patch class names the class it patches and the methods to copy onto it::

    class patched_LlamaRotaryEmbedding:
        _PATCHED_CLASS_ = LlamaRotaryEmbedding
        _PATCHES_ = ["forward"]

        def forward(self, x, position_ids): ...

The originals are saved in the active ``PatchStateSnapshot`` and put back when it
is restored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.guard import PatchStateSnapshot


def _method_patch_plan(patch: Any) -> tuple[Any, list[str]]:
    name = getattr(patch, "__qualname__", repr(patch))
    if not isinstance(patch, type):
        raise PatchUsageError(
            f"methods=[...] takes patch classes declaring _PATCHED_CLASS_ and _PATCHES_, got {patch!r}."
        )
    target = getattr(patch, "_PATCHED_CLASS_", None)
    names = getattr(patch, "_PATCHES_", None)
    if target is None or names is None:
        raise PatchUsageError(
            f"method patch {name} must declare _PATCHED_CLASS_ (the class to patch) and _PATCHES_ "
            "(the names of the methods to copy onto it), e.g. _PATCHED_CLASS_ = LlamaRotaryEmbedding; "
            '_PATCHES_ = ["forward"].'
        )
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise PatchUsageError(f"{name}._PATCHES_ must be a list of method names, got {names!r}.")
    wanted = [n for n in names if n is not None]
    missing = [n for n in wanted if n not in vars(patch)]
    if missing:
        raise PatchUsageError(
            f"{name}._PATCHES_ lists {missing}, which {name} does not define. Define them on the patch class "
            "or remove them from _PATCHES_."
        )
    absent = [n for n in wanted if not hasattr(target, n)]
    if absent:
        target_name = getattr(target, "__qualname__", repr(target))
        raise PatchUsageError(
            f"{name} patches {absent} on {target_name}, which has no such attribute: the patch is stale "
            "or targets the wrong class."
        )
    return target, wanted


def apply_method_patches(patches: Iterable[Any], snapshot: PatchStateSnapshot) -> None:
    """Copy each patch class's ``_PATCHES_`` onto its ``_PATCHED_CLASS_``, saving the originals."""
    plans = [(patch, *_method_patch_plan(patch)) for patch in patches]  # validate all before changing any
    for patch, target, names in plans:
        for name in names:
            snapshot.save_attribute(target, name)
            # the raw __dict__ value keeps staticmethod/classmethod descriptors intact
            setattr(target, name, vars(patch)[name])
