"""first_divergence and assert_module_equivalent: naming the module that broke, replaying its real inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _support.runs import IN_ORDER
from conftest import Pair

from pytest_modelpatch.compare._engine.divergence import (
    assert_module_equivalent,
    first_divergence,
    record_module_calls,
)
from pytest_modelpatch.compare.forward.equivalence import assert_equivalent
from pytest_modelpatch.errors import ModelPatchError, PatchUsageError


def ids(batch: int = 2, length: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))}


def test_calls_are_recorded_in_the_order_they_finish(pair: Callable[..., Pair]) -> None:
    reference, _ = pair("llama_fused_qkv")
    names = [call.name for call in record_module_calls(reference, ids())]
    attention = names.index("model.layers.0.self_attn")
    assert names.index("model.layers.0.self_attn.o_proj") < attention < names.index("model.layers.0")
    assert "" not in names  # the root is the model output, compared by assert_equivalent


def test_noncausal_attention_is_named_even_though_its_o_proj_diverges_first(pair: Callable[..., Pair]) -> None:
    # o_proj finishes before self_attn and its output differs too, but its input already differed.
    found = first_divergence(*pair("llama_fused_qkv_noncausal"), ids())
    assert found is not None
    assert (found.name, found.reference_class, found.patched_class, found.inputs_agree) == (
        "model.layers.0.self_attn", "LlamaAttention", "LlamaFusedQKVNonCausalAttention", True,
    )  # fmt: skip
    assert found.output_differences[0].path == "output[0]"


def test_equivalent_patch_has_no_divergence(pair: Callable[..., Pair]) -> None:
    assert first_divergence(*pair("llama_fused_qkv"), ids(), policy="default") is None


def test_broad_bert_key_fails_at_the_replaced_container(pair: Callable[..., Pair]) -> None:
    with pytest.raises(AssertionError) as failure:
        assert_equivalent(*pair("bert_broad_attention"), ids())
    message = str(failure.value)
    assert "logits: shape (2, 12, 128) float32" in message
    assert "first diverging module: bert.encoder.layer.0.attention (BertAttention in the reference, " in message
    assert "BertSdpaSelfAttention in the patched model)" in message


def test_narrow_bert_key_is_equivalent(pair: Callable[..., Pair]) -> None:
    assert assert_equivalent(*pair("bert_broad_attention", mapping="NARROW_MAPPING"), ids()).passed


def test_module_check_by_name_replays_real_arguments(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    report = assert_module_equivalent(reference, patched, "model.layers.1.self_attn", inputs=ids())
    assert report.passed and report.calls == 1
    assert str(report).startswith(
        "model.layers.1.self_attn (LlamaFusedQKVAttention) matches model.layers.1.self_attn (LlamaAttention)"
    )


def test_module_check_fails_for_the_noncausal_attention(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv_noncausal")
    with pytest.raises(AssertionError) as failure:
        assert_module_equivalent(
            reference, patched, (reference.model.layers[1].self_attn, patched.model.layers[1].self_attn), inputs=ids()
        )
    message = str(failure.value)
    assert message.startswith("LlamaFusedQKVNonCausalAttention (LlamaFusedQKVNonCausalAttention) differs from")
    assert "arguments: hidden_states=tensor (2, 12, 64) float32, attention_mask=None" in message
    assert "output[0]: shape (2, 12, 64) float32: " in message


def test_module_check_catches_a_bug_the_model_outputs_hide(pair: Callable[..., Pair]) -> None:
    # One layer, last-position logits only (as generate() asks for): the last token attends to every
    # token with or without the causal mask, and k/v are computed before attention, so the outputs agree.
    reference, patched = pair("llama_fused_qkv_noncausal", num_hidden_layers=1)
    last_only = {**ids(), "logits_to_keep": 1}
    assert assert_equivalent(reference, patched, last_only).passed
    with pytest.raises(AssertionError, match="differs from model.layers.0.self_attn"):
        assert_module_equivalent(reference, patched, "model.layers.0.self_attn", inputs=last_only)


def test_module_check_replays_cache_state_as_the_original_saw_it(pair: Callable[..., Pair]) -> None:
    # The reference forward fills the cache; the replay must get a copy taken at call time.
    reference, patched = pair("llama_fused_qkv")
    report = assert_module_equivalent(
        reference, patched, "model.layers.0.self_attn", inputs={**ids(), "use_cache": True}
    )
    assert report.passed


def test_unknown_module_name_suggests_close_names(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    with pytest.raises(PatchUsageError, match=r"no submodule 'model.layer.0.self_attn'.*'model.layers.0.self_attn'"):
        assert_module_equivalent(reference, patched, "model.layer.0.self_attn")


def test_a_module_neither_named_nor_paired_is_a_usage_error(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    with pytest.raises(PatchUsageError, match=r"a qualified name in both models or a \(reference module, patched"):
        assert_module_equivalent(reference, patched, patched.model.layers[0].self_attn)  # type: ignore[arg-type]


def test_module_that_never_runs_is_reported(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    stray = torch.nn.Linear(2, 2)
    with pytest.raises(ModelPatchError, match="did not run in the reference forward"):
        assert_module_equivalent(reference, patched, (stray, stray), inputs=ids())


def test_a_field_one_implementation_never_produces_does_not_make_a_module_diverge(pytester: pytest.Pytester) -> None:
    # PaliGemma under sdpa vs eager in transformers 5.24 (docs/families.md, known differences): the sdpa side gets
    # no mask (left to sdpa's is_causal) and returns no attention weights; neither is what differs. Counted, they
    # made every shared module's inputs differ, and the line named o_proj with "no shared module diverges on
    # agreeing inputs"; the attention, whose inputs agree, is where the computed values part
    pytester.makepyfile(
        """
        import pytest
        from pytest_modelpatch import assert_equivalent


        @pytest.mark.model("paligemma")
        @pytest.mark.patch(attn_implementation="sdpa")
        def test_sdpa_matches_eager(reference_model, patched_model):
            assert_equivalent(reference_model, patched_model)
        """
    )
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E       first diverging module: language_model.layers.0.self_attn (GemmaAttention)",
        "E         its inputs agree; its output differs:",
        "E           output[[]0[]]: shape (2, 8, 64) float32: * elements over tolerance; max abs *",
        "E         held by one side only or in another form, so not compared (not what makes it diverge):",
        "E           attention_mask: reference is tensor (2, 1, 8, 8) float32, patched is None",
        "E           output[[]1[]]: reference is tensor (2, 4, 8, 8) float32, patched is None",
    ])  # fmt: skip
