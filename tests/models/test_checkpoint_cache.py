"""The tiny-checkpoint cache verifies every entry before use and heals or rejects a damaged one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pytest_modelpatch.errors import CheckpointError
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.models import checkpoints
from pytest_modelpatch.models.checkpoints import cached_checkpoint, load_pretrained
from pytest_modelpatch.models.disk_cache import MANIFEST_FILE, verify_entry


def _fresh(cache: Path) -> Path:
    checkpoints._SESSION_CHECKPOINTS.clear()  # a new session: the entry is only on disk
    return cached_checkpoint(tiny_config("llama"), cache_dir=cache)


def _weights(path: Path) -> Path:
    return next(path.glob("*.safetensors"))


def _flip_last_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.fixture
def entry(tmp_path: Path) -> Path:
    path = _fresh(tmp_path)
    assert verify_entry(path, full=True) is None
    return path


def test_flipped_weight_bytes_are_rebuilt_before_loading(entry: Path, tmp_path: Path) -> None:
    good = _weights(entry).read_bytes()
    _flip_last_byte(_weights(entry))
    assert "does not match its sha256" in verify_entry(entry, full=True)
    assert _fresh(tmp_path) == entry
    assert _weights(entry).read_bytes() == good


def test_nan_bytes_of_the_same_size_are_rebuilt_in_a_fresh_session_and_load_finite(entry: Path, tmp_path: Path) -> None:
    clean = {name: t.clone() for name, t in load_pretrained(entry).state_dict().items()}  # loads may map the file
    weights = _weights(entry)
    data = weights.read_bytes()
    weights.write_bytes(data[:-64] + b"\xff" * 64)  # same size, header intact: float32 NaNs in the last tensor
    assert verify_entry(entry) is None  # sizes and headers cannot see it
    assert "does not match its sha256" in verify_entry(entry, full=True)
    loaded = load_pretrained(_fresh(tmp_path)).state_dict()  # the first use of a session hashes, and heals
    assert all(bool(t.isfinite().all()) for t in loaded.values() if t.is_floating_point())
    assert all(torch.equal(loaded[name], clean[name]) for name in clean)


def test_flipped_bytes_within_a_session_are_caught_under_verify_cache(entry: Path, tmp_path: Path) -> None:
    from pytest_modelpatch.settings import configure_checks

    good = _weights(entry).read_bytes()
    _flip_last_byte(_weights(entry))
    previous = configure_checks(full_verification=True)  # as --modelpatch-verify-cache sets it
    try:
        cached_checkpoint(tiny_config("llama"), cache_dir=tmp_path)  # memoized this session, verified again
    finally:
        configure_checks(**previous)
    assert _weights(entry).read_bytes() == good


def test_truncated_shard_is_rebuilt(entry: Path, tmp_path: Path) -> None:
    weights = _weights(entry)
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    assert "bytes, the manifest says" in verify_entry(entry)
    assert _fresh(tmp_path) == entry
    assert weights.read_bytes() == good


def test_deleted_config_json_is_rebuilt(entry: Path, tmp_path: Path) -> None:
    (entry / "config.json").unlink()
    assert "config.json is missing" in verify_entry(entry)
    assert _fresh(tmp_path) == entry
    assert (entry / "config.json").is_file()


def test_an_unfinished_entry_and_stale_partials_are_removed(entry: Path, tmp_path: Path) -> None:
    (entry / MANIFEST_FILE).unlink()
    stale = tmp_path / f".{entry.name}.abc123.partial"
    stale.mkdir()
    assert "never finished" in verify_entry(entry)
    _fresh(tmp_path)
    assert verify_entry(entry) is None
    assert not stale.exists()


def test_damaged_header_is_caught_cheaply(entry: Path) -> None:
    weights = _weights(entry)
    data = bytearray(weights.read_bytes())
    data[0:8] = (len(data) * 2).to_bytes(8, "little")  # a header length beyond the file
    weights.write_bytes(bytes(data))
    assert "header claims" in verify_entry(entry, full=False)


def test_an_entry_that_cannot_be_rebuilt_raises_naming_the_file(entry: Path, tmp_path: Path) -> None:
    (entry / "config.json").unlink()
    os.chmod(tmp_path, 0o555)  # the cache became read-only: the damaged entry cannot be replaced
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(CheckpointError, match=r"cannot write the checkpoint cache in .*TMPDIR"):
            _fresh(tmp_path)
    finally:
        os.chmod(tmp_path, 0o755)


def test_manifest_lists_every_file_with_size_and_hash(entry: Path) -> None:
    files = json.loads((entry / MANIFEST_FILE).read_text())["files"]
    assert "config.json" in files and _weights(entry).name in files
    assert files["config.json"]["size"] == (entry / "config.json").stat().st_size
    assert len(files["config.json"]["sha256"]) == 64
