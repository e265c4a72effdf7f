"""Seeded tiny checkpoints: built once per key, loaded as transformers loads them, their errors named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention

from pytest_modelpatch.errors import CheckpointError, PatchUsageError
from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.isolation.guard import isolated_patch_state
from pytest_modelpatch.models.checkpoints import (
    BUILD_INFO_FILE,
    cached_checkpoint,
    load_pretrained,
    seeded_model,
)
from pytest_modelpatch.models.specs import resolve_model_spec

DECODER_FAMILIES = [
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "gemma", "gemma2",
    "gemma3_text", "phi", "phi3", "phimoe", "gpt2", "gpt_neox", "gptj", "falcon", "olmo", "olmo2", "olmoe",
    "deepseek_v2", "deepseek_v3", "granite", "granitemoe", "starcoder2", "stablelm", "cohere", "bloom", "opt",
    "gpt_oss", "jamba", "mamba", "mamba2", "ministral", "nemotron", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "recurrent_gemma", "rwkv", "gemma4_text",
]  # fmt: skip
ENCODER_FAMILIES = ["bert", "roberta", "distilbert", "electra", "albert", "xlm-roberta", "deberta-v2", "modernbert"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("modelpatch-cache")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- every family: build, forward, save/load round trip ------------------------


@pytest.mark.parametrize("model_type", DECODER_FAMILIES + ENCODER_FAMILIES)
def test_family_builds_tiny_runs_forward_and_round_trips_its_cached_checkpoint(
    model_type: str, cache_dir: Path
) -> None:
    config = tiny_config(model_type)
    model = seeded_model(config)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    inputs = example_inputs(config, model_class=type(model))
    with torch.no_grad():
        expected = model(**inputs)

    path = cached_checkpoint(config, cache_dir=cache_dir)
    loaded = load_pretrained(path, dtype="float32")

    assert type(loaded) is type(model) and not loaded.training
    assert _same_weights(model, loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs)[0], expected[0], rtol=0, atol=0)


def test_seeded_model_is_reproducible_per_seed_and_leaves_the_global_rng_alone() -> None:
    config = tiny_config("llama")
    state = torch.random.get_rng_state()
    assert _same_weights(seeded_model(config, seed=3), seeded_model(config, seed=3))
    assert not _same_weights(seeded_model(config, seed=3), seeded_model(config, seed=4))
    assert torch.equal(torch.random.get_rng_state(), state)


# -- the on-disk cache ------------------------------------------------------------


def test_cached_checkpoint_builds_once_per_key(tmp_path: Path) -> None:
    config = tiny_config("llama")
    first = cached_checkpoint(config, cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_checkpoint(tiny_config("llama"), cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other_seed = cached_checkpoint(config, cache_dir=tmp_path, seed=1)
    bf16 = cached_checkpoint(config, cache_dir=tmp_path, dtype="bf16")
    assert len({first, other_seed, bf16}) == 3
    assert json.loads((bf16 / BUILD_INFO_FILE).read_text())["dtype"] == "bfloat16"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # no staging left behind


def test_cached_checkpoint_shards_when_asked(tmp_path: Path) -> None:
    path = cached_checkpoint(tiny_config("llama"), cache_dir=tmp_path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    assert _same_weights(load_pretrained(path, dtype="fp32"), seeded_model(tiny_config("llama")))


def test_load_pretrained_auto_dtype_keeps_the_checkpoints_own(tmp_path: Path) -> None:
    bf16 = cached_checkpoint(tiny_config("llama"), cache_dir=tmp_path, dtype="bf16")
    assert load_pretrained(bf16, dtype="auto").dtype == torch.bfloat16
    assert load_pretrained(bf16).dtype == torch.float32  # the default is float32, whatever was saved


def test_a_worker_that_loses_the_race_keeps_the_winners_checkpoint(tmp_path: Path) -> None:
    import pytest_modelpatch.models.checkpoints as checkpoints

    config = tiny_config("llama")
    winner = cached_checkpoint(config, cache_dir=tmp_path)
    stamp = (winner / "model.safetensors").stat().st_mtime_ns
    checkpoints._SESSION_CHECKPOINTS.clear()
    # another process finished first: this one builds its own copy, fails the rename and drops it
    info = json.loads((winner / BUILD_INFO_FILE).read_text())
    checkpoints._build_into(winner, config, info, dtype="float32", seed=0, model_class=model_class_for(config),
                            max_shard_size=None, init="modelpatch")  # fmt: skip
    assert (winner / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [winner.name]


class MarkedLlamaAttention(LlamaAttention):
    """A replacement with an extra parameter, visible in any checkpoint it is saved into."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.marker = torch.nn.Parameter(torch.zeros(1))


def test_cached_checkpoint_is_built_without_the_registered_patches(tmp_path: Path) -> None:
    from transformers.monkey_patching import get_patch_mapping, register_patch_mapping

    with isolated_patch_state():
        register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
        path = cached_checkpoint(tiny_config("llama"), cache_dir=tmp_path)
        assert "LlamaAttention" in get_patch_mapping()  # still registered afterwards
    assert not [key for key in load_file(path / "model.safetensors") if "marker" in key]


# -- loading errors ---------------------------------------------------------------


def test_load_pretrained_reports_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere", dtype="fp32")


def test_load_pretrained_reports_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no config.json.*save_pretrained"):
        load_pretrained(tmp_path, dtype="fp32")


def test_load_pretrained_refuses_pytorch_bin_weights_and_says_how_to_convert(tmp_path: Path) -> None:
    model = seeded_model(tiny_config("llama"))
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors.*pytorch_model\.bin.*save_pretrained"):
        load_pretrained(tmp_path, dtype="fp32")


@pytest.mark.parametrize("damage", ["truncated", "garbage header"])
def test_load_pretrained_names_a_corrupt_safetensors_file(tmp_path: Path, damage: str) -> None:
    seeded_model(tiny_config("llama")).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_pretrained(tmp_path, dtype="fp32")


# -- specs --------------------------------------------------------------------------


def test_resolve_model_spec_accepts_a_type_a_config_and_a_checkpoint(tmp_path: Path) -> None:
    by_type = resolve_model_spec("llama", num_hidden_layers=3)
    assert (by_type.model_type, by_type.label, by_type.source_dir) == ("llama", "llama", None)
    assert by_type.config.num_hidden_layers == 3

    by_config = resolve_model_spec(tiny_config("qwen2"), vocab_size=128)
    assert by_config.config.vocab_size == 128 and by_config.source_dir is None

    seeded_model(tiny_config("gpt2")).save_pretrained(tmp_path)
    by_dir = resolve_model_spec(str(tmp_path))
    assert by_dir.source_dir == tmp_path and by_dir.model_type == "gpt2"
    assert "from" in str(by_dir)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lama", "unknown model type 'lama'.*llama"),
        ("./no/such/dir", "no such checkpoint directory"),
        (42, "must be a model type.*not int"),
    ],
)
def test_resolve_model_spec_rejects_what_it_cannot_build(spec: object, message: str) -> None:
    with pytest.raises(PatchUsageError, match=message):
        resolve_model_spec(spec)


def test_resolve_model_spec_rejects_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(PatchUsageError, match="without config.json"):
        resolve_model_spec(tmp_path)
