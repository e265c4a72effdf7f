"""A round-trip loads as the fixtures load: a weight the patch drops is filled from the loader's seed, not the test's.

The patch here replaces ``LlamaMLP`` with ``LlamaOutProjMLP`` (``fixtures/patches/lossy.py``) and
registers no renaming: the checkpoint's ``down_proj`` is dropped and the model's ``out_proj`` is
missing, so ``from_pretrained`` initialises it from torch's global RNG. The fixtures' load seeds
that draw (``models.checkpoints.load_pretrained``); the round-trip must fill it the same way, or
its report would change with whatever the test, or the tests before it, drew.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fixtures.patches.lossy import LlamaOutProjMLP
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest
from pytest_modelpatch.roundtrip.check import assert_roundtrip

torch.set_num_threads(1)

DROPPING = {"LlamaMLP": LlamaOutProjMLP}  # no conversion: down_proj is dropped, out_proj is missing
ALLOW = {"LlamaMLP": ["WEIGHT_NAMES"]}  # the lint names the dropped weight; here it is the point
FILLED = "model.layers.0.mlp.out_proj.weight"
LLAMA = ModelRequest("llama")


def saved_dir(failure: pytest.ExceptionInfo[AssertionError]) -> Path:
    """The saved checkpoint a failed round-trip names in its report (``saved:  /path``)."""
    found = re.search(r"^\s+saved:\s+(\S+)$", str(failure.value), re.MULTILINE)
    assert found, str(failure.value)
    return Path(found.group(1))


@pytest.mark.parametrize("test_seed", [1, 2])
def test_a_dropped_weight_is_filled_as_the_patched_fixture_fills_it(
    patch_registry: Any, model_builder: ModelBuilder, tmp_path: Path, test_seed: int
) -> None:
    patch_registry.register(DROPPING, allow=ALLOW)
    patched = model_builder.patched(LLAMA)
    torch.manual_seed(test_seed)  # the test's own random state, different in each case
    state = torch.get_rng_state()
    with pytest.raises(AssertionError) as failure:
        assert_roundtrip(model_builder.checkpoint(LLAMA), tmp_path=tmp_path)
    message = str(failure.value)
    assert "model.layers.0.mlp.down_proj.weight: missing from the saved checkpoint" in message
    assert f"{FILLED}: unexpected in the saved checkpoint" in message
    # the patched load inside the round-trip saved the fill the fixtures' patched load made
    assert torch.equal(load_file(saved_dir(failure) / "model.safetensors")[FILLED], patched.state_dict()[FILLED])
    assert torch.equal(torch.get_rng_state(), state)  # and drew nothing from the test's generator


def test_a_dropped_weight_saved_in_the_patched_layout_is_the_fixtures_fill(
    patch_registry: Any, model_builder: ModelBuilder, tmp_path: Path
) -> None:
    patch_registry.register(DROPPING, allow=ALLOW)
    patched = model_builder.patched(LLAMA)
    torch.manual_seed(3)
    # saved and reloaded with the patch, the filled weight is now in the checkpoint: the round-trip holds
    report = assert_roundtrip(model_builder.checkpoint(LLAMA), tmp_path=tmp_path, save_original_format=False)
    assert report.passed and report.outputs
    saved = {
        name: tensor for file in sorted(report.saved.glob("*.safetensors")) for name, tensor in load_file(file).items()
    }
    assert torch.equal(saved[FILLED], patched.state_dict()[FILLED])


INNER = """
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.patches.lossy import LlamaOutProjMLP

FILLED = "model.layers.0.mlp.out_proj.weight"


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": LlamaOutProjMLP}, allow={"LlamaMLP": ["WEIGHT_NAMES"]})
@pytest.mark.parametrize("draws", [0, 1000])
def test_dropped_weight(patched_model, roundtrip, draws):
    torch.rand(draws)  # what ran before this test moved torch's random state
    with pytest.raises(AssertionError) as failure:
        roundtrip.check(patched_model.config.name_or_path)
    message = str(failure.value)
    saved = Path(re.search(r"saved:\\s+(\\S+)", message).group(1))
    filled = load_file(saved / "model.safetensors")[FILLED]
    assert torch.equal(filled, patched_model.state_dict()[FILLED])
    outputs = re.search(r"outputs differ \\(max abs diff (\\S+)\\)", message).group(1)
    digest = hashlib.sha256(filled.numpy().tobytes()).hexdigest()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(os.environ["RESULTS"], f"{draws}-{worker}.json").write_text(json.dumps([digest, outputs]))
"""


@pytest.mark.tests_ordering  # keeps pytest-randomly in the runs that ask for it
def test_a_dropped_weight_is_filled_the_same_in_every_run_under_xdist_and_randomly(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_dropped=INNER)
    runs = {
        "plain": ("-p", "no:randomly"),
        "xdist-2, randomly seed 1": ("-n", "2", "-p", "randomly", "--randomly-seed=1"),
        "randomly seed 2": ("-p", "randomly", "--randomly-seed=2"),
    }
    found: dict[str, set[str]] = {}
    for label, args in runs.items():
        results = pytester.mkdir(f"results-{len(found)}")
        monkeypatch.setenv("RESULTS", str(results))
        result = pytester.runpytest(*args)
        result.assert_outcomes(passed=2)
        found[label] = {path.read_text() for path in results.glob("*.json")}
        assert len(list(results.glob("*.json"))) == 2, label
    # both tests of every run saved one fill and saw one output difference
    assert len(set().union(*found.values())) == 1, found
