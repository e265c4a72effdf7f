"""The training checks on what trains in practice: bfloat16 at a high learning rate, fused losses, dropout."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

KERNELS = """
import pytest
from fixtures.patches import llama_always_dropout_attention as always_dropout
from fixtures.patches import llama_partial_dropout_attention as partial
from fixtures.patches import llama_swiglu_autograd as fused_mlp, training_transforms as transforms
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent, assert_trains_equivalent


@pytest.mark.model("llama")
@pytest.mark.dtypes("bfloat16")
@pytest.mark.patch(fused_mlp.MAPPING)
def test_bf16_correct_swiglu_at_a_high_learning_rate(reference_model, patched_model, dtype):
    assert_trains_equivalent(reference_model, patched_model, steps=16, lr=1e-2)


@pytest.mark.model("llama")
@pytest.mark.dtypes("bfloat16")
@pytest.mark.patch(transform=transforms.fused_cross_entropy_bf16)
def test_bf16_cross_entropy_in_bf16_at_a_high_learning_rate(reference_model, patched_model, dtype):
    assert_trains_equivalent(reference_model, patched_model, steps=16, lr=1e-2)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=transforms.fused_linear_cross_entropy)
def test_fused_linear_cross_entropy_without_logits(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    print(assert_backward_equivalent(reference_model, patched_model))
    assert_trains_equivalent(reference_model, patched_model, steps=3, grad_accumulation=2)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=transforms.fused_linear_cross_entropy_chunk_means)
def test_fused_linear_cross_entropy_averaging_chunk_means_backward(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=transforms.fused_linear_cross_entropy_chunk_means)
def test_fused_linear_cross_entropy_averaging_chunk_means_training(reference_model, patched_model):
    assert_trains_equivalent(reference_model, patched_model, steps=2)


@pytest.mark.model("llama", attention_dropout=0.1)
@pytest.mark.patch(partial.MAPPING)
def test_dropout_kept_in_a_partial(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert_backward_equivalent(reference_model, patched_model)
    assert_trains_equivalent(reference_model, patched_model, steps=2)


@pytest.mark.model("llama", attention_dropout=0.1)
@pytest.mark.patch(always_dropout.MAPPING)
def test_dropout_applied_in_eval_too(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)  # in training it is the original
    assert_trains_equivalent(reference_model, patched_model, steps=2)
"""


def test_training_checks_tell_right_from_wrong_in_bf16_with_fused_losses_and_dropout(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernels=KERNELS)
    result = pytester.runpytest("-p", "no:randomly", "-s", "--modelpatch-report=report.json")
    result.assert_outcomes(passed=3, failed=4)
    result.stdout.fnmatch_lines_random([
        # the bf16 cross-entropy: each step within the reference's own drift, its gradient norm off one way every step
        "*16 AdamW steps at lr 0.01, gradient accumulation 1): over the steps: the gradient norm leans one way on "
        "shared weights",
        "*on shared weights the patched gradient norm is -* off the reference's on average over 16 steps, * times the "
        "reference's own low-precision error there (*, against float32), and alike at every step (t = -*)*",
        # the fused loss returns no logits in training: listed, not failed
        "held by one side only, not compared: outputs.logits: reference is tensor (2, 8, 256) float32, patched is None",
        "*loss (the model's loss): reference 5.77158, patched 5.8212, difference 0.0496*",
        # dropout applied in eval: the training steps agree, the eval log-probabilities do not
        "*: after the last step: the eval log-probabilities differ",
    ])  # fmt: skip
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    outcomes = {(r["nodeid"].rpartition("::")[2], r["kind"]): r["outcome"] for r in rows}
    assert outcomes == {
        ("test_bf16_correct_swiglu_at_a_high_learning_rate[bfloat16]", "training"): "passed",
        ("test_bf16_cross_entropy_in_bf16_at_a_high_learning_rate[bfloat16]", "training"): "failed",
        ("test_fused_linear_cross_entropy_without_logits", "equivalence"): "passed",
        ("test_fused_linear_cross_entropy_without_logits", "backward"): "passed",
        ("test_fused_linear_cross_entropy_without_logits", "training"): "passed",
        ("test_fused_linear_cross_entropy_averaging_chunk_means_backward", "backward"): "failed",
        ("test_fused_linear_cross_entropy_averaging_chunk_means_training", "training"): "failed",
        ("test_dropout_kept_in_a_partial", "equivalence"): "passed",
        ("test_dropout_kept_in_a_partial", "backward"): "passed",
        ("test_dropout_kept_in_a_partial", "training"): "passed",
        ("test_dropout_applied_in_eval_too", "backward"): "passed",
        ("test_dropout_applied_in_eval_too", "training"): "failed",
    }


def _tiny_llama(**overrides: object) -> torch.nn.Module:
    from pytest_modelpatch.models import seeded_model, tiny_config

    return seeded_model(tiny_config("llama", num_hidden_layers=1, **overrides))


def _dropouts(model: torch.nn.Module, outer: Any, inner: Any) -> tuple[float, ...]:
    return (model.config.attention_dropout, outer.hidden_dropout_prob, inner.resid_pdrop, inner.drop_path_rate)


def test_training_state_zeroes_dropout_fields_of_nested_configs_and_as_configured_puts_them_back() -> None:
    from transformers import PretrainedConfig

    from pytest_modelpatch.compare._engine.train_mode import as_configured, training_state

    model = _tiny_llama(attention_dropout=0.25)
    inner = PretrainedConfig(resid_pdrop=0.1, drop_path_rate=0.2, layer_norm_eps=0.5)
    inner.model_type = "inner"
    outer = PretrainedConfig(hidden_dropout_prob=0.3, sub=inner)
    outer.model_type = "outer"
    model.config.vision_config = outer  # a sub-config of a sub-config
    seen = []
    with training_state(model):
        seen.append(_dropouts(model, outer, inner))
        assert inner.layer_norm_eps == 0.5  # not a dropout
        probabilities = torch.nn.functional.dropout(torch.ones(1000), p=0.5, training=True)
        with as_configured(model):
            seen.append(_dropouts(model, outer, inner))
            dropped = torch.nn.functional.dropout(torch.ones(1000), p=0.5, training=True)
        seen.append((model.config.attention_dropout, inner.resid_pdrop))
    assert seen == [(0.0, 0.0, 0.0, 0.0), (0.25, 0.3, 0.1, 0.2), (0.0, 0.0)]
    assert bool((probabilities == 1).all())  # torch's dropout ran at probability 0
    assert bool((dropped == 0).any())  # and as asked inside as_configured
    assert (model.config.attention_dropout, inner.resid_pdrop, inner.drop_path_rate) == (0.25, 0.1, 0.2)
    assert bool((torch.nn.functional.dropout(torch.ones(1000), p=0.5) == 0).any())  # nothing left behind


def test_dropout_functions_stay_untouched_when_no_dropout_is_configured() -> None:
    from pytest_modelpatch.compare._engine.train_mode import training_state

    model = _tiny_llama()  # attention_dropout 0: nothing to turn off, no function mode to pay for
    with training_state(model):
        assert bool((torch.nn.functional.dropout(torch.ones(1000), p=0.5) == 0).any())
        assert not torch.overrides._get_current_function_mode_stack()


def test_a_probability_kept_in_a_partial_is_turned_off_by_the_call_it_makes() -> None:
    from pytest_modelpatch.compare._engine.train_mode import training_state

    model = _tiny_llama(attention_dropout=0.5)
    attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, dropout_p=0.5)
    query = torch.randn(1, 1, 8, 4)
    with training_state(model):
        first, second = attend(query, query, query), attend(query, query, query)
    assert torch.equal(first, second)  # no draw: the same output twice
    assert not torch.equal(attend(query, query, query), attend(query, query, query))


def test_a_failure_after_weights_drifted_apart_names_what_the_patch_replaced_not_the_first_module() -> None:
    from fixtures.patches import llama_swiglu_autograd as fused_mlp
    from pytest_modelpatch.compare._engine.tolerance import resolve_tolerance
    from pytest_modelpatch.compare.training.steps import _locate

    reference = _tiny_llama()
    patched = _tiny_llama()
    patched.model.layers[0].mlp.__class__ = fused_mlp.LlamaAutogradSwiGLUMLP
    inputs = [{"input_ids": torch.arange(8).reshape(1, 8), "labels": torch.arange(8).reshape(1, 8)}]
    spec = resolve_tolerance()
    found, why = _locate(reference, patched, inputs, spec, spec, index=3)
    assert why == ""  # the same weights: the first diverging module is searched for (none: the forward is exact)
    with torch.no_grad():
        for param in patched.parameters():
            param.add_(1e-2)  # every weight moved, as steps of round-off move them
    found, why = _locate(reference, patched, inputs, spec, spec, index=3)
    assert found is None
    assert why.startswith("at step 3 the weights already differ (the first: model.embed_tokens.weight)")
    assert why.endswith("the patched model replaces model.layers.0.mlp (LlamaAutogradSwiGLUMLP)")
