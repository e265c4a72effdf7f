"""assert_equivalent: every output tensor compared, a report a person can act on, the first diverging module."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import Pair, cache_field
from transformers.modeling_outputs import CausalLMOutputWithPast

from pytest_modelpatch.compare._engine.outputs import compare_outputs, flatten_outputs
from pytest_modelpatch.compare._engine.tolerance import (
    DtypeTolerance,
    TolerancePolicy,
    resolve_tolerance,
)
from pytest_modelpatch.compare.forward.equivalence import assert_equivalent
from pytest_modelpatch.reporting.records import CheckRecord


def ids(batch: int = 2, length: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))}


def test_fused_qkv_patch_passes_and_returns_the_report(pair: Callable[..., Pair]) -> None:
    report = assert_equivalent(*pair("llama_fused_qkv"), ids())
    assert report.passed
    paths = [c.path for c in report.comparisons]
    assert paths[0] == "logits"
    assert f"{cache_field()}.layers[1].values" in paths
    assert str(report).startswith("patched LlamaForCausalLM matches reference LlamaForCausalLM (float32 on cpu)")


def test_noncausal_attention_fails_with_output_stats_and_first_diverging_module(pair: Callable[..., Pair]) -> None:
    with pytest.raises(AssertionError) as failure:
        assert_equivalent(*pair("llama_fused_qkv_noncausal"), ids())
    message = str(failure.value)
    assert "differs from reference LlamaForCausalLM (float32 on cpu)" in message
    assert "  logits: shape (2, 12, 128) float32: " in message
    assert "elements over tolerance; max abs 4.63" in message
    assert "worst at [" in message and "reference " in message and "patched " in message
    assert (
        "first diverging module: model.layers.0.self_attn "
        "(LlamaAttention in the reference, LlamaFusedQKVNonCausalAttention in the patched model)\n"
        "  its inputs agree; its output differs:"
    ) in message


def test_noncausal_bug_hides_under_eager_attention(pair: Callable[..., Pair]) -> None:
    # With eager, transformers builds a causal mask itself, so the patch is correct there.
    assert assert_equivalent(*pair("llama_fused_qkv_noncausal", attn_implementation="eager"), ids()).passed


def test_default_inputs_are_drawn_from_the_config(pair: Callable[..., Pair]) -> None:
    report = assert_equivalent(*pair("llama_fused_qkv"))
    assert report.inputs.startswith("input_ids=[[")
    assert "attention_mask=" in report.inputs


def test_training_flags_are_restored_after_the_check(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    reference.train()
    assert_equivalent(reference, patched, ids())
    assert reference.training and all(m.training for m in reference.modules())
    assert not patched.training


def test_bf16_harmless_kernel_change_passes_only_with_the_ulp_term(pair: Callable[..., Pair]) -> None:
    # sdpa vs eager attention, same weights: different op order, ~1 bf16 ulp apart.
    reference, _ = pair("llama_fused_qkv", dtype="bfloat16")
    _, eager = pair("llama_fused_qkv", dtype="bfloat16", attn_implementation="eager")
    assert assert_equivalent(reference, eager, ids()).passed
    torch_defaults = TolerancePolicy("torch", {"bfloat16": DtypeTolerance(atol=1e-5, rtol=1.6e-2, ulps=0)})
    with pytest.raises(AssertionError, match="logits: shape .* bfloat16: [0-9]+/3072 elements over tolerance"):
        assert_equivalent(reference, eager, ids(), policy=torch_defaults)


def test_explicit_tolerance_argument_wins(pair: Callable[..., Pair]) -> None:
    report = assert_equivalent(*pair("llama_fused_qkv_noncausal"), ids(), atol=10.0)
    assert report.passed
    assert "atol=10 (argument)" in str(report.comparisons[0].tolerance)


def test_every_output_tensor_gets_a_readable_path(pair: Callable[..., Pair]) -> None:
    reference, _ = pair("llama_fused_qkv")
    with torch.no_grad():
        output = reference(**ids(), output_hidden_states=True)
    paths = [path for path, _ in flatten_outputs(output)]
    assert paths[:2] == ["loss", "logits"]
    assert "hidden_states[2]" in paths
    assert f"{cache_field()}.layers[0].keys" in paths


def test_none_versus_tensor_and_missing_fields_are_mismatches() -> None:
    logits = torch.ones(1, 2, 4)
    reference = CausalLMOutputWithPast(logits=logits, hidden_states=None)
    patched = CausalLMOutputWithPast(logits=logits, hidden_states=(logits,))
    failures = [c for c in compare_outputs(reference, patched, resolve_tolerance()) if not c.passed]
    assert [str(c) for c in failures] == [
        "hidden_states: reference is None, patched is tensor (1, 2, 4) float32 (at hidden_states[0])"
    ]
    failures = compare_outputs({"a": logits}, {"b": logits}, resolve_tolerance())
    assert [str(c) for c in failures] == [
        "a: reference is tensor (1, 2, 4) float32, patched is absent",
        "b: reference is absent, patched is tensor (1, 2, 4) float32",
    ]


def test_shape_and_dtype_differences_are_reported_not_broadcast() -> None:
    spec = resolve_tolerance()
    (shape,) = compare_outputs((torch.zeros(2, 3),), (torch.zeros(3),), spec)
    assert str(shape) == "[0]: reference is tensor (2, 3) float32, patched is tensor (3,) float32"
    (dtype,) = compare_outputs(torch.zeros(2), torch.zeros(2, dtype=torch.float16), spec)
    assert "patched is tensor (2,) float16" in str(dtype)


def test_worst_element_and_counts_are_exact() -> None:
    reference = torch.zeros(2, 3)
    patched = reference.clone()
    patched[1, 2] = 0.5
    patched[0, 0] = 1e-6  # within atol
    (result,) = compare_outputs(reference, patched, resolve_tolerance())
    assert (result.over, result.total, result.worst_index, result.max_abs) == (1, 6, (1, 2), 0.5)
    assert (result.worst_reference, result.worst_patched) == (0.0, 0.5)


def test_nan_in_both_agrees_and_nan_in_one_fails() -> None:
    nan = torch.tensor([float("nan"), 1.0, float("inf")])
    assert all(c.passed for c in compare_outputs(nan, nan.clone(), resolve_tolerance()))
    (one_sided,) = compare_outputs(nan, torch.tensor([0.0, 1.0, float("inf")]), resolve_tolerance())
    assert (one_sided.over, one_sided.worst_index) == (1, (0,))


def test_a_reference_with_no_finite_value_fails_instead_of_agreeing_with_anything() -> None:
    nothing = torch.full((2, 3), float("nan"))
    (result,) = compare_outputs(nothing, nothing.clone(), resolve_tolerance())
    assert not result.passed and "no finite value" in str(result)
    infinite = torch.tensor([float("inf"), float("-inf")])  # equal, and exactly so: the same values, not vacuous
    assert all(c.passed for c in compare_outputs(infinite, infinite.clone(), resolve_tolerance()))


@pytest.mark.parametrize(
    "outputs", [None, {"logits": None}, torch.zeros(0, 4), ()], ids=["none", "none-field", "empty", "no-leaf"]
)
def test_outputs_with_no_element_to_compare_fail(outputs: object) -> None:
    found = compare_outputs(outputs, outputs, resolve_tolerance())
    assert not all(c.passed for c in found)
    assert "nothing was compared" in str(found[-1])


def test_nan_outputs_do_not_let_a_wrong_patch_pass(pair: Callable[..., Pair]) -> None:
    # a NaN in the first norm makes every output NaN in both models: NaN agreeing with NaN would
    # pass the non-causal attention patch, which the same check fails on finite weights
    reference, patched = pair("llama_fused_qkv_noncausal", rms_norm_eps=1.5e-6)  # a pair of its own: weights change
    with torch.no_grad():
        for model in (reference, patched):
            model.model.layers[0].input_layernorm.weight[0] = float("nan")
    with pytest.raises(AssertionError, match="logits: the reference holds no finite value"):
        assert_equivalent(reference, patched, ids())


def test_integer_outputs_must_match_exactly() -> None:
    (result,) = compare_outputs(torch.tensor([1, 2]), torch.tensor([1, 3]), resolve_tolerance(policy="loose"))
    assert result.over == 1


def test_one_record_per_check_with_errors_and_tolerance(pair: Callable[..., Pair], records: list[CheckRecord]) -> None:
    with pytest.raises(AssertionError):
        assert_equivalent(*pair("llama_fused_qkv_noncausal"), ids())
    (row,) = records
    assert (row.kind, row.outcome, row.model, row.dtype, row.atol, row.rtol) == (
        "equivalence", "failed", "LlamaForCausalLM", "float32", 1e-5, 1.3e-6,
    )  # fmt: skip
    assert row.max_abs_error > 0.5 and 0 < row.elements_over_tolerance <= row.elements_compared
    assert "first diverging module: model.layers.0.self_attn" in row.detail


def test_failure_in_a_user_test_points_at_the_users_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from pytest_modelpatch.compare.forward.equivalence import assert_equivalent

        def test_scaled():
            torch.manual_seed(0)
            config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64)
            reference = LlamaForCausalLM(config)
            patched = LlamaForCausalLM(config)
            patched.load_state_dict(reference.state_dict())
            with torch.no_grad():
                patched.model.layers[0].mlp.down_proj.weight.mul_(1.01)
            assert_equivalent(reference, patched, {"input_ids": torch.tensor([[1, 2, 3]])})
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            ">*assert_equivalent(reference, patched, *",
            "E*AssertionError: patched LlamaForCausalLM differs from reference LlamaForCausalLM (float32 on cpu)*",
            "E*logits: shape (1, 3, 64) float32: *elements over tolerance*",
            "E*first diverging module: model.layers.0.mlp.down_proj (Linear)",
        ]
    )
