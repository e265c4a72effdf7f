"""A check in which a replacement never ran proves nothing about it, and says so."""

from __future__ import annotations

import pytest

PATCH = """
from fixtures.patches._inline_mlp_layer import InlineMLPLayer
from transformers.models.llama.modeling_llama import LlamaMLP


class MyMLP(LlamaMLP):
    \"\"\"The replacement under test: it must run for a check to say anything about it.\"\"\"


class FusedLayer(InlineMLPLayer):
    # computes the MLP from its weights inline, so MyMLP.forward never runs: the outputs agree,
    # but a bug in MyMLP would go unseen
    pass


MAPPING = {"LlamaDecoderLayer": FusedLayer, "LlamaMLP": MyMLP}
"""


def test_a_replacement_that_never_ran_fails_the_check_unless_allowed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(my_patch=PATCH)
    pytester.makepyfile(
        """
import pytest
from my_patch import MAPPING
from pytest_modelpatch import assert_equivalent, check_equivalent
from pytest_modelpatch.models import patch_usage


@pytest.mark.model("llama")
@pytest.mark.patch(MAPPING, allow={"LlamaDecoderLayer": ["CONTAINER"]})
def test_assert_equivalent(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(MAPPING, allow={"LlamaDecoderLayer": ["CONTAINER"]})
def test_check_equivalent(reference_model, patched_model):
    check_equivalent(reference_model, patched_model, max_examples=3)


@pytest.mark.model("llama")
@pytest.mark.patch(MAPPING, allow={"LlamaDecoderLayer": ["CONTAINER"]})
def test_allowed(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model, allow_unused=True)
    check_equivalent(reference_model, patched_model, max_examples=3, allow_unused=True)
    usage = {u.replacement.rpartition(".")[2]: u for u in patch_usage(patched_model)}
    assert usage["MyMLP"].instances == 2 and usage["MyMLP"].calls_in_last_forward == 0
    assert usage["FusedLayer"].calls_in_last_forward == 2
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*my_patch.MyMLP never ran in the compared forward*allow_unused=True*"])
    result.stdout.fnmatch_lines(["*my_patch.MyMLP never ran in any of the 3 examples*"])


def test_patch_usage_counts_only_the_models_own_calls_not_module_replays(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP
from pytest_modelpatch import assert_module_equivalent
from pytest_modelpatch.models import patch_usage


class MyMLP(LlamaMLP):
    pass


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": MyMLP})
def test_replay_is_not_a_model_call(reference_model, patched_model):
    patched_model(input_ids=torch.tensor([[1, 2, 3]]))
    (usage,) = patch_usage(patched_model)
    assert usage.calls_in_last_forward == 2
    # replays real arguments into the patched MLP, calling it directly: not a call the model made
    assert_module_equivalent(reference_model, patched_model, "model.layers.0.mlp")
    (usage,) = patch_usage(patched_model)
    assert usage.calls_in_last_forward == 2
    # a wrapper (DDP, PEFT) holds the counted model as a submodule: what it reports is the model's
    assert patch_usage(torch.nn.ModuleDict({"module": patched_model})) == [usage]
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1)


def test_the_report_says_which_experts_got_no_tokens(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import json
import pytest
import torch
from fixtures import load_patch
from pytest_modelpatch import assert_equivalent

PATCH = load_patch("qwen2_moe")


@pytest.mark.model("qwen2_moe")
@pytest.mark.patch(PATCH.MAPPING, conversions=PATCH.CONVERSIONS, overwrite=True)
def test_two_tokens_reach_few_experts(reference_model, patched_model):
    experts = patched_model.config.num_experts
    report = assert_equivalent(reference_model, patched_model, {"input_ids": torch.tensor([[3, 5]])})
    idle = [line for line in report.coverage if "got no tokens" in line]
    assert idle, report.coverage
    # two tokens, top-k each: at most 2 * k experts of a layer can be busy
    assert all(f"of {experts} got no tokens" in line for line in idle)
    assert "coverage: model.layers.0.mlp.gate: experts" in str(report)
"""
    )
    result = pytester.runpytest("--modelpatch-report", "r.json")
    result.assert_outcomes(passed=1)
    rows = __import__("json").loads((pytester.path / "r.json").read_text())["rows"]
    assert any("got no tokens" in line for line in rows[0]["coverage"])


def test_every_check_that_runs_the_patched_model_fails_on_a_replacement_that_never_ran(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(my_patch=PATCH)
    pytester.makepyfile(
        """
import pytest
from my_patch import MAPPING
from pytest_modelpatch import (
    assert_compiles_equivalent, assert_decodes_equivalent, assert_exports_equivalent, assert_trains_equivalent,
    check_decodes_equivalent,
)

CHECKS = {
    "decodes": lambda ref, pat, **kw: assert_decodes_equivalent(ref, pat, max_new_tokens=2, **kw),
    "decodes_drawn": lambda ref, pat, **kw: check_decodes_equivalent(ref, pat, max_examples=2, max_new_tokens=2, **kw),
    "trains": lambda ref, pat, **kw: assert_trains_equivalent(ref, pat, steps=1, **kw),
    "exports": lambda ref, pat, **kw: assert_exports_equivalent(ref, pat, **kw),
    "compiles": lambda ref, pat, **kw: assert_compiles_equivalent(ref, pat, backend="eager", **kw),
}


@pytest.mark.model("llama")
@pytest.mark.patch(MAPPING, allow={"LlamaDecoderLayer": ["CONTAINER"]})
@pytest.mark.parametrize("check", CHECKS)
def test_unused(reference_model, patched_model, check):
    with pytest.raises(AssertionError, match="my_patch.MyMLP never ran in .*allow_unused=True"):
        CHECKS[check](reference_model, patched_model)
    CHECKS[check](reference_model, patched_model, allow_unused=True)
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=5)
