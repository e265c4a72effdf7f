"""Two different models are refused before any number is compared, by every check."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pytest_modelpatch import assert_equivalent, assert_module_equivalent, check_equivalent
from pytest_modelpatch.errors import ModelMismatchError
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.models.checkpoints import seeded_model

LLAMA = seeded_model(tiny_config("llama"))
CHECKS: dict[str, Callable[[torch.nn.Module, torch.nn.Module], object]] = {
    "assert_equivalent": assert_equivalent,
    "check_equivalent": lambda ref, pat: check_equivalent(ref, pat, max_examples=2),
    "assert_module_equivalent": lambda ref, pat: assert_module_equivalent(ref, pat, "model.norm"),
}


@pytest.mark.parametrize("check", CHECKS)
def test_a_llama_and_a_bert_are_different_models_for_every_check(check: str) -> None:
    bert = seeded_model(tiny_config("bert"))
    with pytest.raises(ModelMismatchError) as refused:
        CHECKS[check](LLAMA, bert)
    assert str(refused.value).startswith(
        f"{check}: the reference and patched models are different models "
        "(model_type 'llama' vs 'bert'; architecture LlamaForCausalLM vs BertForMaskedLM"
    )
    assert "Compare two loads of one checkpoint" in str(refused.value)


def test_the_same_family_with_another_shape_is_a_different_model() -> None:
    deeper = seeded_model(tiny_config("llama", num_hidden_layers=3))
    with pytest.raises(ModelMismatchError, match=r"different models \(num_hidden_layers 2 vs 3\)"):
        assert_equivalent(LLAMA, deeper)


def test_another_head_of_the_same_family_is_a_different_architecture() -> None:
    from transformers import LlamaForSequenceClassification

    head = seeded_model(tiny_config("llama"), model_class=LlamaForSequenceClassification)
    with pytest.raises(ModelMismatchError, match=r"architecture LlamaForCausalLM vs LlamaForSequenceClassification"):
        assert_equivalent(LLAMA, head)


def test_a_patched_top_level_subclass_and_other_module_classes_are_the_same_model() -> None:
    class PatchedLlama(type(LLAMA)):
        pass

    patched = seeded_model(tiny_config("llama"), model_class=PatchedLlama)
    patched.model.norm = torch.nn.Identity()  # a patched model may hold other module classes
    with pytest.raises(AssertionError, match="differs from reference"):  # compared, not refused
        assert_equivalent(LLAMA, patched)
    assert assert_equivalent(LLAMA, seeded_model(tiny_config("llama"), model_class=PatchedLlama)).passed


def test_heterogeneous_configs_are_compared_without_reading_per_layer_sizes_globally() -> None:
    # Gemma 4 keeps head_dim per layer and raises on a global read; the check must still
    # tell two loads of one model apart from a model of another shape.
    config = tiny_config("gemma4_text")
    model = seeded_model(config)
    assert_equivalent(model, model)
    smaller = seeded_model(tiny_config("gemma4_text", vocab_size=config.vocab_size // 2))
    with pytest.raises(ModelMismatchError, match=r"vocab_size \d+ vs \d+"):
        assert_equivalent(model, smaller)
