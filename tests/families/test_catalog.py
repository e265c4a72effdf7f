"""The catalog of tiny families: configs, model classes, example inputs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.catalog import implicit_rope_defaults, model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs, ordinary_token_ids

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


# -- model classes -------------------------------------------------


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
