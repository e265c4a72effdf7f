"""The session's in-memory reference models, least recently used released first (ini ``modelpatch_model_cache``).

Every distinct model spec a session asks for builds a reference model that used to stay in
memory until the session ended, so RSS grew with the number of specs. :class:`ModelCache`
keeps at most ``count`` models, or models whose parameters and buffers take at most
``max_bytes``; asking for a released one again rebuilds it from its on-disk checkpoint.
Nothing here imports torch: sizes are read from the models' own tensors.
"""

from __future__ import annotations

import gc
import re
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from pytest_modelpatch.errors import PatchUsageError

_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*$", re.I)


@dataclass(frozen=True)
class CacheBound:
    """At most ``count`` models, or at most ``max_bytes`` of their tensors; both ``None``: no bound."""

    count: int | None = None
    max_bytes: int | None = None

    def __str__(self) -> str:
        if self.count is not None:
            return f"{self.count} models"
        return f"{self.max_bytes / (1 << 20):g}MB" if self.max_bytes is not None else "unbounded"


def parse_model_cache(text: str) -> CacheBound:
    """``""`` (no bound), ``"8"`` (models) or ``"512MB"`` (also KB, GB, B) -> a :class:`CacheBound`."""
    text = str(text or "").strip()
    if not text:
        return CacheBound()
    if text.isdigit() and int(text) > 0:
        return CacheBound(count=int(text))
    match = _SIZE.match(text)
    if match is not None and float(match.group(1)) > 0:
        return CacheBound(max_bytes=int(float(match.group(1)) * _UNITS[match.group(2).upper()]))
    raise PatchUsageError(
        f"ini modelpatch_model_cache = {text!r}: expected a number of models (e.g. 8) or a size (e.g. 512MB, 2GB), "
        "greater than 0; leave it empty to keep every reference model for the session"
    )


def model_bytes(model: Any) -> int:
    """Bytes of a module's parameters and buffers (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.nbytes
    return total


class ModelCache:
    """An LRU map of built models under a :class:`CacheBound`; ``get`` marks a model as just used."""

    def __init__(self, bound: CacheBound | None = None) -> None:
        self.bound = bound or CacheBound()
        self._models: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.released = 0  # models let go because of the bound, for benchmarks and messages

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._models

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self._models.values())

    def get(self, key: Hashable) -> Any:
        entry = self._models.get(key)
        if entry is None:
            return None
        self._models.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, model: Any) -> None:
        """Keep ``model``; release the least recently used others until the bound holds (never ``model`` itself)."""
        self._models.pop(key, None)
        self._models[key] = (model, model_bytes(model) if self.bound.max_bytes is not None else 0)
        released = 0
        while len(self._models) > 1 and self._over():
            self._models.popitem(last=False)
            released += 1
        if released:
            self.released += released
            # transformers models hold reference cycles (modules <-> hooks): free their tensors now, not someday
            gc.collect()

    def discard(self, model: Any) -> None:
        """Let ``model`` go (compared by identity), wherever it is kept; nothing if it is not."""
        for key in [key for key, (kept, _) in self._models.items() if kept is model]:
            del self._models[key]

    def _over(self) -> bool:
        if self.bound.count is not None:
            return len(self._models) > self.bound.count
        if self.bound.max_bytes is not None:
            return self.total_bytes > self.bound.max_bytes
        return False
