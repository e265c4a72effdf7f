"""The scan index: every class ``apply_patches`` could swap, and what each one contains.

Built once per installed transformers (and torch) version, in a subprocess, and cached
on disk as JSON, so a lint loads it in milliseconds. Building imports nothing: it reads
transformers' and torch's sources as text (:mod:`pytest_modelpatch.lint.index_builder`).
Containment comes from the names
each module class's ``__init__`` (and what it calls) looks up in its module, the very
lookups ``apply_patches`` redirects; ``tests/lint/test_patterns.py`` checks the result
against module trees built on the meta device.

Cache location: ``$MODELPATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/pytest-modelpatch``,
else ``~/.cache/pytest-modelpatch``. Workers that race to build it each write a private
file and rename it into place, so readers never see half a file. The file is named for the
transformers and torch versions; it also lists every other package the build read or found
absent (accelerate, peft, kernels: ``is_<package>_available()`` arms), and one of them installed,
removed or upgraded since makes it stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import Any

from pytest_modelpatch.errors import ScanIndexError

INDEX_FORMAT = 4  # bump whenever the builder changes what it records
CORE = ""  # the family of modules outside transformers.models.*


@dataclass(frozen=True)
class ClassEntry:
    """One class that some scanned module binds at top level."""

    name: str
    module: str  # where it is defined
    family: str  # directory under transformers/models, or "" for the core
    is_module: bool  # an nn.Module subclass
    kind: str  # "module", "output" (ModelOutput), "config", "class"


@dataclass
class ScanIndex:
    """Classes, where each is bound (``modules``), and what module classes contain."""

    transformers_version: str
    classes: list[ClassEntry]
    # module name -> (family, {attribute name: class index})
    modules: dict[str, tuple[str, dict[str, int]]]
    # class index -> [(name looked up in its module, class index)]
    children: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    model_types: dict[str, str] = field(default_factory=dict)  # model_type -> family
    # every other top-level package the build read or probed: [distribution, version], or None when absent
    packages: dict[str, list[str] | None] = field(default_factory=dict)

    @property
    def families(self) -> set[str]:
        """Every family directory with at least one scanned module."""
        return {family for family, _ in self.modules.values() if family != CORE}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScanIndex:
        return cls(
            transformers_version=data["transformers"],
            classes=[ClassEntry(*row) for row in data["classes"]],
            modules={name: (family, names) for name, (family, names) in data["modules"].items()},
            children={int(k): [(a, c) for a, c in v] for k, v in data["children"].items()},
            model_types=data["model_types"],
            packages=data.get("packages", {}),
        )

    def to_json(self, torch_version: str) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "transformers": self.transformers_version,
            "torch": torch_version,
            "classes": [[c.name, c.module, c.family, c.is_module, c.kind] for c in self.classes],
            "modules": {name: [family, names] for name, (family, names) in self.modules.items()},
            "children": {str(k): [[a, c] for a, c in v] for k, v in self.children.items()},
            "model_types": self.model_types,
            "packages": self.packages,
        }


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def cache_dir() -> Path:
    """Where scan indexes are cached (``MODELPATCH_CACHE_DIR`` overrides)."""
    explicit = os.environ.get("MODELPATCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pytest-modelpatch"


def index_path() -> Path:
    """The cache file for the installed transformers and torch (versions and location)."""
    versions = f"{INDEX_FORMAT}|{_version('transformers')}|{_version('torch')}|{sys.version_info[:2]}"
    location = transformers_location()
    digest = hashlib.sha256(f"{versions}|{location}".encode()).hexdigest()[:16]
    return cache_dir() / f"scan-index-transformers-{_version('transformers')}-{digest}.json"


def transformers_location() -> str:
    """The installed ``transformers`` package folder, found without importing it ("" if absent)."""
    transformers = sys.modules.get("transformers")
    loaded_from = getattr(transformers, "__file__", None) if transformers is not None else None
    if loaded_from:
        return str(Path(loaded_from).parent)
    try:
        return str(metadata.distribution("transformers").locate_file("transformers"))
    except metadata.PackageNotFoundError:
        return ""


_LOADED: dict[Path, ScanIndex] = {}


def load_index(*, rebuild: bool = False) -> ScanIndex:
    """The scan index for the installed transformers, built (in a subprocess) if missing.

    Example::

        index = load_index()
        index.modules["transformers.models.bert.modeling_bert"][1]["BertAttention"]
    """
    path = index_path()
    if not rebuild and path in _LOADED:
        return _LOADED[path]
    data = None if rebuild else _read(path)
    if data is not None and changed_packages(data.get("packages", {})):
        data = None  # built beside other packages than those installed now
    if data is None:
        build_in_subprocess(path)
        data = _read(path)
        if data is None:
            raise ScanIndexError(f"the scan index at {path} was built but cannot be read; delete it and retry")
    index = ScanIndex.from_json(data)
    _LOADED[path] = index
    return index


def changed_packages(packages: dict[str, list[str] | None]) -> list[str]:
    """The packages of an index's ``packages`` that are installed differently now (added, removed, upgraded)."""
    changed = []
    for top, recorded in packages.items():
        if recorded is None or not recorded[0]:  # absent, or installed without distribution metadata
            now_present = util.find_spec(top) is not None  # a top-level name: found, not imported
            if now_present != (recorded is not None):
                changed.append(top)
        elif _version(recorded[0]) != recorded[1]:
            changed.append(top)
    return changed


def _read(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == INDEX_FORMAT else None


def build_in_subprocess(path: Path) -> None:
    """Build the index in a fresh interpreter so that the build's imports stay out of this one."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest_modelpatch.lint.index_builder", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ScanIndexError(
            f"building the scan index for transformers {_version('transformers')} failed "
            f"(exit {result.returncode}):\n{result.stderr[-3000:]}\n"
            f"Set MODELPATCH_CACHE_DIR to a writable folder if {path.parent} is not one."
        )


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to a private temporary file, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(data, out, separators=(",", ":"))
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
