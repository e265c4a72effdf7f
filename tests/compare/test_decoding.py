"""assert_decodes_equivalent and check_decodes_equivalent: decoding step by step through each model's cache."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Pair, load_pair

from fixtures import load_patch, tiny_config
from pytest_modelpatch import (
    PatchUsageError,
    assert_decodes_equivalent,
    assert_equivalent,
    check_decodes_equivalent,
)
from pytest_modelpatch.compare.decoding.equivalence import default_prompts
from pytest_modelpatch.families.catalog import tiny_config as tiny_config_of
from pytest_modelpatch.models.checkpoints import cached_checkpoint

# ---------------------------------------------------------------------------
# The loop is generate()'s loop
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cache"),
    [
        ("llama_fused_qkv", None),
        ("llama_fused_qkv", "static"),
        ("mistral_fused_qkv", None),
        ("mistral_fused_qkv", "static"),
    ],
)
def test_reference_tokens_are_the_tokens_generate_picks(
    pair: Callable[..., Pair], name: str, cache: str | None
) -> None:
    reference, patched = pair(name)
    prompts = default_prompts(reference)
    report = assert_decodes_equivalent(reference, patched, prompts, cache_implementation=cache, max_new_tokens=6)
    generated = reference.generate(**prompts, max_new_tokens=6, do_sample=False, cache_implementation=cache,
                                   eos_token_id=None, pad_token_id=0)  # fmt: skip
    ours = [list(row) for row in zip(*(step.reference_tokens for step in report.steps))]
    assert ours == generated[:, prompts["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("cache", [None, "static"])
def test_hybrid_sliding_family_decodes_as_generate_does(cache: str | None) -> None:
    from pytest_modelpatch.families.catalog import model_class_for

    torch.manual_seed(0)
    config = tiny_config_of("gemma2", sliding_window=4)  # layers: sliding, full
    model = model_class_for(config)(config).eval()
    prompts = default_prompts(model)
    report = assert_decodes_equivalent(model, model, prompts, cache_implementation=cache)
    generated = model.generate(**prompts, max_new_tokens=8, do_sample=False, cache_implementation=cache,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert [list(row) for row in zip(*(s.reference_tokens for s in report.steps))] == generated[:, 8:].tolist()


def test_default_prompts_are_left_padded_with_unequal_lengths(pair: Callable[..., Pair]) -> None:
    mask = default_prompts(pair("llama_fused_qkv")[0])["attention_mask"]
    assert mask.tolist() == [[1] * 8, [0] * 3 + [1] * 5, [0] * 6 + [1] * 2]


def test_sliding_window_family_decodes_past_its_window(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("mistral_fused_qkv")
    window = reference.config.sliding_window
    report = assert_decodes_equivalent(reference, patched, max_new_tokens=8)
    assert window < 8 and len(report.steps) == 8  # an 8-token prompt and 8 new tokens, window 4
    from transformers import DynamicCache

    assert type(DynamicCache(config=reference.config).layers[0]).__name__ == "DynamicSlidingWindowLayer"


# ---------------------------------------------------------------------------
# Broken decode-only attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [None, "static"])
def test_new_kv_only_attention_passes_a_forward_and_fails_at_the_first_decode_step(
    pair: Callable[..., Pair], cache: str | None, records: list[Any]
) -> None:
    reference, patched = pair("llama_new_kv_only")
    assert assert_equivalent(reference, patched).passed
    with pytest.raises(AssertionError) as failure:
        assert_decodes_equivalent(reference, patched, cache_implementation=cache)
    message = str(failure.value)
    assert "first diverging step: step 1 (of 8 new tokens), batch row 0" in message
    assert "step 1 logits: shape (3, 1, 128) float32:" in message
    assert "row 0: reference token " in message and "not a near-tie" in message
    assert "at step 1, first diverging module: model.layers.0.self_attn (LlamaAttention in the reference, " \
        "LlamaNewKVOnlyAttention in the patched model)\n  its inputs agree" in message  # fmt: skip
    decode = [r for r in records if r.kind == "decode"]
    assert [(r.outcome, r.output) for r in decode] == [("failed", "step 1 logits")]


CACHE_RENAMED = (
    "cache"
    in __import__("inspect")
    .signature(__import__("transformers").models.llama.modeling_llama.LlamaAttention.forward)
    .parameters
)


@pytest.mark.skipif(not CACHE_RENAMED, reason="transformers < 5.24 passes past_key_values, which this forward takes")
def test_a_forward_written_before_the_cache_rename_fails_and_the_hint_names_the_rename(
    pair: Callable[..., Pair],
) -> None:
    reference, patched = pair("llama_past_key_values_only")
    with pytest.raises(AssertionError) as decoding:
        assert_decodes_equivalent(reference, patched)
    with pytest.raises(AssertionError) as forward:
        assert_equivalent(reference, patched)
    for message in (str(decoding.value), str(forward.value)):
        assert "hint: the patched model's cache stayed empty" in message
        assert "transformers passes it as `cache=` since 5.24 (it was `past_key_values=`)" in message
    assert "first diverging step: step 1 (of 8 new tokens)" in str(decoding.value)
    assert "(cache.layers[0].keys, cache.layers[0].values, ...)" in str(forward.value)


def test_the_same_forward_taking_both_spellings_decodes_like_the_model(pair: Callable[..., Pair]) -> None:
    # CacheStepAttention, the base of the stale example, resolves `cache` or `past_key_values`
    from fixtures.patches._decode_attention import CacheStepAttention

    reference, patched = pair("llama_past_key_values_only")  # shared by the tests of this module: put back after
    stale = type(patched.model.layers[0].self_attn)
    try:
        for layer in patched.model.layers:
            layer.self_attn.__class__ = CacheStepAttention
        assert assert_decodes_equivalent(reference, patched).passed
        assert assert_equivalent(reference, patched, allow_unused=True).passed
    finally:
        for layer in patched.model.layers:
            layer.self_attn.__class__ = stale


def test_mask_drop_on_single_token_steps_hides_from_an_unpadded_batch(pair: Callable[..., Pair]) -> None:
    reference, patched = pair("llama_decode_mask_drop")
    prompts = default_prompts(reference)
    unpadded = {"input_ids": prompts["input_ids"][:1], "attention_mask": prompts["attention_mask"][:1]}
    assert assert_decodes_equivalent(reference, patched, unpadded).passed
    with pytest.raises(AssertionError, match=r"first diverging step: step 1 \(of 8 new tokens\), batch row 1"):
        assert_decodes_equivalent(reference, patched)


# ---------------------------------------------------------------------------
# Near-ties
# ---------------------------------------------------------------------------


@pytest.fixture
def bf16_pair(tmp_path: Path) -> Pair:
    """A fresh bf16 reference/patched pair whose weights this test may change."""
    path = cached_checkpoint(tiny_config("llama"), dtype="bfloat16", cache_dir=tmp_path)
    return load_pair(path, load_patch("llama_fused_qkv"), dtype="bfloat16")


def _tie_tokens(reference: torch.nn.Module, patched: torch.nn.Module) -> tuple[int, int]:
    """Give token b the lm_head row of the reference's first greedy token a (b > a): their logits tie."""
    with torch.no_grad():
        a = int(reference(**default_prompts(reference)).logits[0, -1].argmax())
        b = reference.config.vocab_size - 1 if a != reference.config.vocab_size - 1 else 0
        a, b = min(a, b), max(a, b)
        for model in (reference, patched):
            model.lm_head.weight[b] = model.lm_head.weight[a]
    return a, b


def test_near_tie_in_bf16_is_counted_not_failed(bf16_pair: Pair) -> None:
    reference, patched = bf16_pair
    a, b = _tie_tokens(reference, patched)

    def one_ulp_up(module: torch.nn.Module, args: Any, logits: torch.Tensor) -> torch.Tensor:
        # the patched model's logit b ends one bf16 ulp above a's: within tolerance, but argmax flips
        wide = logits[..., a].float()
        ulp = torch.exp2(torch.floor(torch.log2(wide.abs().clamp_min(1e-30)))) * 2.0**-7
        return logits.index_copy(-1, torch.tensor([b]), (wide + ulp).to(logits.dtype)[..., None])

    patched.lm_head.register_forward_hook(one_ulp_up)
    report = assert_decodes_equivalent(reference, patched)
    assert report.near_ties >= 1
    assert report.steps[0].near_ties == [0] and report.steps[0].patched_tokens[0] == b
    assert "near-tie token(s) taken from the reference" in str(report)


def test_real_token_mismatch_in_bf16_fails(bf16_pair: Pair) -> None:
    reference, patched = bf16_pair
    _, b = _tie_tokens(reference, patched)

    def promote(module: torch.nn.Module, args: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_copy(-1, torch.tensor([b]), logits.amax(-1, keepdim=True) + 1.0)

    patched.lm_head.register_forward_hook(promote)
    # row 0's tokens tie in the reference (a near-tie), the other rows' do not: those fail
    with pytest.raises(AssertionError, match=r"first diverging step: prefill .*\n(.*\n)*  row 1: reference token \d+, "
                       rf"patched token {b} \(reference logit gap .*not a near-tie\)"):  # fmt: skip
        assert_decodes_equivalent(reference, patched)


# ---------------------------------------------------------------------------
# check_decodes_equivalent and usage errors
# ---------------------------------------------------------------------------


def test_check_generation_passes_a_correct_patch(pair: Callable[..., Pair], records: list[Any]) -> None:
    report = check_decodes_equivalent(*pair("llama_fused_qkv"), max_examples=4, max_new_tokens=3)
    assert report.passed and report.examples == 4
    assert [(r.kind, r.outcome, r.examples) for r in records] == [("decode", "passed", 4)]


def test_check_generation_shrinks_the_mask_drop_to_one_padded_row(pair: Callable[..., Pair]) -> None:
    with pytest.raises(AssertionError) as failure:
        check_decodes_equivalent(*pair("llama_decode_mask_drop"), max_examples=20, max_new_tokens=6)
    message = str(failure.value)
    assert message.startswith("check_decodes_equivalent(seed=0, max_examples=20): example ")
    # minimal: one row, one pad slot, two new tokens (the bug needs a single-token step)
    assert "attention_mask=[[0, 1]]" in message and "(of 2 new tokens)" in message


def test_unknown_cache_implementation_is_a_usage_error(pair: Callable[..., Pair]) -> None:
    with pytest.raises(PatchUsageError, match="cache_implementation='offloaded' is not supported; use None"):
        assert_decodes_equivalent(*pair("llama_fused_qkv"), cache_implementation="offloaded")
    with pytest.raises(PatchUsageError, match="max_new_tokens=0; pass a positive int"):
        assert_decodes_equivalent(*pair("llama_fused_qkv"), max_new_tokens=0)


# ---------------------------------------------------------------------------
# Real pytest runs
# ---------------------------------------------------------------------------


USER_TESTS = """
import pytest
from fixtures.patches import llama_decode_mask_drop, llama_fused_qkv, llama_new_kv_only, mistral_fused_qkv
from pytest_modelpatch import assert_equivalent, assert_decodes_equivalent

CACHES = pytest.mark.parametrize("cache", [None, "static"])


@pytest.mark.model("llama")
@pytest.mark.patch(llama_new_kv_only.MAPPING)
@CACHES
def test_cache_bug(reference_model, patched_model, cache):
    assert_equivalent(reference_model, patched_model)
    assert_decodes_equivalent(reference_model, patched_model, cache_implementation=cache)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_decode_mask_drop.MAPPING)
def test_mask_drop(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert_decodes_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(llama_fused_qkv.MAPPING, conversions=llama_fused_qkv.CONVERSIONS, overwrite=True)
@CACHES
def test_fused(reference_model, patched_model, cache):
    assert_decodes_equivalent(reference_model, patched_model, cache_implementation=cache)


@pytest.mark.model("mistral", sliding_window=4)
@pytest.mark.patch(mistral_fused_qkv.MAPPING, conversions=mistral_fused_qkv.CONVERSIONS, overwrite=True)
@CACHES
def test_sliding(reference_model, patched_model, cache):
    assert_decodes_equivalent(reference_model, patched_model, cache_implementation=cache, max_new_tokens=10)
"""


def test_decoding_checks_in_a_real_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--modelpatch-report", "report.json")
    result.assert_outcomes(passed=4, failed=3)
    result.stdout.fnmatch_lines(["*dynamic cache): first diverging step: step 1 (of 8 new tokens), batch row 0"])
    result.stdout.fnmatch_lines(["*static cache): first diverging step: step 1 (of 8 new tokens), batch row 0"])
    result.stdout.fnmatch_lines(
        ["*at step 1, first diverging module: model.layers.0.self_attn*LlamaDecodeMaskDropAttention*"]
    )
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    decode = sorted((r["nodeid"].split("::")[1], r["outcome"]) for r in rows if r["kind"] == "decode")
    assert decode == [
        ("test_cache_bug[None]", "failed"), ("test_cache_bug[static]", "failed"),
        ("test_fused[None]", "passed"), ("test_fused[static]", "passed"), ("test_mask_drop", "failed"),
        ("test_sliding[None]", "passed"), ("test_sliding[static]", "passed"),
    ]  # fmt: skip
