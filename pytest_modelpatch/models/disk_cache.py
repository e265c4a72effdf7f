"""A checkpoint cache entry that proves it is whole before it is loaded.

Each entry gets a manifest (every file, its size and sha256) written last, so an
entry without one was never finished. ``verify_entry`` checks sizes and every
safetensors header on each use (microseconds for a tiny model); with
``--modelpatch-verify-cache`` it hashes every file too. Nothing here imports torch:
a safetensors header is 8 bytes of length and a JSON table of tensor offsets.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pytest_modelpatch.settings import SETTINGS

MANIFEST_FILE = "modelpatch-manifest.json"
STALE_PARTIAL_SECONDS = 3600.0  # another process's build of a different entry may still be running


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(entry: Path) -> None:
    """Record every file of a finished entry; written last, atomically."""
    files = {
        p.relative_to(entry).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(entry.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }
    scratch = entry / f".{MANIFEST_FILE}.tmp"
    scratch.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    os.replace(scratch, entry / MANIFEST_FILE)


def safetensors_header_problem(path: Path, size: int) -> str | None:
    """What is wrong with a safetensors file's header and extent, or ``None``."""
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return "shorter than a safetensors header"
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                return f"header claims {length} bytes, the file has {size}"
            header: dict[str, Any] = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        return f"unreadable safetensors header ({exc})"
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
    if 8 + length + max(ends, default=0) != size:
        return f"tensors end at byte {8 + length + max(ends, default=0)}, the file has {size} (truncated or padded)"
    return None


def verify_entry(entry: Path, *, full: bool | None = None) -> str | None:
    """What is wrong with a cache entry, naming the file, or ``None`` when it is whole.

    Example: ``verify_entry(path) is None`` before ``from_pretrained(path)``.
    """
    full = SETTINGS.full_verification if full is None else full
    manifest = entry / MANIFEST_FILE
    try:
        files: dict[str, dict[str, Any]] = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return f"{manifest} is missing: the entry was never finished"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest} is unreadable ({exc})"
    if "config.json" not in files or not any(name.endswith(".safetensors") for name in files):
        return f"{manifest} lists no config.json or no safetensors file: the save wrote no checkpoint"
    for name, expected in files.items():
        path = entry / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if size != expected["size"]:
            return f"{path} has {size} bytes, the manifest says {expected['size']}"
        if name.endswith(".safetensors"):
            problem = safetensors_header_problem(path, size)
            if problem is not None:
                return f"{path}: {problem}"
        if full and _sha256(path) != expected["sha256"]:
            return f"{path} does not match its sha256 in {MANIFEST_FILE} (bytes changed on disk)"
    return None


def discard_entry(entry: Path) -> None:
    """Remove a damaged entry: renamed aside first, so no reader sees it half deleted."""
    if not entry.exists():
        return
    aside = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}.damaged.partial")
    os.rename(entry, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_stale_partials(cache_dir: Path, key: str) -> None:
    """Drop build leftovers: this key's (the caller holds its lock) and any older than an hour."""
    now = time.time()
    for path in cache_dir.glob(".*.partial"):
        try:
            stale = path.name.startswith(f".{key}.") or now - path.stat().st_mtime > STALE_PARTIAL_SECONDS
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def entry_lock(cache_dir: Path, key: str) -> Iterator[None]:
    """One builder per entry across xdist workers and concurrent sessions."""
    from filelock import FileLock  # a dependency of huggingface_hub, so of transformers

    with FileLock(str(cache_dir / f".{key}.lock")):
        yield
