"""What a failure message adds: a module's class on each side, the ``cache`` keyword rename, each side's implementations."""

from __future__ import annotations

import inspect
import re
import weakref
from collections.abc import Mapping

import torch

from pytest_modelpatch.compare._engine.devices import unwrapped
from pytest_modelpatch.compare._engine.outputs import TensorComparison
from pytest_modelpatch.settings import IMPLEMENTATION_AXES, describe_implementations, implementations_of


def class_pair(reference_class: str, patched_class: str) -> str:
    """``LlamaMLP`` when both models ran the same class, else which ran where: how reports name a module."""
    if reference_class == patched_class:
        return reference_class
    return f"{reference_class} in the reference, {patched_class} in the patched model"


# ---------------------------------------------------------------------------
# The cache keyword (transformers 5.24 renamed past_key_values to cache)
# ---------------------------------------------------------------------------

_CACHE_KEYWORDS: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_CACHE_LEAF = re.compile(r"^(cache|past_key_values)\.layers\[\d+\]\.(keys|values)$")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` from transformers 5.24, else ``past_key_values``."""
    cls = type(unwrapped(model))  # a wrapper's forward hands its keywords on
    keyword = _CACHE_KEYWORDS.get(cls)
    if keyword is None:
        params: Mapping[str, inspect.Parameter]
        try:
            params = inspect.signature(cls.forward).parameters  # follows deprecate_kwarg's __wrapped__
        except (TypeError, ValueError):
            params = {}
        keyword = _CACHE_KEYWORDS[cls] = "cache" if "cache" in params else "past_key_values"
    return keyword


def unfilled_cache_hint(model: torch.nn.Module, where: str) -> str:
    """Why a patched model's cache stays empty, for a failure message: usually the ``cache`` rename."""
    rename = (
        " transformers passes it as `cache=` since 5.24 (it was `past_key_values=`): a replacement forward that "
        "names only `past_key_values` receives it in **kwargs and skips the update. Accept `cache`, or both "
        "spellings (`cache = cache if cache is not None else past_key_values`); `modelpatch lint` names the class."
        if cache_keyword(model) == "cache" else
        " Pass the cache on (`past_key_values`) and call its `update(...)` as the original forward does."
    )  # fmt: skip
    return f"hint: the patched model's cache stayed empty {where} while the reference's was filled.{rename}"


def cache_hint_for(model: torch.nn.Module, comparisons: list[TensorComparison]) -> str:
    """:func:`unfilled_cache_hint` when a failure is a cache layer the patched model never wrote, else ``""``."""
    empty = [
        c.path for c in comparisons if c.problem and _CACHE_LEAF.match(c.path) and "patched is absent" in c.problem
    ]
    return unfilled_cache_hint(model, f"({', '.join(empty[:2])}{', ...' if len(empty) > 2 else ''})") if empty else ""


def implementations_line(reference: torch.nn.Module, patched: torch.nn.Module) -> str:
    """Each side's attention and experts implementation, when they differ (the patch marker's load choices).

    A composite model's towers are named where one is on another implementation than its model.
    """
    ours, theirs = implementations_of(reference), implementations_of(patched)
    shown = [
        (axis, describe_implementations(ours, axis), describe_implementations(theirs, axis))
        for axis, _, _ in IMPLEMENTATION_AXES
    ]
    sides = [f"{axis} {mine} (reference) vs {other} (patched)" for axis, mine, other in shown if mine != other]
    return f"implementations: {'; '.join(sides)}" if sides else ""
