"""Tiny configs and inputs of hybrid, MoE and composite (VLM, Q-Former, omni) text families."""

from __future__ import annotations

import pytest
import torch

from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.families.shrink.consistency import fit_feature_layers
from pytest_modelpatch.families.shrink.sizes import TINY_HEADS, TINY_INTERMEDIATE, TINY_VOCAB, TINY_WIDTH
from pytest_modelpatch.models.checkpoints import seeded_model


def _forward(model_type: str) -> tuple[object, dict[str, torch.Tensor]]:
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config))
    inputs = example_inputs(config, model_class=type(model))
    with torch.no_grad():
        return model(**inputs), inputs


# ---------------------------------------------------------------------------
# generic shrink rules
# ---------------------------------------------------------------------------


def test_sizes_a_config_derives_itself_are_derived_again_from_the_shrunk_sizes() -> None:
    bamba = tiny_config("bamba")  # mamba_d_head = expand * hidden_size // mamba_n_heads, in __post_init__
    assert bamba.mamba_d_head * bamba.mamba_n_heads == bamba.mamba_expand * bamba.hidden_size
    zamba = tiny_config("zamba")  # attention_hidden_size = 2 * hidden_size: the width rule alone halves it
    assert zamba.attention_hidden_size == 2 * zamba.hidden_size == 2 * TINY_WIDTH
    xlnet = tiny_config("xlnet")
    assert xlnet.d_head == xlnet.d_model // xlnet.n_head


def test_an_overridden_derived_size_is_kept() -> None:
    assert tiny_config("zamba", attention_hidden_size=256).attention_hidden_size == 256


def test_every_kind_of_every_layer_type_list_survives_the_shrink() -> None:
    # Kimi's mlp_layer_types comes first in the dict; layer_types (one full layer in four) must still decide
    config = tiny_config("kimi_linear")
    assert {"full_attention", "linear_attention"} <= set(config.layer_types)
    assert {"dense", "sparse"} <= set(config.mlp_layer_types)
    assert len(config.layer_types) == len(config.mlp_layer_types) == config.num_hidden_layers


def test_vision_feature_layers_index_the_shrunk_vision_tower() -> None:
    config = tiny_config("molmo2")  # [24, 18] of a 27-layer ViT by default
    layers = config.adapter_config.vision_feature_layer
    assert all(-config.vision_config.num_hidden_layers <= i < config.vision_config.num_hidden_layers for i in layers)
    assert len(set(layers)) == len(layers)


def test_feature_layer_indices_keep_their_order_and_negative_ones_are_left_alone() -> None:
    tree = {"vision_config": {"num_hidden_layers": 3}, "vision_feature_layer": [24, 18, 30], "other": {"x": 1}}
    fit_feature_layers(tree)
    assert tree["vision_feature_layer"] == [1, 0, 2]
    tree = {"vision_config": {"num_hidden_layers": 2}, "adapter_config": {"vision_feature_layer": -2}}
    fit_feature_layers(tree)
    assert tree["adapter_config"]["vision_feature_layer"] == -2


def test_per_layer_overrides_are_shrunk_like_the_config() -> None:
    text = tiny_config("dots3_note").text_config  # indexed layers override heads (64) and lora ranks (1024)
    for kind in set(text.layer_types):
        layer = text.per_layer_config[kind]
        assert layer.num_attention_heads <= TINY_HEADS
        assert layer.num_key_value_heads == layer.num_attention_heads


def test_side_vocabularies_and_per_layer_feed_forward_lists_are_shrunk() -> None:
    assert tiny_config("luke").entity_vocab_size <= TINY_VOCAB  # 500k entity rows
    fsmt = tiny_config("fsmt")
    assert fsmt.src_vocab_size <= TINY_VOCAB and fsmt.tgt_vocab_size <= TINY_VOCAB
    assert max(tiny_config("gemma3n_text").intermediate_size) <= TINY_INTERMEDIATE


def test_an_image_patch_id_is_a_token_id_moved_into_the_tiny_vocabulary() -> None:
    config = tiny_config("molmo2")
    assert config.image_token_id < config.text_config.vocab_size


def test_model_class_for_finds_a_family_the_lazy_mapping_does_not_contain() -> None:
    assert model_class_for(tiny_config("evolla")).__name__ == "EvollaModel"


# ---------------------------------------------------------------------------
# per-family rules: the families build tiny and run
# ---------------------------------------------------------------------------

RULED_FAMILIES = [
    "bamba", "granitemoehybrid", "zamba", "zamba2", "xlstm", "gemma3n_text", "dbrx", "dots1", "lfm2_moe",
    "esm", "reformer", "chameleon", "emu3", "blt", "cohere_compass_text", "qwen4_exp_text", "hrm_text",
]  # fmt: skip


@pytest.mark.parametrize("model_type", RULED_FAMILIES)
def test_hybrid_moe_and_older_text_families_build_tiny_and_run(model_type: str) -> None:
    outputs, _ = _forward(model_type)
    logits = getattr(outputs, "logits", None)
    hidden = logits if logits is not None else outputs[0]
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize(
    "model_type", ["dots3_note", "qwen3_omni_moe_thinker", "deepseek_ocr2", "florence2", "janus", "muse_spark"]
)
def test_composite_towers_stay_under_the_parameter_budget(model_type: str) -> None:
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config))
    assert sum(p.numel() for p in model.parameters()) <= 5_000_000


# ---------------------------------------------------------------------------
# composite inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["blip-2", "instructblip", "instructblipvideo"])
def test_q_former_placeholders_are_filled_from_the_image(model_type: str) -> None:
    config = tiny_config(model_type)
    inputs = example_inputs(config, model_class=model_class_for(config))
    placeholder = config.video_token_id if "video" in model_type else config.image_token_id
    frames = inputs["pixel_values"].shape[1] if inputs["pixel_values"].dim() == 5 else 1
    assert (inputs["input_ids"] == placeholder).sum(dim=1).tolist() == [config.num_query_tokens * frames] * 2
    _forward(model_type)


def test_kosmos2_marks_one_position_per_latent_query() -> None:
    _, inputs = _forward("kosmos-2")
    assert inputs["image_embeds_position_mask"].sum(dim=1).tolist() == [tiny_config("kosmos-2").latent_query_num] * 2


def test_molmo2_has_one_placeholder_per_pooled_image_token() -> None:
    _, inputs = _forward("molmo2")
    placeholders = int((inputs["input_ids"] == tiny_config("molmo2").image_token_id).sum())
    assert placeholders == inputs["image_token_pooling"].shape[0]


@pytest.mark.parametrize(
    ("model_type", "side_input"),
    [
        ("lxmert", "visual_feats"), ("xmod", "lang_ids"), ("idefics", "image_attention_mask"),
        ("blip_2_qformer", "encoder_hidden_states"), ("evolla", "protein_input_ids"), ("pi0", "action_embeds"),
        ("muse_glimmer_assistant", "context_hidden_states"), ("canine", "input_ids"),
    ],
)  # fmt: skip
def test_composite_forwards_get_the_side_inputs_they_need(model_type: str, side_input: str) -> None:
    _, inputs = _forward(model_type)
    assert side_input in inputs


def test_canine_reads_printable_code_points() -> None:
    ids = example_inputs(tiny_config("canine"))["input_ids"]
    assert 32 <= int(ids.min()) and int(ids.max()) < 127


@pytest.mark.parametrize("model_type", ["cohere2_vision", "janus", "blip-2", "molmo2", "kosmos-2", "idefics", "pi0"])
def test_the_image_reaches_the_compared_outputs(model_type: str) -> None:
    # inputs are meaningful only if the vision tower is in the forward: another image, other outputs
    config = tiny_config(model_type)
    model = seeded_model(config, model_class=model_class_for(config))
    inputs = example_inputs(config, model_class=type(model))
    other = {**inputs, "pixel_values": torch.randn_like(inputs["pixel_values"])}
    with torch.no_grad():
        first, second = model(**inputs)[0], model(**other)[0]
    assert not torch.allclose(first, second)
