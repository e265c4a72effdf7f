"""The contract lint's static facts, cached on disk beside the scan index.

What the contract lint learns from transformers alone (the calls, ``forward``/``__init__``
parameters and ``_no_split_modules`` of a module's classes, read from its source; the names,
shapes and plans of a family's tiny original model) depends only on the installed
transformers, so it is kept in one JSON file keyed like the scan index (format, transformers
and torch versions, location) and a warm lint reads it instead of parsing sources and building
models. Only the replacement side is computed per run.

An entry that cannot be decoded is recomputed and overwritten, never trusted; a file of
another format or transformers version is ignored as a whole. Writers merge with what is on
disk and rename a private file into place (:func:`write_atomically`), so xdist workers can race.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pytest_modelpatch.lint.scan_index import (
    INDEX_FORMAT,
    _version,
    cache_dir,
    index_path,
    transformers_location,
    write_atomically,
)

FACTS_FORMAT = 6  # bump whenever what an entry records changes
T = TypeVar("T")
# a corrupt entry raises one of these while decoding: it is rebuilt, not trusted
DECODE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError)


def facts_path() -> Path:
    """The cache file for the installed transformers: the scan index's name, ``contract-facts`` instead."""
    index = index_path()
    return index.with_name(index.name.replace("scan-index", "contract-facts", 1))


class FactsCache:
    """Sections of JSON entries (``{section: {key: entry}}``), read once and written on :meth:`flush`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stamp = {"format": [INDEX_FORMAT, FACTS_FORMAT], "transformers": _version("transformers")}
        self.data = self._read()
        self.changed: dict[str, dict[str, Any]] = {}

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or any(data.get(k) != v for k, v in self.stamp.items()):
            return {}  # another transformers or format: stale as a whole
        sections = data.get("sections")
        return {k: v for k, v in sections.items() if isinstance(v, dict)} if isinstance(sections, dict) else {}

    def get(
        self, section: str, key: str, decode: Callable[[Any], T], compute: Callable[[], T], encode: Callable[[T], Any]
    ) -> T:
        """The decoded entry, or (missing or corrupt) ``compute()``, stored for the next run."""
        entry = self.data.get(section, {}).get(key)
        if entry is not None:
            try:
                return decode(entry)
            except DECODE_ERRORS:
                pass  # corrupt: fall through and rebuild it
        value = compute()
        self.put(section, key, encode(value))
        return value

    def lookup(self, section: str, key: str, decode: Callable[[Any], T]) -> T | None:
        """The decoded entry, or None when it is missing or corrupt."""
        entry = self.data.get(section, {}).get(key)
        if entry is None:
            return None
        try:
            return decode(entry)
        except DECODE_ERRORS:
            return None

    def put(self, section: str, key: str, entry: Any) -> None:
        """Store a JSON-ready entry; it reaches the disk on :meth:`flush`."""
        self.data.setdefault(section, {})[key] = entry
        self.changed.setdefault(section, {})[key] = entry

    def flush(self) -> None:
        """Write what changed, merged over what other processes wrote meanwhile."""
        if not self.changed:
            return
        merged = self._read()
        for section, entries in self.changed.items():
            merged.setdefault(section, {}).update(entries)
        try:
            write_atomically(self.path, {**self.stamp, "sections": merged})
        except OSError:
            return  # a read-only cache folder costs speed, not correctness
        self.changed = {}


_CACHES: dict[tuple[Path, str], FactsCache] = {}


def facts_cache() -> FactsCache:
    """This process's view of the facts file for the installed transformers."""
    # facts_path() reads package metadata (milliseconds); the cache folder and the transformers
    # location, which a process can change, are cheap to read and key the view instead
    key = (cache_dir(), transformers_location())
    if key not in _CACHES:
        _CACHES[key] = FactsCache(facts_path())
    return _CACHES[key]


def forget() -> None:
    """Drop the in-process view (tests and benchmarks: the next lint reads the file again)."""
    _CACHES.clear()
