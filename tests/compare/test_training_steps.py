"""assert_trains_equivalent: optimizer steps, gradient accumulation, ties and weights that never train, in real runs."""

from __future__ import annotations

import json

import pytest
import torch
from _support.runs import IN_ORDER

TRAINING = """
import pytest
import torch
from fixtures.patches import llama_rmsnorm_no_weight_grad as frozen, llama_stale_packed_mlp as stale
from fixtures.patches import llama_swiglu_autograd as fused_mlp, training_transforms as transforms
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent, assert_trains_equivalent


@pytest.mark.model("llama")
@pytest.mark.dtypes("float32", "bfloat16")
@pytest.mark.patch(fused_mlp.MAPPING)
def test_a_correct_fused_mlp_trains_the_same(reference_model, patched_model, dtype):
    assert_trains_equivalent(reference_model, patched_model, steps=8)


@pytest.mark.model("llama")
@pytest.mark.patch(stale.MAPPING)
def test_a_weight_packed_once_goes_stale(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)  # the forward is exact
    assert_backward_equivalent(reference_model, patched_model)  # and so are one step's gradients
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.model("llama", tie_word_embeddings=True)
@pytest.mark.patch(transform=transforms.untie_lm_head)
def test_a_broken_tie(reference_model, patched_model):
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.model("llama", tie_word_embeddings=True)
@pytest.mark.patch(transform=transforms.shared_lm_head)
def test_a_new_head_that_keeps_the_tie(reference_model, patched_model):
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=transforms.fused_cross_entropy_per_batch)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_loss_that_drops_num_items_in_batch(reference_model, patched_model, accumulation):
    assert_trains_equivalent(reference_model, patched_model, grad_accumulation=accumulation)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=transforms.fused_cross_entropy)
def test_a_loss_that_honours_num_items_in_batch(reference_model, patched_model):
    assert_trains_equivalent(reference_model, patched_model, grad_accumulation=2)


@pytest.mark.model("llama")
@pytest.mark.patch(frozen.MAPPING)
def test_a_norm_whose_weight_gets_no_gradient(reference_model, patched_model):
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_the_reference_is_left_as_found(reference_model, patched_model):
    inputs = {"input_ids": torch.arange(12).reshape(2, 6) % 100}
    with torch.no_grad():
        before = reference_model(**inputs).logits.clone()
    assert_trains_equivalent(reference_model, patched_model, steps=3)
    assert not reference_model.training
    with torch.no_grad():
        assert torch.equal(reference_model(**inputs).logits, before)
"""


def test_training_catches_each_class_of_bug_and_passes_the_correct_patches(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_training=TRAINING)
    result = pytester.runpytest("--modelpatch-report=report.json")
    result.assert_outcomes(passed=6, failed=4)
    result.stdout.fnmatch_lines_random([
        # stale weights: exact for one step, then the first diverging step, quantity and module
        "*trains differently from reference LlamaForCausalLM (float32 on cpu, 8 AdamW steps at lr 0.001, gradient "
        "accumulation 1): first diverging at step 1: loss, gradient norm",
        "*at step 1, first diverging module: model.layers.0.mlp (LlamaMLP in the reference, LlamaStalePackedMLP in the patched model)",
        # the tie, before any step
        "*tie: the reference ties model.embed_tokens.weight and lm_head.weight (one tensor); the patched model holds separate tensors*",
        # num_items_in_batch, asked of the model
        "*gradient accumulation 2): first diverging at step 0: loss*",
        "*hint: the patched model's loss ignores num_items_in_batch: with num_items_in_batch=* and * it is * both times*",
        # the weight that never trains
        "*never trained: model.layers.0.input_layernorm.weight: the reference trains it, the patched model never updates it*",
    ])  # fmt: skip
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    training = {r["nodeid"].rpartition("::")[2]: r["outcome"] for r in rows if r["kind"] == "training"}
    assert training == {
        "test_a_correct_fused_mlp_trains_the_same[float32]": "passed",
        "test_a_correct_fused_mlp_trains_the_same[bfloat16]": "passed",
        "test_a_weight_packed_once_goes_stale": "failed",
        "test_a_broken_tie": "failed",
        "test_a_new_head_that_keeps_the_tie": "passed",
        "test_a_loss_that_drops_num_items_in_batch[1]": "passed",
        "test_a_loss_that_drops_num_items_in_batch[2]": "failed",
        "test_a_loss_that_honours_num_items_in_batch": "passed",
        "test_a_norm_whose_weight_gets_no_gradient": "failed",
        "test_the_reference_is_left_as_found": "passed",
    }
    stale = next(
        r for r in rows if r["nodeid"].endswith("test_a_weight_packed_once_goes_stale") and r["kind"] == "backward"
    )
    assert stale["outcome"] == "passed"  # the one-step check could not see it


def test_tied_groups_and_their_differences() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pytest_modelpatch.compare._engine.ties import tie_differences, tied_groups

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32, tie_word_embeddings=True)  # fmt: skip
    tied, untied = LlamaForCausalLM(config), LlamaForCausalLM(config)
    assert tied_groups(tied) == [("model.embed_tokens.weight", "lm_head.weight")]
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert tied_groups(untied) == []
    assert tie_differences(tied, tied) == []
    (line,) = tie_differences(tied, untied)
    assert line.startswith("the reference ties model.embed_tokens.weight and lm_head.weight")
    (line,) = tie_differences(untied, tied)
    assert (
        line
        == "the patched model ties model.embed_tokens.weight and lm_head.weight (one tensor); the reference does not"
    )


def test_micro_batches_of_a_step_hold_different_numbers_of_real_tokens() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pytest_modelpatch.compare.training.steps import _items, accepts_loss_kwargs, training_batches

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    steps = training_batches(model, None, steps=2, accumulation=3)
    assert [len(step) for step in steps] == [3, 3]
    counts = [int((batch["labels"] != -100).sum()) for batch in steps[0]]
    assert len(set(counts)) == 3, counts  # as a collator pads: every micro-batch its own count
    assert accepts_loss_kwargs(model)
    assert int(_items(model, steps[0])) == sum(int((b["labels"][..., 1:] != -100).sum()) for b in steps[0])
    single = training_batches(model, None, steps=1, accumulation=1)
    assert bool(single[0][0]["attention_mask"].all())  # without accumulation nothing is padded


TIES = """
import pytest
from fixtures.patches import training_transforms as transforms
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama", tie_word_embeddings=True)
@pytest.mark.patch(transform=transforms.untie_lm_head)
def test_untied(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama", tie_word_embeddings=True)
@pytest.mark.patch(transform=transforms.shared_lm_head)
def test_tied(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_assert_equivalent_fails_on_a_broken_tie_whose_outputs_still_agree(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ties=TIES)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*AssertionError: patched LlamaForCausalLM differs from reference LlamaForCausalLM (float32 on cpu) in how it "
        "ties its parameters (its * outputs agree, for now)",
        "*tie: the reference ties model.embed_tokens.weight and lm_head.weight (one tensor)*",
    ])  # fmt: skip


LORA = """
import pytest
from peft import LoraConfig, get_peft_model
from fixtures.patches import llama_swiglu_autograd as fused_mlp
from pytest_modelpatch import assert_equivalent, assert_trains_equivalent


def lora_attention(model):
    return get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8))


def lora_mlp(model):
    return get_peft_model(model, LoraConfig(target_modules=["up_proj"], r=4, lora_alpha=8))


@pytest.mark.model("llama", transform=lora_attention)
@pytest.mark.patch(fused_mlp.MAPPING)
def test_a_fused_mlp_under_a_lora_of_the_attention(reference_model, patched_model):
    assert type(reference_model).__name__ == type(patched_model).__name__ == "PeftModel"
    trained = {n for n, p in reference_model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)  # the reference trains the adapters alone
    assert_equivalent(reference_model, patched_model)
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.model("llama", transform=lora_mlp)
@pytest.mark.patch(fused_mlp.MAPPING)
def test_a_fused_mlp_that_reads_up_proj_weight_ignores_its_lora(reference_model, patched_model):
    # lora_B starts at zero: the adapter adds nothing until the first step, so the forward agrees
    assert_equivalent(reference_model, patched_model)
    assert_trains_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
def test_the_plain_reference_is_another_model(reference_model):
    assert type(reference_model).__name__ == "LlamaForCausalLM"
"""


def test_a_lora_on_both_models_trains_the_same_and_a_kernel_that_skips_it_is_named(pytester: pytest.Pytester) -> None:
    pytest.importorskip("peft")
    pytester.makepyfile(test_lora=LORA)
    result = pytester.runpytest(*IN_ORDER, "-rA", "-W", "ignore::FutureWarning")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_lora.py::test_a_fused_mlp_that_reads_up_proj_weight_ignores_its_lora*"])
    # the first step after the update diverges, and the adapter the kernel reads past never trains
    result.stdout.fnmatch_lines(["*up_proj.lora_B*never updates it*"])


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT calls it
def test_a_wrapped_model_is_given_the_labels_the_model_inside_takes() -> None:
    # PEFT's PeftModel.forward takes **kwargs: without labels the checks trained on the default
    # reduction (a random projection of the outputs), not the model's own loss
    peft = pytest.importorskip("peft")
    from pytest_modelpatch.compare.backward.step import has_loss_targets, with_labels
    from pytest_modelpatch.families.inputs import example_inputs
    from pytest_modelpatch.models import seeded_model, tiny_config

    config = tiny_config("llama", num_hidden_layers=1)
    wrapped = peft.get_peft_model(seeded_model(config), peft.LoraConfig(target_modules=["q_proj"], r=2))
    inputs = with_labels(wrapped, example_inputs(config))
    assert torch.equal(inputs["labels"], inputs["input_ids"])
    one_token = {"input_ids": inputs["input_ids"][:, :1], "labels": inputs["input_ids"][:, :1]}
    assert not has_loss_targets(wrapped, one_token)  # scored as the causal LM inside scores it


def test_a_reference_that_trains_nothing_is_a_usage_error() -> None:
    from pytest_modelpatch import assert_trains_equivalent
    from pytest_modelpatch.errors import PatchUsageError
    from pytest_modelpatch.models import seeded_model, tiny_config

    config = tiny_config("llama", num_hidden_layers=1)
    reference, patched = seeded_model(config), seeded_model(config)
    for model in (reference, patched):
        model.requires_grad_(False)
    with pytest.raises(PatchUsageError, match="the reference trains nothing"):
        assert_trains_equivalent(reference, patched, steps=1)
    assert not any(p.requires_grad for p in reference.parameters())  # left as found
    for model in (reference, patched):  # trainable, but the loss reads none of them
        model.requires_grad_(True)
    with pytest.raises(PatchUsageError, match="the reference trains nothing"):
        assert_trains_equivalent(reference, patched, steps=1, loss=lambda out: out.logits.detach().sum())
