"""Compare two safetensors checkpoints tensor for tensor, bit for bit, without loading either.

Both sides are read through ``safetensors.safe_open`` (memory-mapped), one tensor
at a time, grouped by the pair of shard files that hold it, so at most one shard
per side is mapped at once and two large checkpoints are never both in memory.
Shard boundaries may differ between the two sides: tensors are matched by name.

Example::

    diff = diff_checkpoints("ckpt/original", "ckpt/resaved")
    print(diff)  # 48/48 tensors identical, 2.1 MB compared
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pytest_modelpatch.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_BIT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHOWN = 20  # problem rows printed before "... and N more"


# ---------------------------------------------------------------------------
# Reading a checkpoint directory
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor lives and what its header says."""

    name: str
    file: Path
    dtype: str  # safetensors dtype code, e.g. "F32", "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * _itemsize(self.dtype)


@dataclass
class SafetensorsCheckpoint:
    """The safetensors files of one checkpoint directory and the tensors in them (headers only)."""

    directory: Path
    files: list[Path]
    tensors: dict[str, TensorEntry]
    file_metadata: dict[Path, dict[str, str]]
    index_metadata: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors.values())

    @property
    def largest_file_bytes(self) -> int:
        return max((path.stat().st_size for path in self.files), default=0)


def open_checkpoint(directory: str | Path) -> SafetensorsCheckpoint:
    """Read the headers of every safetensors file in ``directory``; raise CheckpointError naming a bad file.

    Example::

        ckpt = open_checkpoint(tmp_path / "model")
        ckpt.tensors["lm_head.weight"].shape
    """
    root = Path(directory)
    if not root.exists():
        raise CheckpointError(
            f"checkpoint directory {root} does not exist; pass a directory written by save_pretrained"
        )
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} is a file, not a directory; pass the directory that holds it")
    index_path = root / INDEX_NAME
    if index_path.exists():
        weight_map, index_metadata = _read_index(index_path)
        files = sorted({root / shard for shard in weight_map.values()})
    else:
        weight_map, index_metadata = None, None
        files = [root / SINGLE_NAME] if (root / SINGLE_NAME).exists() else sorted(root.glob("*.safetensors"))
    if not files:
        present = sorted(p.name for p in root.iterdir())
        hint = (
            " It holds pickled weights only: load the model and save it again with save_pretrained (transformers 5 writes safetensors)."
            if any(name.endswith(".bin") for name in present)
            else ""
        )
        raise CheckpointError(f"no .safetensors file in {root} (found: {', '.join(present) or 'nothing'}).{hint}")
    tensors: dict[str, TensorEntry] = {}
    file_metadata: dict[Path, dict[str, str]] = {}
    for path in files:
        file_metadata[path] = _read_header(path, tensors, index_path if weight_map else None)
    if weight_map is not None:
        _check_index_matches(index_path, weight_map, tensors, root)
    return SafetensorsCheckpoint(root, files, tensors, file_metadata, index_metadata)


def _read_index(index_path: Path) -> tuple[dict[str, str], dict[str, Any] | None]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index_path} is not a valid safetensors index ({exc}); save the checkpoint again"
        ) from exc
    missing = sorted({shard for shard in weight_map.values() if not (index_path.parent / shard).is_file()})
    if missing:
        example = next(name for name, shard in weight_map.items() if shard == missing[0])
        raise CheckpointError(
            f"{index_path} names shard {missing[0]!r} (e.g. for {example!r}), but {index_path.parent / missing[0]} "
            f"does not exist; copy the missing shard or save the checkpoint again"
        )
    metadata = index.get("metadata")
    return weight_map, metadata if isinstance(metadata, dict) else None


def _read_header(path: Path, tensors: dict[str, TensorEntry], index_path: Path | None) -> dict[str, str]:
    try:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in {tensors[name].file} and {path}")
                piece = handle.get_slice(name)
                tensors[name] = TensorEntry(name, path, piece.get_dtype(), tuple(piece.get_shape()))
            return dict(handle.metadata() or {})
    except SafetensorError as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}); it is truncated or corrupt, save the checkpoint again"
        ) from exc


def _check_index_matches(
    index_path: Path, weight_map: dict[str, str], tensors: dict[str, TensorEntry], root: Path
) -> None:
    for name, shard in weight_map.items():
        entry = tensors.get(name)
        if entry is None or entry.file != root / shard:
            where = "no shard" if entry is None else str(entry.file)
            raise CheckpointError(f"{index_path} places {name!r} in {root / shard}, but it is in {where}")
    extra = sorted(tensors.keys() - weight_map.keys())
    if extra:
        raise CheckpointError(f"{tensors[extra[0]].file} holds {extra[0]!r}, which {index_path} does not list")


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass
class TensorDiff:
    """How one tensor compares: ``status`` is identical, missing, unexpected, dtype, shape or bytes."""

    name: str
    status: str
    source: TensorEntry | None = None
    saved: TensorEntry | None = None
    differing_elements: int = 0
    elements: int = 0
    max_abs_diff: float | None = None

    @property
    def identical(self) -> bool:
        return self.status == "identical"

    def __str__(self) -> str:
        src, dst = self.source, self.saved
        if self.status == "missing":
            assert src is not None  # a missing tensor is one of the source's
            return f"{self.name}: missing from the saved checkpoint (source {src.dtype}{list(src.shape)} in {src.file.name})"
        if self.status == "unexpected":
            assert dst is not None  # an unexpected tensor is one of the saved checkpoint's
            return f"{self.name}: unexpected in the saved checkpoint ({dst.dtype}{list(dst.shape)} in {dst.file.name}), not in the source"
        if self.status == "shape":
            assert src is not None and dst is not None  # both sides have it: compared
            return f"{self.name}: shape {list(dst.shape)} saved, {list(src.shape)} in the source"
        values = ""
        if self.max_abs_diff is not None:
            values = (
                f"; {self.differing_elements}/{self.elements} elements differ, max abs diff {self.max_abs_diff:.3g}"
            )
        if self.status == "dtype":
            assert src is not None and dst is not None  # both sides have it: compared
            return f"{self.name}: dtype {dst.dtype} saved, {src.dtype} in the source{values}"
        if self.status == "bytes":
            return f"{self.name}: bytes differ{values}"
        return f"{self.name}: identical"


@dataclass
class CheckpointDiff:
    """Every tensor of two checkpoints compared, plus their safetensors metadata."""

    source: Path
    saved: Path
    tensors: list[TensorDiff] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)
    bytes_compared: int = 0

    @property
    def problems(self) -> list[TensorDiff]:
        return [row for row in self.tensors if not row.identical]

    @property
    def identical(self) -> bool:
        return not self.problems and not self.metadata

    @property
    def max_abs_diff(self) -> float | None:
        values = [row.max_abs_diff for row in self.tensors if row.max_abs_diff is not None]
        return max(values) if values else None

    def summary(self) -> str:
        compared = sum(1 for row in self.tensors if row.status != "unexpected")
        same = sum(1 for row in self.tensors if row.identical)
        extra = sum(1 for row in self.tensors if row.status == "unexpected")
        tail = f", {extra} unexpected" if extra else ""
        meta = f", {len(self.metadata)} metadata difference(s)" if self.metadata else ""
        return f"{same}/{compared} tensors identical{tail}{meta}, {format_bytes(self.bytes_compared)} compared"

    def __str__(self) -> str:
        lines = [self.summary()]
        problems = self.problems
        lines += [f"  {row}" for row in problems[:_SHOWN]]
        if len(problems) > _SHOWN:
            lines.append(f"  ... and {len(problems) - _SHOWN} more")
        lines += [f"  metadata: {line}" for line in self.metadata]
        return "\n".join(lines)


def format_bytes(count: int) -> str:
    """``2_100_000`` -> ``'2.1 MB'`` (decimal units, as file managers show them)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


# ---------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------


def diff_checkpoints(
    source: str | Path | SafetensorsCheckpoint, saved: str | Path | SafetensorsCheckpoint
) -> CheckpointDiff:
    """Compare ``saved`` against ``source``: names, dtypes, shapes, bytes, metadata, one tensor at a time.

    Example::

        assert diff_checkpoints(original_dir, resaved_dir).identical
    """
    src = source if isinstance(source, SafetensorsCheckpoint) else open_checkpoint(source)
    dst = saved if isinstance(saved, SafetensorsCheckpoint) else open_checkpoint(saved)
    result = CheckpointDiff(src.directory, dst.directory, metadata=_metadata_differences(src, dst))
    rows: dict[str, TensorDiff] = {}
    for name in src.tensors.keys() - dst.tensors.keys():
        rows[name] = TensorDiff(name, "missing", source=src.tensors[name])
    for name in dst.tensors.keys() - src.tensors.keys():
        rows[name] = TensorDiff(name, "unexpected", saved=dst.tensors[name])
    by_files: dict[tuple[Path, Path], list[str]] = defaultdict(list)
    for name in src.tensors.keys() & dst.tensors.keys():
        a, b = src.tensors[name], dst.tensors[name]
        if a.shape != b.shape:
            rows[name] = TensorDiff(name, "shape", a, b)
        else:
            by_files[(a.file, b.file)].append(name)
    for (file_a, file_b), names in sorted(by_files.items()):
        with safe_open(file_a, framework="pt") as handle_a, safe_open(file_b, framework="pt") as handle_b:
            for name in sorted(names):
                a, b = src.tensors[name], dst.tensors[name]
                rows[name] = compare_tensors(name, a, b, handle_a.get_tensor(name), handle_b.get_tensor(name))
                result.bytes_compared += a.nbytes
    result.tensors = [rows[name] for name in sorted(rows)]
    return result


def _widest_words(flat: torch.Tensor) -> torch.Tensor:
    """The bytes of ``flat`` as the widest integers that fit: equality on int64 runs faster than on uint8."""
    raw = flat.view(torch.uint8)
    for width, kind in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if raw.numel() % width == 0 and raw.storage_offset() % width == 0:
            return raw.view(kind)
    return raw


def compare_tensors(name: str, a: TensorEntry, b: TensorEntry, x: torch.Tensor, y: torch.Tensor) -> TensorDiff:
    """Bit-compare two same-shape tensors; on a difference, count differing elements and the max abs diff."""
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    if a.dtype == b.dtype and torch.equal(_widest_words(flat_x), _widest_words(flat_y)):
        return TensorDiff(name, "identical", a, b, elements=flat_x.numel())
    if a.dtype == b.dtype and x.element_size() in _BIT_VIEW:
        bits = _BIT_VIEW[x.element_size()]
        differ = flat_x.view(bits) != flat_y.view(bits)
    else:
        differ = flat_x.to(torch.float64) != flat_y.to(torch.float64)
    status = "bytes" if a.dtype == b.dtype else "dtype"
    count = int(differ.sum())
    max_abs = None
    if count and not (x.is_complex() or y.is_complex()):
        delta = flat_x[differ].to(torch.float64) - flat_y[differ].to(torch.float64)
        max_abs = float(delta.abs().max())
    elif not count:
        max_abs = 0.0
    return TensorDiff(name, status, a, b, count, flat_x.numel(), max_abs)


def _metadata_differences(src: SafetensorsCheckpoint, dst: SafetensorsCheckpoint) -> list[str]:
    found = []
    values_a, values_b = _metadata_values(src), _metadata_values(dst)
    for key in sorted(values_a.keys() | values_b.keys()):
        was, now = values_a.get(key), values_b.get(key)
        if was != now:
            found.append(f"safetensors header {key!r}: {_show(now)} saved, {_show(was)} in the source")
    if src.index_metadata is not None and dst.index_metadata is not None:
        for key in sorted(src.index_metadata.keys() & dst.index_metadata.keys()):
            if src.index_metadata[key] != dst.index_metadata[key]:
                found.append(
                    f"{INDEX_NAME} {key!r}: {dst.index_metadata[key]!r} saved, {src.index_metadata[key]!r} in the source"
                )
    return found


def _metadata_values(ckpt: SafetensorsCheckpoint) -> dict[str, set[str]]:
    values: dict[str, set[str]] = defaultdict(set)
    for metadata in ckpt.file_metadata.values():
        for key, value in metadata.items():
            values[key].add(value)
    return values


def _show(values: set[str] | None) -> str:
    return "absent" if values is None else " / ".join(repr(v) for v in sorted(values))


def _itemsize(dtype: str) -> int:
    # safetensors dtype codes carry their width: F32, BF16, I8, U64, F8_E4M3, BOOL
    if dtype == "BOOL":
        return 1
    digits = "".join(ch for ch in dtype.split("_")[0] if ch.isdigit())
    return max(int(digits) // 8, 1) if digits else 1
