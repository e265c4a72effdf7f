"""Seeded tiny checkpoints on disk, and loading them the way users load models.

``cached_checkpoint`` saves a seeded model once (safetensors, ``save_pretrained``)
under a key that hashes everything that shaped the weights; ``load_pretrained``
goes through ``from_pretrained`` so patches and weight conversions run for real.
pytest-xdist workers share the cache: a file lock per entry lets one build it,
into a private ``.partial`` directory renamed into place with its manifest
written last; every use verifies the entry (``cache.py``) and a damaged one is
rebuilt, never loaded.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from pytest_modelpatch.models.devices import to_torch_dtype
from pytest_modelpatch.errors import CheckpointError, PatchUsageError
from pytest_modelpatch.models.families import (
    CONFIG_MAPPING_NAMES,
    model_class_for,
    tiny_config,
    unknown_model_type_message,
)
from pytest_modelpatch.isolation.guard import without_patches
from pytest_modelpatch.models.quiet import quiet_loads
from pytest_modelpatch.models.cache import discard_entry, entry_lock, remove_stale_partials, verify_entry, write_manifest

BUILD_INFO_FILE = "modelpatch-build.json"


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------

def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or a name such as ``"bf16"`` (the names ``devices.dtype_name`` knows).

    Example: ``parse_dtype("fp16") is torch.float16``.
    """
    return to_torch_dtype(value)


# ---------------------------------------------------------------------------
# building and caching
# ---------------------------------------------------------------------------


def seeded_model(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype | str = "float32",
    seed: int = 0,
    model_class: type[PreTrainedModel] | None = None,
) -> PreTrainedModel:
    """A model built from ``config`` with ``torch.manual_seed(seed)``, in eval mode.

    Neither ``config`` (building fills in fields) nor the global RNG is changed.
    Example: ``seeded_model(tiny_config("llama"), dtype="bf16")``.
    """
    cls = model_class or model_class_for(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(copy.deepcopy(config), dtype=parse_dtype(dtype))
    return model.eval()


def checkpoint_key(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype | str,
    seed: int,
    model_class: type[PreTrainedModel],
    max_shard_size: int | str | None = None,
) -> str:
    """The cache directory name for a seeded checkpoint: ``<model_type>-<sha256 prefix>``."""
    return f"{config.model_type}-{_key_hash(_build_info(config, dtype, seed, model_class, max_shard_size))}"


def _build_info(
    config: PretrainedConfig,
    dtype: torch.dtype | str,
    seed: int,
    model_class: type[PreTrainedModel],
    max_shard_size: int | str | None,
) -> dict[str, Any]:
    return {
        "config": _config_fields(config),
        "dtype": str(parse_dtype(dtype)).removeprefix("torch."),
        "seed": seed,
        "model_class": f"{model_class.__module__}.{model_class.__qualname__}",
        "max_shard_size": max_shard_size,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _config_fields(config: PretrainedConfig) -> dict[str, Any]:
    # ``dtype`` is filled in when a model is built from the config; the key has its own
    fields = json.loads(config.to_json_string(use_diff=False))
    for name in ("dtype", "torch_dtype"):
        fields.pop(name, None)
    return fields


def _key_hash(info: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:20]


# (resolved cache dir, key) -> checkpoint directory, for this process
_SESSION_CHECKPOINTS: dict[tuple[str, str], Path] = {}


def cached_checkpoint(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype | str = "float32",
    seed: int = 0,
    model_class: type[PreTrainedModel] | None = None,
    cache_dir: Path | str,
    max_shard_size: int | str | None = None,
) -> Path:
    """The directory of a seeded checkpoint of ``config``, saved once into ``cache_dir``.

    Built without any registered patches or conversions, so it holds the original
    model's weights in the original format.

    Example: ``load_pretrained(cached_checkpoint(tiny_config("llama"), cache_dir=tmp), dtype="fp32")``.
    """
    cls = model_class or model_class_for(config)
    info = _build_info(config, dtype, seed, cls, max_shard_size)
    key = f"{config.model_type}-{_key_hash(info)}"
    cache_dir = Path(cache_dir)
    memo = (str(cache_dir.resolve()), key)
    final = cache_dir / key
    if memo in _SESSION_CHECKPOINTS and verify_entry(final) is None:
        return _SESSION_CHECKPOINTS[memo]
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with entry_lock(cache_dir, key):
            remove_stale_partials(cache_dir, key)
            # first use in this process: hash every file (tiny models hash in milliseconds);
            # later uses check sizes and headers, or hash again under --modelpatch-verify-cache
            if verify_entry(final, full=True) is not None:
                discard_entry(final)  # damaged or unfinished: never loaded, rebuilt
                _build_into(final, config, info, dtype=dtype, seed=seed, model_class=cls, max_shard_size=max_shard_size)
                problem = verify_entry(final, full=True)
                if problem is not None:
                    raise CheckpointError(f"the rebuilt checkpoint cache entry is damaged: {problem}; is the disk full?")
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise CheckpointError(
            f"cannot write the checkpoint cache in {cache_dir}: {exc.strerror} ({exc.filename}). "
            "Point pytest at a writable temporary directory: --basetemp=PATH, or set TMPDIR."
        ) from exc
    _SESSION_CHECKPOINTS[memo] = final
    return final


def _build_into(
    final: Path,
    config: PretrainedConfig,
    info: dict[str, Any],
    *,
    dtype: torch.dtype | str,
    seed: int,
    model_class: type[PreTrainedModel],
    max_shard_size: int | str | None,
) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        with without_patches():
            model = seeded_model(config, dtype=dtype, seed=seed, model_class=model_class)
            shard = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            with _quiet_progress_bars():
                model.save_pretrained(staging, **shard)
        (staging / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        write_manifest(staging)  # last: an entry without a manifest was never finished
        os.rename(staging, final)  # the caller holds the entry's lock: nobody else renames into place
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """No progress bars or load reports from the plugin's own loads in test output (unless -v)."""
    with quiet_loads():
        yield


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------


def check_checkpoint_dir(path: Path | str) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory; ``CheckpointError`` if it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: save the model with model.save_pretrained({str(path)!r})")
    _read_json(path / "config.json", "save the model again with model.save_pretrained(path)")
    _check_shard_index(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        legacy = sorted(p.name for p in path.glob("*.bin"))
        found = f" (found {', '.join(legacy)})" if legacy else ""
        raise CheckpointError(
            f"{path} has no *.safetensors weights{found}: pytest-modelpatch loads safetensors only; "
            "re-save with model.save_pretrained(path), which writes safetensors by default"
        )
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"corrupt safetensors file {file}: {exc}; delete it and rebuild the checkpoint") from exc
    return weights


def _read_json(file: Path, fix: str) -> Any:
    """``file`` parsed, or ``CheckpointError`` naming it (transformers says only ``OSError``)."""
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}): {fix}") from exc


def _check_shard_index(path: Path) -> None:
    """Every shard a ``*.safetensors.index.json`` names exists (transformers: a raw FileNotFoundError)."""
    for index in path.glob("*.safetensors.index.json"):
        weight_map = _read_json(index, "re-save the sharded checkpoint").get("weight_map", {})
        missing = sorted({shard for shard in weight_map.values() if not (path / shard).is_file()})
        if missing:
            raise CheckpointError(
                f"{index} names shard(s) that are missing from {path}: {', '.join(missing)}. "
                "Copy the missing files, or re-save the model with model.save_pretrained(path)."
            )


def checkpoint_model_class(path: Path | str) -> type[PreTrainedModel]:
    """The class named first in ``config.json``'s ``architectures``, else ``model_class_for``."""
    config = AutoConfig.from_pretrained(path)
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    return model_class_for(config)


def load_pretrained(
    path: Path | str,
    *,
    dtype: torch.dtype | str = "float32",
    device: str | torch.device = "cpu",
    model_class: type[PreTrainedModel] | None = None,
    **from_pretrained_kwargs: Any,
) -> PreTrainedModel:
    """``from_pretrained`` of a local checkpoint, in eval mode, on ``device``.

    Registered patches and conversions apply, as they would for a user.
    Example: ``load_pretrained(path, dtype="bf16", device="cuda")``.
    """
    files = check_checkpoint_dir(path)
    cls = model_class or checkpoint_model_class(path)
    try:
        with _quiet_progress_bars():
            model = cls.from_pretrained(path, dtype=parse_dtype(dtype), **from_pretrained_kwargs)
    except SafetensorError as exc:
        names = ", ".join(f.name for f in files)
        raise CheckpointError(f"reading the weights in {path} ({names}) failed: {exc}") from exc
    return model.to(device).eval()


# ---------------------------------------------------------------------------
# model specs: what @pytest.mark.model(spec) names
# ---------------------------------------------------------------------------


@dataclass
class ModelSpec:
    """A resolved model spec: the config to build, and the checkpoint it came from if any."""

    config: PretrainedConfig
    source_dir: Path | None
    model_type: str
    label: str

    def __str__(self) -> str:
        where = f" from {self.source_dir}" if self.source_dir else " (tiny, seeded)"
        return f"{self.label}: {type(self.config).__name__}{where}"


def resolve_model_spec(spec: str | Path | PretrainedConfig, **config_overrides: Any) -> ModelSpec:
    """Resolve a model type, a config or a local checkpoint directory to a ``ModelSpec``.

    Example: ``resolve_model_spec("llama", num_hidden_layers=3).config.num_hidden_layers == 3``.
    """
    if isinstance(spec, PretrainedConfig):
        config = _with_overrides(spec, config_overrides)
        return ModelSpec(config, None, config.model_type, f"{config.model_type}-config")
    if not isinstance(spec, (str, os.PathLike)):
        raise PatchUsageError(
            "model spec must be a model type (e.g. 'llama'), a PretrainedConfig or a checkpoint directory, "
            f"not {type(spec).__name__}"
        )
    path = Path(spec)
    if (path / "config.json").is_file():
        config = _with_overrides(AutoConfig.from_pretrained(path), config_overrides)
        return ModelSpec(config, path, config.model_type, path.name or str(path))
    if isinstance(spec, str) and spec in CONFIG_MAPPING_NAMES:
        return ModelSpec(tiny_config(spec, **config_overrides), None, spec, spec)
    if path.is_dir():
        raise PatchUsageError(f"model spec {str(spec)!r} is a directory without config.json, not a checkpoint")
    if not isinstance(spec, str) or os.sep in spec or "/" in spec:
        raise PatchUsageError(f"model spec {str(spec)!r}: no such checkpoint directory")
    raise PatchUsageError(f"model spec: {unknown_model_type_message(spec)}")


def _with_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    """A copy of ``config`` with ``overrides``; dict values merge into sub-configs."""
    return type(config).from_dict(config.to_dict(), **overrides)
