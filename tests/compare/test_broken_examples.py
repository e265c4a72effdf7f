"""Every broken example still fails under the default tolerance, by a margin: a looser default must not hide one.

One real pytest session runs each broken twin as a user would (``@pytest.mark.model``, the patch
marker, the fixtures, the check its docstring names): every ``fixtures/patches`` module whose
``EXPECTED`` or ``EXPECTED_BACKWARD`` is ``"diverges"``, and the broken mechanisms (an attention
function, an experts function, an instance patcher, a LoRA, a norm kernel over the families it
reaches). Each must fail, and miss its allowance by at least :data:`MARGIN` times at its worst
element, so that the default stays well clear of every bug the examples keep.
``docs/examples`` runs the main job's strict xfails itself (CI's main job lane).
"""

from __future__ import annotations

import json
import re

import pytest

MARGIN = 2.0  # the smallest: the instance patcher without epsilon, 4.4 times (1100 ulps against 256)
_WORST = re.compile(r"reference (\S+), patched (\S+) \(allowed (\S+)\)")

BROKEN = """
import pytest
from fixtures.patches import (
    bert_broad_attention, llama_fused_qkv_noncausal, llama_int8_mlp, llama_past_key_values_only, llama_reordered_mlp,
    llama_rmsnorm_autograd_broken, llama_swiglu_autograd_broken, llama_training_path_mlp, mechanisms,
    mixtral_wrong_expert_router,
)
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent, assert_decodes_equivalent

mechanisms.register()
BERT_ALLOW = {".*Attention": ["CONTAINER", "NOT_A_MODULE", "WEIGHT_NAMES", "UNUSED_ARGUMENT"]}


@pytest.mark.model("bert")
@pytest.mark.patch(bert_broad_attention.MAPPING, allow=BERT_ALLOW)
def test_bert_broad_attention(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_fused_qkv_noncausal.MAPPING, conversions=llama_fused_qkv_noncausal.CONVERSIONS)
def test_llama_fused_qkv_noncausal(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_int8_mlp.MAPPING)
def test_llama_int8_mlp(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_past_key_values_only.MAPPING, allow={"LlamaAttention": ["UNUSED_ARGUMENT"]})
def test_llama_past_key_values_only(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


# its MAPPING is a good patch (EXPECTED names the round-off it shows in half precision): BIAS_MAPPING is the twin
@pytest.mark.model("llama")
@pytest.mark.patch(llama_reordered_mlp.BIAS_MAPPING)
def test_llama_reordered_mlp_bias(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("mixtral")
@pytest.mark.patch(mixtral_wrong_expert_router.MAPPING)
def test_mixtral_wrong_expert_router(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_rmsnorm_autograd_broken.MAPPING)
def test_llama_rmsnorm_autograd_broken(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_swiglu_autograd_broken.MAPPING)
def test_llama_swiglu_autograd_broken(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_training_path_mlp.MAPPING)
def test_llama_training_path_mlp(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="fixture_wrong_scale")
def test_attention_function_with_a_wrong_scale(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="fixture_sdpa_no_mask")
def test_attention_function_without_its_mask(reference_model, patched_model):
    assert_decodes_equivalent(reference_model, patched_model)


@pytest.mark.model("qwen3_moe")
@pytest.mark.patch(experts_implementation="fixture_swapped_weights")
def test_experts_function_with_swapped_weights(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.rmsnorm_instance_patcher_no_eps)
def test_instance_patcher_without_epsilon(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.random_lora)
def test_random_lora(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(families="patched")
@pytest.mark.patch({"^GemmaRMSNorm$": mechanisms.LlamaStyleNorm}, allow={"^GemmaRMSNorm$": ["SIGNATURE"]})
def test_llama_norm_kernel_on_the_gemma_families(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_every_broken_example_fails_under_the_default_tolerance_by_a_margin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_broken=BROKEN)
    result = pytester.runpytest("-p", "no:randomly", "-n", "2", "-q", "--modelpatch-report", "report.json")
    outcomes = result.parseoutcomes()
    tests = 17  # 15 functions, the norm kernel on three families
    assert outcomes.get("failed") == tests and set(outcomes) <= {"failed", "warnings"}, result.stdout.str()[-3000:]
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    assert {row["nodeid"].partition("::")[2] for row in rows if row["outcome"] == "failed"} == {
        line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("FAILED")
    }, "every failing test failed in its check, not before it"  # fmt: skip
    # a check judged on values misses its allowance at some element by this much (one judged on structure, an
    # output the patched model lacks, has no such element)
    misses = {
        row["nodeid"]: misses_by(row["detail"])
        for row in rows
        if row["outcome"] == "failed" and row["elements_over_tolerance"]
    }
    close = {nodeid: round(ratio, 2) for nodeid, ratio in misses.items() if ratio < MARGIN}
    assert not close, f"broken examples within {MARGIN:g}x their allowance under the default tolerance: {close}"


def misses_by(detail: str) -> float:
    """How many times its allowance a failing check's worst element is off: the largest ``|patched - reference| / allowed``."""
    found = [abs(float(patched) - float(reference)) / float(allowed) if float(allowed) else float("inf")  # exact: any
             for reference, patched, allowed in _WORST.findall(detail)]  # fmt: skip
    return max((ratio for ratio in found if ratio == ratio), default=float("inf"))
