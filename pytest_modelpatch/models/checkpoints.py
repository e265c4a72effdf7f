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
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from pytest_modelpatch.errors import CheckpointError, PatchUsageError
from pytest_modelpatch.families.catalog import model_class_for
from pytest_modelpatch.isolation.pristine import pristine
from pytest_modelpatch.models.devices import to_torch_dtype
from pytest_modelpatch.models.disk_cache import (
    discard_entry,
    entry_lock,
    remove_stale_partials,
    verify_entry,
    write_manifest,
)
from pytest_modelpatch.models.quiet import quiet_loads
from pytest_modelpatch.models.weights import DEFAULT_INIT, INIT_SCHEMES, INIT_VERSION, spread_weights

BUILD_INFO_FILE = "modelpatch-build.json"


# ---------------------------------------------------------------------------
# building and caching
# ---------------------------------------------------------------------------


def seeded_model(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype | str = "float32",
    seed: int = 0,
    model_class: type[PreTrainedModel] | None = None,
    init: str = DEFAULT_INIT,
) -> PreTrainedModel:
    """A model built from ``config`` with ``torch.manual_seed(seed)``, in eval mode.

    ``init="modelpatch"`` (the default) then spreads the weights away from
    transformers' degenerate defaults (``models.weights``); ``init="transformers"``
    keeps them. Neither ``config`` (building fills in fields) nor the global RNG is changed.
    Example: ``seeded_model(tiny_config("llama"), dtype="bf16")``.
    """
    validate_init(init)
    cls = model_class or model_class_for(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(copy.deepcopy(config), dtype=to_torch_dtype(dtype))
    if init == "modelpatch":
        spread_weights(model, seed=seed)
    return model.eval()


def validate_init(init: object) -> str:
    """``init`` if it names a weight scheme; a ``PatchUsageError`` listing them otherwise."""
    if init not in INIT_SCHEMES:
        raise PatchUsageError(
            f"init={init!r} is not a weight scheme: use init='modelpatch' (the default: norm weights, biases and "
            "matrices spread away from transformers' defaults, see docs/equivalence.md) or init='transformers' "
            "(transformers' own init, norm weights 1 and biases 0)."
        )
    return str(init)


def _build_info(
    config: PretrainedConfig,
    dtype: torch.dtype | str,
    seed: int,
    model_class: type[PreTrainedModel],
    max_shard_size: int | str | None,
    init: str,
) -> dict[str, Any]:
    return {
        "config": _config_fields(config),
        "dtype": str(to_torch_dtype(dtype)).removeprefix("torch."),
        "seed": seed,
        # the scheme and its version: checkpoints cached before a scheme change are not reused
        "init": init,
        "init_version": INIT_VERSION,
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
    init: str = DEFAULT_INIT,
) -> Path:
    """The directory of a seeded checkpoint of ``config``, saved once into ``cache_dir``.

    Built without any registered patches or conversions, so it holds the original
    model's weights in the original format.

    Example: ``load_pretrained(cached_checkpoint(tiny_config("llama"), cache_dir=tmp), dtype="fp32")``.
    """
    cls = model_class or model_class_for(config)
    info = _build_info(config, dtype, seed, cls, max_shard_size, validate_init(init))
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
                _build_into(
                    final,
                    config,
                    info,
                    dtype=dtype,
                    seed=seed,
                    model_class=cls,
                    max_shard_size=max_shard_size,
                    init=init,
                )
                problem = verify_entry(final, full=True)
                if problem is not None:
                    raise CheckpointError(
                        f"the rebuilt checkpoint cache entry is damaged: {problem}; is the disk full?"
                    )
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
    init: str,
) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        with pristine():  # the checkpoint is the unpatched model's, whatever the test that first asks for it patched
            model = seeded_model(config, dtype=dtype, seed=seed, model_class=model_class, init=init)
            # under torch.distributed (a parallel test's rank) transformers saves on rank 0 only; this
            # whole, unsharded model is saved by whichever process builds the entry (transformers 5.24)
            model.should_save_on_this_rank = lambda is_main_process: True
            shard = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            with _quiet_progress_bars():
                model.save_pretrained(staging, **shard)
        (staging / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        write_manifest(staging)  # last: an entry without a manifest was never finished
        try:
            os.rename(staging, final)  # the caller holds the entry's lock, so this normally wins
        except OSError:
            if verify_entry(final) is not None:
                raise
            # a process that does not share the lock (another cache user) finished first: theirs is whole, drop ours
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


def validate_checkpoint_dir(path: Path | str) -> list[Path]:
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
            raise CheckpointError(
                f"corrupt safetensors file {file}: {exc}; delete it and rebuild the checkpoint"
            ) from exc
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
    return config_model_class(AutoConfig.from_pretrained(path))


def config_model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The class named first in ``config.architectures``, else ``model_class_for``: what a checkpoint of it loads as."""
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    return model_class_for(config)


MISSING_WEIGHTS_SEED = 0  # see load_pretrained


def auto_class_for(cls: type[PreTrainedModel]) -> Any:
    """The Auto class users load ``cls`` through (``AutoModelForCausalLM`` for ``LlamaForCausalLM``), else ``None``.

    Loading through it means a loader wrapper placed on the Auto class, as quantization
    libraries place theirs, applies to the patched model as it would for a user.
    """
    from transformers.models.auto import modeling_auto

    config_class = getattr(cls, "config_class", None)
    candidates: list[Any] = [  # transformers' Auto classes, read as Any as transformers is
        value for name, value in vars(modeling_auto).items()
        if name.startswith("AutoModel") and isinstance(value, type) and getattr(value, "_model_mapping", None) is not None
    ]  # fmt: skip
    # the most general Auto class first that maps this config to exactly this class
    for auto in sorted(candidates, key=lambda a: (a.__name__ != "AutoModel", a.__name__)):
        try:
            # ``in`` too: from_pretrained checks membership, which misses some families a lookup finds (Evolla)
            if auto._model_mapping[config_class] is cls and config_class in auto._model_mapping:
                return auto
        except (KeyError, TypeError, ValueError):
            continue
    return None


def load_pretrained(
    path: Path | str,
    *,
    dtype: torch.dtype | str = "float32",
    device: str | torch.device = "cpu",
    model_class: type[PreTrainedModel] | None = None,
    **from_pretrained_kwargs: Any,
) -> PreTrainedModel:
    """``from_pretrained`` of a local checkpoint through its Auto class, in eval mode, on ``device``.

    Registered patches and conversions apply, as they would for a user; so does a wrapper a
    library put on the Auto class or on the concrete class. ``dtype="auto"`` keeps the
    checkpoint's own dtype (a round-trip must save what it loaded).
    Example: ``load_pretrained(path, dtype="bf16", device="cuda")``.
    """
    files = validate_checkpoint_dir(path)
    cls = model_class or checkpoint_model_class(path)
    loader = auto_class_for(cls) or cls
    try:
        # Weights the checkpoint lacks (a patch that renames or drops parameters) are initialised
        # by from_pretrained from torch's global RNG: seed it, in a fork, so a broken patch reports
        # the same figures every run and the test's own RNG state is left as it was.
        with _quiet_progress_bars(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(MISSING_WEIGHTS_SEED)
            load_dtype = dtype if dtype == "auto" else to_torch_dtype(dtype)
            model = loader.from_pretrained(path, dtype=load_dtype, **from_pretrained_kwargs)
    except SafetensorError as exc:
        names = ", ".join(f.name for f in files)
        raise CheckpointError(f"reading the weights in {path} ({names}) failed: {exc}") from exc
    return model.to(device).eval()
