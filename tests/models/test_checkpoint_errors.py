"""Bad checkpoints and markers fail with an error naming the file or test and saying how to fix it;
the plugin's own loads stay quiet unless -v."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_modelpatch.errors import CheckpointError
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.models.checkpoints import load_pretrained, seeded_model


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    seeded_model(tiny_config("llama")).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    return tmp_path


def test_an_index_naming_a_missing_shard_names_it(sharded: Path) -> None:
    shard = sorted(sharded.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors.index.json names shard\(s\) .*{shard.name}.*save_pretrained"
    ):
        load_pretrained(sharded)


def test_a_config_json_that_is_not_json_names_the_file(sharded: Path) -> None:
    (sharded / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON .*save_pretrained"):
        load_pretrained(sharded)


def test_a_sound_sharded_checkpoint_still_loads(sharded: Path) -> None:
    json.loads((sharded / "model.safetensors.index.json").read_text())
    assert load_pretrained(sharded).config.model_type == "llama"


def test_an_unknown_dtype_in_the_marker_names_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest


@pytest.mark.dtypes("float8_e4m3fn")
def test_fp8(dtype):
    pass
"""
    )
    result = pytester.runpytest()
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*@pytest.mark.dtypes('float8_e4m3fn',) on *test_fp8: unknown dtype 'float8_e4m3fn'*"])


LOAD_WITH_A_REPORT = """
import torch
from safetensors.torch import load_file, save_file
from pytest_modelpatch.models.checkpoints import load_pretrained, seeded_model
from pytest_modelpatch.families.catalog import tiny_config


def test_load(tmp_path):
    seeded_model(tiny_config("llama")).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["unexpected.weight"] = torch.zeros(2)  # transformers prints a LOAD REPORT for this key
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_pretrained(tmp_path)
"""


@pytest.mark.parametrize(("args", "shown"), [((), False), (("-v",), True)], ids=["quiet", "verbose"])
def test_internal_loads_are_quiet_unless_verbose(pytester: pytest.Pytester, args: tuple[str, ...], shown: bool) -> None:
    pytester.makepyfile(LOAD_WITH_A_REPORT)
    result = pytester.runpytest("-s", *args)
    result.assert_outcomes(passed=1)
    output = result.stdout.str() + result.stderr.str()
    assert ("LOAD REPORT" in output) is shown
