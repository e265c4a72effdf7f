"""assert_backward_equivalent: loss, train-mode outputs and every gradient compared; the module that broke backward named."""

from __future__ import annotations

import re
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
import torch
from conftest import Pair

from pytest_modelpatch.compare.backward.equivalence import assert_backward_equivalent
from pytest_modelpatch.compare.forward.equivalence import assert_equivalent
from pytest_modelpatch.compare.forward.properties import check_backward_equivalent
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.reporting.records import CheckRecord

CHECKPOINTING = [
    pytest.param({}, id="plain"),
    pytest.param({"gradient_checkpointing": True}, id="non-reentrant"),
    pytest.param(
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, id="reentrant"
    ),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("name", ["llama_swiglu_autograd", "llama_rmsnorm_autograd"])
def test_correct_autograd_kernels_pass_with_and_without_checkpointing(
    pair: Callable[..., Pair], name: str, checkpointing: dict, dtype: str
) -> None:
    report = assert_backward_equivalent(*pair(name, dtype=dtype), **checkpointing)
    assert report.passed and len(report.gradients) == 22  # 21 parameters and the input embeddings
    assert report.gradients[-1].path == "input_embeddings"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_broken_swiglu_passes_the_forward_check_and_fails_backward_naming_the_mlp(
    pair: Callable[..., Pair], dtype: str
) -> None:
    reference, patched = pair("llama_swiglu_autograd_broken", dtype=dtype)
    assert assert_equivalent(reference, patched).passed
    with pytest.raises(AssertionError) as failure:
        assert_backward_equivalent(reference, patched)
    message = str(failure.value)
    assert "differs from reference LlamaForCausalLM in training" in message
    assert "loss (the model's loss): reference " in message and "difference 0 (ok)" in message
    assert "worst parameter gradient: model." in message and "worst at [" in message
    assert (
        "first module in backward order whose gradient diverges: model.layers.1.mlp "
        "(LlamaMLP in the reference, LlamaDroppedUpSwiGLUMLP in the patched model)\n"
        "  the gradient flowing into its output agrees; the gradients it computes differ:"
    ) in message
    assert "model.layers.1.mlp.up_proj.weight: shape (128, 64)" in message


def test_broken_rmsnorm_fails_naming_the_last_norm_first_reached_by_backward(pair: Callable[..., Pair]) -> None:
    with pytest.raises(
        AssertionError,
        match=r"gradient diverges: model\.norm \(LlamaRMSNorm in the reference, LlamaConstantScaleRMSNorm",
    ):
        assert_backward_equivalent(*pair("llama_rmsnorm_autograd_broken"), gradient_checkpointing=True)


def test_training_only_path_passes_eval_check_and_fails_backward_in_the_train_mode_forward(
    pair: Callable[..., Pair],
) -> None:
    reference, patched = pair("llama_training_path_mlp")
    assert assert_equivalent(reference, patched).passed
    with pytest.raises(AssertionError) as failure:
        assert_backward_equivalent(reference, patched)
    message = str(failure.value)
    assert "over tolerance" in message.split("\n")[1]  # the loss line
    assert "the train-mode forward already differs" in message
    assert "first diverging module: model.layers.0.mlp (LlamaMLP in the reference, LlamaTrainingPathMLP" in message


def test_fused_qkv_gradients_are_compared_through_the_conversion(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    report = assert_backward_equivalent(reference, patched)
    paths = [c.path for c in report.gradients]
    assert "model.layers.0.self_attn.k_proj.weight" in paths and not any("qkv_proj" in p for p in paths)
    assert "through the reverse of its weight conversions (ConcatenateQKV)" in str(report)


def test_a_gradient_without_counterpart_is_reported(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    conversions = patched._weight_conversions
    patched._weight_conversions = []  # as if the conversion were lost: qkv_proj has no counterpart
    try:
        with pytest.raises(AssertionError) as failure:
            assert_backward_equivalent(reference, patched)
    finally:
        patched._weight_conversions = conversions
    message = str(failure.value)
    assert "model.layers.0.self_attn.q_proj.weight: reference is tensor (64, 64) float32, patched is absent" in message
    assert (
        "model.layers.0.self_attn.qkv_proj.weight: reference is absent, patched is tensor (128, 64) float32" in message
    )


def test_models_are_left_as_found_training_flags_grads_and_requires_grad(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_swiglu_autograd")
    sentinel = torch.full_like(reference.lm_head.weight, 7.0)
    reference.lm_head.weight.grad = sentinel
    for model in (reference, patched):  # frozen embeddings: no gradient on either side, and still frozen after
        model.model.embed_tokens.weight.requires_grad_(False)
    try:
        assert_backward_equivalent(reference, patched, gradient_checkpointing=True)
        assert not reference.training and not any(m.training for m in reference.modules())
        assert reference.lm_head.weight.grad is sentinel and patched.lm_head.weight.grad is None
        assert not reference.model.embed_tokens.weight.requires_grad and reference.lm_head.weight.requires_grad
        # transformers 5.x renamed it (is_gradient_checkpointing warns FutureWarning)
        checkpointing = [getattr(m, "is_activation_checkpointing", None) for m in (reference, patched)]
        assert checkpointing == [False, False]
        assert not any("_gradient_checkpointing_func" in vars(m) for m in reference.modules())
    finally:
        reference.lm_head.weight.grad = None
        for model in (reference, patched):
            model.model.embed_tokens.weight.requires_grad_(True)


def test_loss_callable_and_default_reduction(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_swiglu_autograd_broken")
    ids = {"input_ids": torch.tensor([[3, 1, 4, 1, 5, 9]])}  # no labels: the default reduction
    with pytest.raises(AssertionError, match=r"loss \(default reduction"):
        assert_backward_equivalent(reference, patched, ids)

    def mean_logit(outputs: Any) -> torch.Tensor:
        return outputs.logits.mean()

    with pytest.raises(AssertionError, match=r"loss \(loss=mean_logit\)"):
        assert_backward_equivalent(reference, patched, ids, loss=mean_logit)
    with pytest.raises(PatchUsageError, match="not a scalar tensor"):
        assert_backward_equivalent(reference, patched, ids, loss=lambda outputs: outputs.logits)


class ReadOnlyOutputs(torch.nn.Module):
    """A model whose forward returns its outputs as a read-only mapping."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> MappingProxyType[str, torch.Tensor]:
        return MappingProxyType({"logits": self.head(self.embed(input_ids))})


def test_a_model_returning_a_read_only_mapping_is_compared_in_training() -> None:
    reference, patched = ReadOnlyOutputs(), ReadOnlyOutputs()
    report = assert_backward_equivalent(reference, patched, {"input_ids": torch.tensor([[3, 1, 4, 1, 5]])})
    assert report.passed and [c.path for c in report.outputs] == ["outputs.logits"], report


def test_backward_record_row(pair: Callable[..., Pair], records: list[CheckRecord]) -> None:
    assert_backward_equivalent(*pair("llama_swiglu_autograd"))
    (row,) = records
    assert row.kind == "backward" and row.outcome == "passed" and row.elements_compared > 0
    assert row.max_abs_error is not None and row.max_abs_error < 1e-5


def test_property_check_with_backward_catches_the_broken_kernel_and_shrinks(pair: Callable[..., Pair]) -> None:
    with pytest.raises(AssertionError) as failure:
        check_backward_equivalent(*pair("llama_swiglu_autograd_broken"), max_examples=5)
    message = str(failure.value)
    assert re.match(r"check_backward_equivalent\(seed=0, max_examples=5\): example \d of 5 failed; shrunk", message)
    # shrunk to one row of two tokens: the smallest causal-LM step with a label to predict
    assert re.search(r"\ninputs: input_ids=\[\[\d+, \d+\]\], attention_mask=\[\[1, 1\]\], .*labels=\[\[", message)
    assert "first module in backward order whose gradient diverges: model.layers.1.mlp" in message
    assert check_backward_equivalent(*pair("llama_swiglu_autograd"), max_examples=3).passed


def test_property_check_with_backward_compares_no_example_without_a_scored_token(pair: Callable[..., Pair]) -> None:
    # a one-token row gives a causal LM's loss nothing to score (NaN) and zero gradients: such an
    # example would pass the broken kernel, so the check never counts one
    from hypothesis import strategies as st

    from pytest_modelpatch.families.strategies import model_inputs

    reference, patched = pair("llama_swiglu_autograd_broken")
    one_token = model_inputs(reference.config, seq_lens=[1], padding="none")
    with pytest.raises(PatchUsageError, match="no drawn example gave the loss a token to score"):
        check_backward_equivalent(reference, patched, inputs=one_token, max_examples=3)
    mixed = st.one_of(one_token, model_inputs(reference.config, seq_lens=[3], padding="none"))
    with pytest.raises(AssertionError, match=r"inputs: input_ids=\[\[\d+, \d+, \d+\]\]"):
        check_backward_equivalent(reference, patched, inputs=mixed, max_examples=5)


def test_training_state_sees_a_dropout_added_or_replaced_after_an_earlier_check() -> None:
    from pytest_modelpatch.compare._engine.train_mode import training_state

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with training_state(model):
        assert model[1].p == 0.0
    model[0].attention_dropout = 0.25  # a new attribute: the cached scan must not miss it
    model[1] = torch.nn.Dropout(0.3)  # a replaced submodule
    with training_state(model):
        seen = (model[0].attention_dropout, model[1].p, model.training)
    assert seen == (0.0, 0.0, True)
    assert (model[0].attention_dropout, model[1].p) == (0.25, 0.3)


def test_a_scanned_model_is_not_kept_alive_by_the_scan_cache() -> None:
    # the cache is keyed by the model weakly: a cached scan that held the model kept every model a
    # backward check had seen alive for the session, defeating the model cache's bound
    import gc
    import weakref

    from pytest_modelpatch.compare._engine.train_mode import parameter_gradients, training_state

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model.attention_dropout = 0.1  # a dropout attribute on the model itself
    with training_state(model):
        assert model.attention_dropout == 0.0 and model[1].p == 0.0
    assert model.attention_dropout == 0.1 and list(parameter_gradients(model)) == ["0.weight", "0.bias"]
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_training_state_runs_a_modules_own_train_and_restores_every_flag() -> None:
    # a kernel library's module may override train() (keep a frozen part in eval, re-pack weights):
    # setting each module's flag directly, the fast path, must not skip it
    from pytest_modelpatch.compare._engine.train_mode import training_state

    class FrozenNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(2)

        def train(self, mode: bool = True) -> FrozenNorm:
            super().train(mode)
            self.norm.eval()  # stays in eval whatever the model does
            return self

    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
    frozen = torch.nn.Sequential(torch.nn.Linear(2, 2), FrozenNorm()).eval()
    with training_state(plain):
        assert all(m.training for m in plain.modules())
    with training_state(frozen):
        assert frozen.training and frozen[1].training and not frozen[1].norm.training
    assert not any(m.training for model in (plain, frozen) for m in model.modules())


def test_parameter_gradients_name_what_named_parameters_names_after_the_model_changes() -> None:
    from pytest_modelpatch.compare._engine.train_mode import parameter_gradients

    def expected(model: torch.nn.Module) -> dict[str, Any]:
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    model[1].weight = model[0].weight  # tied, as lm_head and embeddings are: named once
    model[2].bias.requires_grad_(False)  # frozen: no gradient expected
    model(torch.tensor([[1, 2]])).sum().backward()
    assert list(parameter_gradients(model)) == list(expected(model)) and "2.bias" not in parameter_gradients(model)
    model[2] = torch.nn.LayerNorm(4)  # replaced after a first scan
    model.add_module("tied", model[0])  # a module under two names: its parameters once, under the first
    model.extra = torch.nn.Linear(4, 4)  # added
    found = parameter_gradients(model)
    assert list(found) == list(expected(model)) and all(found[k] is v for k, v in expected(model).items())
    model[1].bias = torch.nn.Parameter(torch.ones(4))  # a parameter replaced on a module that stays
    model[1].bias.grad = torch.full((4,), 7.0)
    assert parameter_gradients(model)["1.bias"] is model[1].bias.grad


def test_a_bf16_models_float32_loss_is_judged_at_bf16_round_off_and_a_real_loss_error_still_fails(
    pair: Callable[..., Pair],
) -> None:
    # split-K down projection: bf16 round-off in every logit, so the float32 loss moves by more than
    # float32's tolerance (as a tensor-parallel all-reduce moves it); the +3e-2 bias is a real error
    reference, patched = pair("llama_reordered_mlp", dtype="bfloat16")
    report = assert_backward_equivalent(reference, patched)
    ref_loss, pat_loss = report.loss_values
    assert (
        ref_loss != pat_loss and report.loss.tolerance.rtol == report.gradient_tolerance.for_dtype(torch.bfloat16).rtol
    )
    with pytest.raises(AssertionError, match=r"outputs\.logits: shape \(2, 8, 128\) bfloat16: \d+/2048 elements over"):
        assert_backward_equivalent(*pair("llama_reordered_mlp", mapping="BIAS_MAPPING", dtype="bfloat16"))
