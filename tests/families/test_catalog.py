"""Tiny models of any family: configs, classes, seeded checkpoints, loading, specs, inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaAttention

from pytest_modelpatch.errors import CheckpointError, PatchUsageError
from pytest_modelpatch.families.catalog import implicit_rope_defaults, model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs, ordinary_token_ids
from pytest_modelpatch.isolation.guard import isolated_patch_state
from pytest_modelpatch.models.checkpoints import (
    BUILD_INFO_FILE,
    cached_checkpoint,
    load_pretrained,
    parse_dtype,
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


# -- tiny_config ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "kind"),
    [("llama", "multi-head"), ("mistral", "grouped"), ("qwen3_moe", "grouped"), ("mixtral", "grouped")],
)
def test_tiny_config_keeps_the_grouped_query_shape(model_type: str, kind: str) -> None:
    config = tiny_config(model_type)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    assert heads % kv == 0
    assert {"multi-head": kv == heads, "grouped": 1 < kv < heads}[kind]


def test_tiny_config_head_dim_follows_an_overridden_hidden_size() -> None:
    config = tiny_config("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=2)
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (128, 16, 2)
    gemma = tiny_config("gemma")  # default head_dim (256) is not hidden_size / heads
    assert gemma.head_dim * gemma.num_attention_heads == gemma.hidden_size


def test_tiny_config_keeps_one_layer_of_each_kind_and_sizes_layer_types_to_the_layer_count() -> None:
    config = tiny_config("gemma3_text")  # five sliding layers per full one by default
    assert config.num_hidden_layers == len(config.layer_types) == 2
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert len(tiny_config("gemma3_text", num_hidden_layers=5).layer_types) == 5


def test_tiny_config_shrinks_experts_and_keeps_top_k_below_them() -> None:
    config = tiny_config("qwen2_moe")
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert tiny_config("deepseek_v2").num_experts_per_tok == 2  # unset (None) by default, crashes the router


@pytest.mark.parametrize("model_type", ["qwen2_vl", "glm4v", "glm46v", "ernie4_5_vl_moe"])
def test_tiny_config_resizes_mrope_sections_to_the_tiny_head_dim(model_type: str) -> None:
    # Their defaults leave mrope_section out; the modeling code falls back to a list
    # sized for the full model ([16, 24, 24], [8, 12, 12], ...), read here from its source.
    text = tiny_config(model_type).text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2


def test_implicit_rope_defaults_are_read_from_the_modeling_source() -> None:
    assert implicit_rope_defaults("glm4v_text") == {"mrope_section": [8, 12, 12]}
    assert implicit_rope_defaults("llama") == {}
    assert implicit_rope_defaults("no-such-type") == {}


def test_tiny_config_moves_special_token_ids_into_the_tiny_vocabulary() -> None:
    config = tiny_config("qwen2_vl")
    vocab = config.text_config.vocab_size
    ids = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    assert all(0 <= i < vocab for i in ids) and len(set(ids)) == len(ids)


def test_tiny_config_fills_an_unset_head_dim_that_modeling_code_reads_without_fallback() -> None:
    config = tiny_config("ministral")  # head_dim defaults to None; MinistralAttention computes None ** -0.5
    assert config.head_dim == config.hidden_size // config.num_attention_heads


def test_tiny_config_renumbers_per_layer_overrides_of_the_kept_layers() -> None:
    fields = tiny_config("gemma4_text").to_dict()  # the default widens head_dim on layers "05", "11", ...
    assert fields["layer_types"] == ["sliding_attention", "full_attention"]
    assert fields["per_layer_config"] == {"1": {"head_dim": 2 * fields["head_dim"]}}


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("swinv2", "its default depths and heads per stage are tuples"),
        ("swin", "every stage's patch grid must hold a window"),
        ("maskformer", "its head reads all four Swin stages"),
        ("grounding-dino", "a detector whose forward also needs a text query"),
        ("rt_detr", "object queries are picked among the few anchors of a tiny image"),
        ("glm46v", "rope sections default in another family's modeling code"),
        ("siglip", "the text projection is sized by projection_size"),
        ("ernie4_5_moe", "top-k is moe_k"),
    ],
)
def test_hierarchical_vision_and_detection_families_build_tiny_and_run(model_type: str, why: str) -> None:
    config = tiny_config(model_type)
    cls = model_class_for(config)
    model = cls(config).eval()
    with torch.no_grad():
        outputs = model(**example_inputs(config, model_class=cls))
    assert outputs[0] is not None, why


def test_tiny_backbone_keeps_its_stages_and_their_names() -> None:
    backbone = tiny_config("maskformer").backbone_config
    assert len(backbone.depths) == 4 and max(backbone.depths) <= 2
    assert backbone.out_features == ["stage1", "stage2", "stage3", "stage4"]
    assert backbone.window_size == 2


def test_model_class_for_skips_a_head_that_takes_only_the_text_sub_config() -> None:
    assert model_class_for(tiny_config("qwen3_5")).__name__ == "Qwen3_5Model"


def test_tiny_config_merges_a_sub_config_override() -> None:
    config = tiny_config("llava", text_config={"num_hidden_layers": 3})
    assert config.text_config.num_hidden_layers == 3
    assert config.text_config.hidden_size == 64  # the rest stays shrunk


def test_tiny_config_reports_overrides_that_make_an_invalid_config() -> None:
    with pytest.raises(PatchUsageError, match=r"overrides \{'num_attention_heads': 3\} is not a valid LlamaConfig"):
        tiny_config("llama", num_attention_heads=3)  # 64 is not a multiple of 3


def test_tiny_config_is_deterministic() -> None:
    assert tiny_config("qwen3_moe").to_dict() == tiny_config("qwen3_moe").to_dict()


def test_unknown_model_type_names_close_matches_and_how_to_list_types() -> None:
    with pytest.raises(PatchUsageError, match=r"unknown model type 'lama'.*llama.*available_model_types"):
        tiny_config("lama")


# -- model classes, seeds, dtypes -------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "task", "expected"),
    [
        ("llama", None, "LlamaForCausalLM"),
        ("bert", None, "BertForMaskedLM"),
        ("vit", None, "ViTModel"),
        ("llama", "base", "LlamaModel"),
    ],
)
def test_model_class_for_prefers_masked_then_causal_lm_then_base(
    model_type: str, task: str | None, expected: str
) -> None:
    assert model_class_for(tiny_config(model_type), task).__name__ == expected


def test_model_class_for_rejects_an_unknown_task() -> None:
    with pytest.raises(PatchUsageError, match="unknown task 'lm'.*causal-lm"):
        model_class_for(tiny_config("llama"), "lm")


def test_seeded_model_is_reproducible_per_seed_and_leaves_the_global_rng_alone() -> None:
    config = tiny_config("llama")
    state = torch.random.get_rng_state()
    assert _same_weights(seeded_model(config, seed=3), seeded_model(config, seed=3))
    assert not _same_weights(seeded_model(config, seed=3), seeded_model(config, seed=4))
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp32", torch.float32), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16), ("torch.float16", torch.float16)],
)
def test_parse_dtype_accepts_names_and_aliases(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) is dtype and parse_dtype(dtype) is dtype


def test_parse_dtype_lists_valid_names() -> None:
    with pytest.raises(PatchUsageError, match="unknown dtype 'float8'.*bf16"):
        parse_dtype("float8")


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
        resolve_model_spec(spec)  # type: ignore[arg-type]


def test_resolve_model_spec_rejects_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(PatchUsageError, match="without config.json"):
        resolve_model_spec(tmp_path)


# -- inputs -------------------------------------------------------------------------


def test_example_inputs_stay_in_the_vocab_and_avoid_placeholder_tokens() -> None:
    config = tiny_config("llava")
    inputs = example_inputs(config, batch_size=4, seq_len=32)
    assert inputs["input_ids"].shape == (4, 32)
    assert int(inputs["input_ids"].max()) < config.text_config.vocab_size
    assert not (inputs["input_ids"] == config.image_token_id).any()
    assert config.image_token_id not in ordinary_token_ids(config).tolist()


def test_example_inputs_are_deterministic_per_seed() -> None:
    config = tiny_config("llama")
    assert torch.equal(example_inputs(config)["input_ids"], example_inputs(config)["input_ids"])
    assert not torch.equal(example_inputs(config)["input_ids"], example_inputs(config, seed=1)["input_ids"])


@pytest.mark.parametrize(
    ("model_type", "names"),
    [
        ("bert", {"input_ids", "attention_mask", "token_type_ids"}),
        ("t5", {"input_ids", "attention_mask", "decoder_input_ids"}),
        ("vit", {"pixel_values"}),
        ("clip", {"input_ids", "attention_mask", "pixel_values"}),
        ("whisper", {"input_ids", "attention_mask"}),
    ],
)
def test_example_inputs_cover_what_each_kind_of_model_takes(model_type: str, names: set[str]) -> None:
    assert set(example_inputs(tiny_config(model_type))) == names


def test_tiny_config_returns_a_config_of_the_family_class() -> None:
    config = tiny_config("llama")
    assert isinstance(config, LlamaConfig) and isinstance(config, PretrainedConfig)
