"""The main job: verify the example patches in fixtures/ on tiny models, on CPU.

Good patches must be equivalent to the original model and survive a checkpoint
round-trip bit for bit; broken ones are expected to be caught, so they are
``xfail(strict=True)``: the run stays green and still proves the detection.
"""

from __future__ import annotations

import pytest

from fixtures.patches import (
    bert_broad_attention,
    llama_fused_qkv,
    llama_fused_qkv_noncausal,
    llama_fused_qkv_tp,
    llama_nan_guard_mlp,
    llama_past_key_values_only,
    llama_rmsnorm_no_weight_grad,
    llama_stale_packed_mlp,
    llama_swiglu_autograd,
    mechanisms,
    qwen2_moe,
    qwen3_moe_router,
    training_transforms,
)
from pytest_modelpatch import (
    assert_decodes_equivalent,
    assert_equivalent,
    assert_exports_equivalent,
    assert_trains_equivalent,
)
from pytest_modelpatch.models import ModelRequest, patch_usage


def _verify(reference_model, patched_model) -> None:
    report = assert_equivalent(reference_model, patched_model)
    usage = patch_usage(patched_model)
    assert usage and all(u.instances and u.calls_in_last_forward == u.instances for u in usage), usage
    print(report, *usage, sep="\n")


@pytest.mark.model("llama")
@pytest.mark.patch(llama_fused_qkv.MAPPING, conversions=llama_fused_qkv.CONVERSIONS)
def test_fused_qkv_llama_is_equivalent_and_lossless(reference_model, patched_model, model_builder, roundtrip) -> None:
    _verify(reference_model, patched_model)
    print(roundtrip.check(model_builder.checkpoint(ModelRequest("llama"))))


@pytest.mark.model("qwen2_moe")
@pytest.mark.patch(qwen2_moe.MAPPING, conversions=qwen2_moe.CONVERSIONS, overwrite=True)
def test_qwen2_moe_module_list_experts_and_fused_qkv(reference_model, patched_model, model_builder, roundtrip) -> None:
    _verify(reference_model, patched_model)
    print(roundtrip.check(model_builder.checkpoint(ModelRequest("qwen2_moe"))))


@pytest.mark.model("qwen3_moe")
@pytest.mark.patch(qwen3_moe_router.MAPPING)
def test_qwen3_moe_replayable_router(reference_model, patched_model) -> None:
    _verify(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(
    llama_fused_qkv_tp.MAPPING, conversions=llama_fused_qkv_tp.CONVERSIONS, tp_plan=llama_fused_qkv_tp.TP_PLAN
)
@pytest.mark.parallel("tp")
def test_fused_qkv_llama_sharded_by_tensor_parallelism(reference_model, patched_model) -> None:
    _verify(reference_model, patched_model)


@pytest.mark.xfail(
    strict=True, reason="caught: packed_colwise shards the fused qkv_proj a second time under tensor parallelism"
)
@pytest.mark.model("llama")
@pytest.mark.patch(
    llama_fused_qkv_tp.MAPPING, conversions=llama_fused_qkv_tp.CONVERSIONS, tp_plan=llama_fused_qkv_tp.TP_PLAN_PACKED
)
@pytest.mark.parallel("tp")
def test_caught_fused_qkv_with_a_packed_plan_under_tensor_parallelism(reference_model, patched_model) -> None:
    _verify(reference_model, patched_model)


@pytest.mark.xfail(strict=True, reason="caught: eager attention with sdpa's None mask runs non-causal")
@pytest.mark.model("llama")
@pytest.mark.patch(llama_fused_qkv_noncausal.MAPPING, conversions=llama_fused_qkv_noncausal.CONVERSIONS)
def test_caught_noncausal_fused_attention(reference_model, patched_model) -> None:
    _verify(reference_model, patched_model)


@pytest.mark.xfail(strict=True, reason="caught: '.*Attention' also replaces the BertAttention container")
@pytest.mark.model("bert")
# the registration lint would refuse it (CONTAINER, WEIGHT_NAMES, UNUSED_ARGUMENT): allowed here so the equivalence check shows the damage
@pytest.mark.patch(
    bert_broad_attention.MAPPING,
    allow={".*Attention": ["CONTAINER", "NOT_A_MODULE", "WEIGHT_NAMES", "UNUSED_ARGUMENT"]},
)
def test_caught_broad_bert_attention_pattern(reference_model, patched_model) -> None:
    _verify(reference_model, patched_model)


@pytest.mark.model("bert")
@pytest.mark.patch(bert_broad_attention.NARROW_MAPPING)
def test_narrow_bert_self_attention_pattern(reference_model, patched_model) -> None:
    _verify(reference_model, patched_model)


FUSION = {"patch_embeddings": True}


@pytest.mark.model("qwen3_vl", fusion_config=FUSION)
def test_qwen3_vl_patch_embedding_fusion_is_equivalent_and_lossless(
    reference_model, patched_model, model_builder, roundtrip
) -> None:
    assert type(patched_model.visual.patch_embed).__name__.startswith("Fused")
    _verify(reference_model, patched_model)
    print(roundtrip.check(model_builder.checkpoint(ModelRequest("qwen3_vl")), fusion_config=FUSION))


@pytest.mark.xfail(
    strict=True, reason="caught: transformers (5.23, 5.24) fuses Qwen2-VL's patch embedding but loads it unconverted"
)
@pytest.mark.model("qwen2_vl", fusion_config=FUSION)
def test_caught_qwen2_vl_patch_embedding_fusion_loses_weights(reference_model, patched_model) -> None:
    _verify(reference_model, patched_model)


@pytest.mark.xfail(
    strict=True, reason="caught: the NaN guard branches on values, so the eager-correct MLP does not export"
)
@pytest.mark.model("llama")
@pytest.mark.patch(methods=llama_nan_guard_mlp.METHODS)
def test_caught_nan_guard_that_does_not_export(reference_model, patched_model) -> None:
    # eager it is bit for bit the same (tests/compare/test_export_compile.py); export must fail
    assert_exports_equivalent(reference_model, patched_model)


def _cache_renamed() -> bool:
    import inspect

    from transformers.models.llama.modeling_llama import LlamaAttention

    return "cache" in inspect.signature(LlamaAttention.forward).parameters


@pytest.mark.xfail(
    _cache_renamed(), strict=True, reason="caught: names past_key_values, which transformers 5.24 renamed to cache"
)
@pytest.mark.model("llama")
# the registration lint names the rename (UNUSED_ARGUMENT, a warning): allowed so decoding shows the damage
@pytest.mark.patch(llama_past_key_values_only.MAPPING, allow={"LlamaAttention": ["UNUSED_ARGUMENT"]})
def test_caught_attention_written_before_the_cache_rename(reference_model, patched_model) -> None:
    assert_decodes_equivalent(reference_model, patched_model)


# ---------------------------------------------------------------------------
# Implementations and transforms: the patched load only, the reference on transformers' eager code
# ---------------------------------------------------------------------------

mechanisms.register()


@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="fixture_sdpa")
def test_custom_attention_function(reference_model, patched_model) -> None:
    print(assert_equivalent(reference_model, patched_model))
    assert_decodes_equivalent(reference_model, patched_model)  # left-padded prompts: the registered mask matters


@pytest.mark.xfail(
    strict=True, reason="caught: the attention function was registered without its mask, so padding is attended to"
)
@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="fixture_sdpa_no_mask")
def test_caught_attention_function_without_its_mask(reference_model, patched_model) -> None:
    assert_decodes_equivalent(reference_model, patched_model)


@pytest.mark.xfail(strict=True, reason="caught: the attention function scales the softmax by 1.5x")
@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="fixture_wrong_scale")
def test_caught_attention_function_with_a_wrong_scale(reference_model, patched_model) -> None:
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("qwen3_moe")
@pytest.mark.patch(experts_implementation="batched_mm")
def test_batched_mm_experts(reference_model, patched_model) -> None:
    print(assert_equivalent(reference_model, patched_model))


@pytest.mark.xfail(strict=True, reason="caught: the experts function gives each token's weights to the wrong experts")
@pytest.mark.model("qwen3_moe")
@pytest.mark.patch(experts_implementation="fixture_swapped_weights")
def test_caught_experts_function_with_swapped_weights(reference_model, patched_model) -> None:
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.rmsnorm_instance_patcher)
def test_instance_patcher(reference_model, patched_model) -> None:
    print(assert_equivalent(reference_model, patched_model))
    assert_decodes_equivalent(reference_model, patched_model)


@pytest.mark.xfail(strict=True, reason="caught: the instance patcher's norm drops variance_epsilon")
@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.rmsnorm_instance_patcher_no_eps)
def test_caught_instance_patcher_without_epsilon(reference_model, patched_model) -> None:
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.zero_lora)
def test_peft_lora_at_initialisation(reference_model, patched_model) -> None:
    print(assert_equivalent(reference_model, patched_model))


@pytest.mark.xfail(strict=True, reason="caught: a trained (random) LoRA changes v_proj")
@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.random_lora)
def test_caught_random_lora(reference_model, patched_model) -> None:
    assert_equivalent(reference_model, patched_model)


# a norm kernel for Gemma, over every family whose model runs GemmaRMSNorm (towers included);
# Gemma's norm takes ``x`` and a ``dim``, the kernels ``hidden_size``: its layers pass both by position
GEMMA_NORM_ALLOW = {"^GemmaRMSNorm$": ["SIGNATURE"]}


@pytest.mark.model(families="patched")
@pytest.mark.patch({"^GemmaRMSNorm$": mechanisms.GemmaStyleNorm}, allow=GEMMA_NORM_ALLOW)
def test_gemma_norm_kernel_on_every_family_it_reaches(reference_model, patched_model) -> None:
    print(assert_equivalent(reference_model, patched_model))


@pytest.mark.xfail(
    strict=True, reason="caught: a Llama-style norm computes weight * x where Gemma computes (1 + weight) * x"
)
@pytest.mark.model(families="patched")
@pytest.mark.patch({"^GemmaRMSNorm$": mechanisms.LlamaStyleNorm}, allow=GEMMA_NORM_ALLOW)
def test_caught_llama_norm_kernel_on_the_gemma_families(reference_model, patched_model) -> None:
    assert_equivalent(reference_model, patched_model)


# Training over several optimizer steps: what only shows after an update, under accumulation or in a tie


@pytest.mark.model("llama")
@pytest.mark.dtypes("float32", "bfloat16")
@pytest.mark.patch(llama_swiglu_autograd.MAPPING)
def test_fused_mlp_trains_the_same(reference_model, patched_model, dtype) -> None:
    assert_trains_equivalent(reference_model, patched_model, steps=8)


@pytest.mark.xfail(
    strict=True, reason="caught: gate and up are packed once, at the first call, and go stale after the first update"
)
@pytest.mark.model("llama")
@pytest.mark.patch(llama_stale_packed_mlp.MAPPING)
def test_caught_stale_packed_weights(reference_model, patched_model) -> None:
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.xfail(strict=True, reason="caught: the loss ignores num_items_in_batch under gradient accumulation")
@pytest.mark.model("llama")
@pytest.mark.patch(transform=training_transforms.fused_cross_entropy_per_batch)
def test_caught_loss_ignoring_num_items_in_batch(reference_model, patched_model) -> None:
    assert_trains_equivalent(reference_model, patched_model, grad_accumulation=2)


@pytest.mark.xfail(strict=True, reason="caught: the norm's backward gives its weight no gradient, so it never trains")
@pytest.mark.model("llama")
@pytest.mark.patch(llama_rmsnorm_no_weight_grad.MAPPING)
def test_caught_norm_weight_that_never_trains(reference_model, patched_model) -> None:
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.xfail(strict=True, reason="caught: lm_head gets a copy of the embeddings it was tied to")
@pytest.mark.model("llama", tie_word_embeddings=True)
@pytest.mark.patch(transform=training_transforms.untie_lm_head)
def test_caught_untied_lm_head(reference_model, patched_model) -> None:
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.xfail(strict=True, reason="caught: a bf16 cross-entropy matches early and diverges as the loss falls")
@pytest.mark.model("llama")
@pytest.mark.dtypes("bfloat16")
@pytest.mark.patch(transform=training_transforms.fused_cross_entropy_bf16)
def test_caught_low_precision_cross_entropy_late(reference_model, patched_model, dtype) -> None:
    assert_trains_equivalent(reference_model, patched_model, steps=16, lr=1e-2)
