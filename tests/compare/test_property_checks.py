"""check_equivalent: hypothesis inside one call, models built once; failures shrink to a minimal example."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from _support.runs import IN_ORDER
from conftest import Pair, load_pair
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context

from fixtures import load_patch
from pytest_modelpatch.compare._engine import property_loop
from pytest_modelpatch.compare._engine.property_loop import GROUP_SIZE
from pytest_modelpatch.compare.decoding.properties import check_decodes_equivalent
from pytest_modelpatch.compare.forward.equivalence import assert_equivalent
from pytest_modelpatch.compare.forward.properties import check_equivalent
from pytest_modelpatch.families.strategies import DrawnBytes, drawn_bytes, model_inputs, tiny_configs
from pytest_modelpatch.models.checkpoints import cached_checkpoint
from pytest_modelpatch.reporting.records import CheckRecord
from pytest_modelpatch.settings import configure_checks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.mark.parametrize("name", ["llama_fused_qkv", "qwen2_moe", "qwen3_moe_router"])
def test_good_patches_pass_over_varied_inputs(pair: Callable[[str], Pair], name: str) -> None:
    reference, patched = pair(name)
    seen: list[dict[str, torch.Tensor]] = []
    inputs = model_inputs(reference.config).map(lambda example: seen.append(example) or example)
    report = check_equivalent(reference, patched, inputs=inputs, max_examples=20)
    assert report.passed and report.examples == 20
    shapes = {tuple(example["input_ids"].shape) for example in seen}
    left_padded = any(bool((e["attention_mask"][:, 0] == 0).any()) for e in seen)
    right_padded = any(bool((e["attention_mask"][:, -1] == 0).any()) for e in seen)
    assert len(shapes) > 5 and left_padded and right_padded
    assert str(report).startswith(
        f"check_equivalent(seed=0, max_examples=20): patched {type(patched).__name__} matches"
    )


def test_noncausal_attention_is_caught_and_shrunk_to_two_tokens(pair: Callable[[str], Pair]) -> None:
    with pytest.raises(AssertionError) as failure:
        check_equivalent(*pair("llama_fused_qkv_noncausal"))
    message = str(failure.value)
    assert re.match(r"check_equivalent\(seed=0, max_examples=25\): example \d+ of 25 failed; shrunk in \d+", message)
    # One row of two unpadded tokens: the smallest input on which causal and non-causal attention differ.
    assert re.search(
        r"\ninputs: input_ids=\[\[\d+, \d+\]\], attention_mask=\[\[1, 1\]\], position_ids=\[\[0, 1\]\]", message
    )
    assert "  logits: shape (1, 2, 128) float32: " in message
    assert "first diverging module: model.layers.0.self_attn" in message


def test_inputs_are_drawn_in_groups_and_each_compared_input_is_new(pair: Callable[[str], Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    compared: list[dict[str, torch.Tensor]] = []
    handle = patched.register_forward_pre_hook(lambda _m, _a, kwargs: compared.append(dict(kwargs)), with_kwargs=True)
    try:
        report = check_equivalent(reference, patched, max_examples=GROUP_SIZE * 2 + 3)  # over two groups
    finally:
        handle.remove()
    assert report.passed and report.examples == len(compared) == GROUP_SIZE * 2 + 3
    keys = {tuple((k, tuple(v.shape), tuple(v.flatten().tolist())) for k, v in inputs.items()) for inputs in compared}
    assert len(keys) == len(compared)  # no input compared twice, none counted twice
    shapes = {tuple(inputs["input_ids"].shape) for inputs in compared}
    assert len(shapes) > 8 and any(shape[0] > 1 for shape in shapes)


def test_while_shrinking_an_input_that_differed_is_not_compared_again(
    pair: Callable[[str], Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    # hypothesis tries many groups that keep the failing input: the models are deterministic, so
    # it fails again without running (and from the same place, or hypothesis calls it flaky)
    reference, patched = pair("llama_fused_qkv_noncausal")
    strategy = model_inputs(reference.config)
    real = drawn_bytes(strategy)
    assert real is not None
    built: list[bytes] = []
    spy = DrawnBytes(real.raw, lambda raw: built.append(raw) or real.build(raw), real.size)
    monkeypatch.setattr(property_loop, "drawn_bytes", lambda s: spy if s is strategy else None)
    with pytest.raises(AssertionError) as failure:
        check_equivalent(reference, patched, inputs=strategy, max_examples=50)
    assert re.search(r"shrunk in [1-9]\d* more runs", str(failure.value)) and "Flaky" not in str(failure.value)
    assert len(built) == len(set(built)), "an input's bytes were built and compared twice"


def test_a_small_budget_still_reaches_inputs_of_more_than_one_token(pair: Callable[[str], Pair]) -> None:
    # hypothesis starts from its simplest input (one token, where causal and non-causal attention
    # agree); groups that repeat it with other seeds (fixed-size lists do) pass a 3-example check
    with pytest.raises(AssertionError, match=r"example \d of 3 failed"):
        check_equivalent(*pair("llama_fused_qkv_noncausal"), max_examples=3)


def test_same_seed_same_examples_and_same_report(pair: Callable[[str], Pair]) -> None:
    messages = []
    for _ in range(2):
        with pytest.raises(AssertionError) as failure:
            check_equivalent(*pair("llama_fused_qkv_noncausal"), seed=1234, max_examples=10)
        messages.append(str(failure.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("check_equivalent(seed=1234, max_examples=10)")


def test_session_seed_set_by_the_plugin_is_used_and_printed(pair: Callable[[str], Pair]) -> None:
    previous = configure_checks(seed=77)  # as pytest_configure sets --modelpatch-seed
    try:
        report = check_equivalent(*pair("llama_fused_qkv"), max_examples=3)
    finally:
        configure_checks(**previous)
    assert report.seed == 77 and "seed=77" in str(report)


def test_works_from_a_test_with_function_scoped_fixtures(pair: Callable[[str], Pair], tmp_path: Path) -> None:
    # @given is inside check_equivalent, not on this test: no function_scoped_fixture health check.
    assert check_equivalent(*pair("llama_fused_qkv"), max_examples=3).passed


def test_an_exception_from_a_model_is_shrunk_and_reported(pair: Callable[[str], Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")

    def reject_batches(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs["input_ids"].shape[0] > 1:
            raise RuntimeError("batched inputs are not supported")

    handle = patched.register_forward_pre_hook(reject_batches, with_kwargs=True)
    try:
        with pytest.raises(AssertionError) as failure:
            check_equivalent(reference, patched)
    finally:
        handle.remove()
    message = str(failure.value)
    assert re.search(r"minimal failing inputs: input_ids=\[\[\d+\], \[\d+\]\]", message)  # two rows of one token
    assert "a model raised RuntimeError: batched inputs are not supported" in message
    assert isinstance(failure.value.__cause__, RuntimeError)


def test_one_property_record_per_check(pair: Callable[[str], Pair], records: list[CheckRecord]) -> None:
    check_equivalent(*pair("qwen3_moe_router"), max_examples=5)
    with pytest.raises(AssertionError):
        check_equivalent(*pair("llama_fused_qkv_noncausal"), max_examples=5)
    assert [(r.kind, r.outcome, r.examples >= 5) for r in records] == [
        ("property", "passed", True),
        ("property", "failed", True),
    ]
    assert "first diverging module" in records[1].detail


def test_tolerance_arguments_apply_to_every_example(pair: Callable[[str], Pair]) -> None:
    assert check_equivalent(*pair("llama_fused_qkv_noncausal"), atol=10.0, max_examples=5).passed


def test_inputs_must_be_a_strategy_or_a_dict(pair: Callable[[str], Pair]) -> None:
    with pytest.raises(pytest.UsageError, match="inputs= must be a hypothesis strategy"):
        check_equivalent(*pair("llama_fused_qkv"), inputs=[1, 2, 3])


@settings(max_examples=4, deadline=None)
@given(config=tiny_configs("llama", vocab_size=128, layers=(1, 2)))
def test_fused_qkv_is_equivalent_across_head_and_kv_head_layouts(
    checkpoints: Path, config: transformers.PretrainedConfig
) -> None:
    reference, patched = load_pair(cached_checkpoint(config, cache_dir=checkpoints), load_patch("llama_fused_qkv"))
    assert type(patched.model.layers[0].self_attn).__name__ == "LlamaFusedQKVAttention"
    assert_equivalent(reference, patched)


MASK_IGNORING = """
import pytest
from transformers.models.llama.modeling_llama import LlamaAttention
from pytest_modelpatch import assert_equivalent, check_equivalent


class MaskIgnoringAttention(LlamaAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        # sdpa then falls back to is_causal: right for unpadded batches, wrong for padded ones
        return super().forward(hidden_states, position_embeddings, None, **kwargs)


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaAttention": MaskIgnoringAttention})
def test_mask(reference_model, patched_model):
    import torch
    unpadded = {"input_ids": torch.arange(1, 9)[None]}
    assert_equivalent(reference_model, patched_model, unpadded)  # no padding: the bug hides
    check_equivalent(reference_model, patched_model, max_examples=25)
"""


def test_default_drawn_inputs_reach_padded_attention_masks(pytester: pytest.Pytester) -> None:
    # an attention that ignores the mask is only wrong on padded rows: check_equivalent must draw them
    pytester.makepyfile(MASK_IGNORING)
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*check_equivalent(seed=*failed*"])
    masks = re.findall(r"inputs: .*?attention_mask=(\[\[[01, \[\]]*\]\])", result.stdout.str())
    assert masks and all("0" in mask for mask in masks), masks  # the shrunk example is a padded batch


# ---------------------------------------------------------------------------
# Every route inputs come by is drawn in groups, and still shrinks to the minimal input
# ---------------------------------------------------------------------------


def _batch_from_seed(seed: int) -> dict[str, torch.Tensor]:
    """A user's own builder: 1-3 rows of 1-16 tokens from one integer (seed 4 is the first of two tokens)."""
    generator = torch.Generator().manual_seed(seed)
    batch, length = 1 + seed % 3, 1 + (seed >> 2) % 16
    return {"input_ids": torch.randint(128, (batch, length), generator=generator)}


SEEDS = st.integers(0, 2**31 - 1)
ROUTES = {
    "default": None,
    "user strategy": SEEDS.map(_batch_from_seed),
    "mapping of strategies": {"input_ids": SEEDS.map(lambda seed: _batch_from_seed(seed)["input_ids"])},
}


def _hypothesis_examples_per_forward(model: torch.nn.Module) -> tuple[list[object], Any]:
    """The hypothesis example each forward of ``model`` ran in (its ConjectureData), and the hook's handle."""
    examples: list[object] = []

    def note(_module: torch.nn.Module, _args: Any, _kwargs: Any) -> None:
        examples.append(current_build_context().data)

    return examples, model.register_forward_pre_hook(note, with_kwargs=True)


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_input_route_draws_many_inputs_per_hypothesis_example(pair: Callable[[str], Pair], route: str) -> None:
    reference, patched = pair("llama_fused_qkv")
    examples, handle = _hypothesis_examples_per_forward(patched)
    try:
        report = check_equivalent(reference, patched, inputs=ROUTES[route], max_examples=40)
    finally:
        handle.remove()
    assert report.passed and report.examples == len(examples) == 40
    # one input per hypothesis example would be 40; groups hold up to GROUP_SIZE
    assert len({id(example) for example in examples}) <= 40 // 4


def test_check_generation_decodes_many_prompts_per_hypothesis_example(pair: Callable[[str], Pair]) -> None:
    reference, patched = pair("llama_fused_qkv")
    examples, handle = _hypothesis_examples_per_forward(patched)
    try:
        report = check_decodes_equivalent(reference, patched, max_examples=12, max_new_tokens=2)
    finally:
        handle.remove()
    assert report.passed and report.examples == 12
    assert len({id(example) for example in examples}) <= 12 // 3


@pytest.mark.parametrize("route", ["user strategy", "mapping of strategies"])
def test_a_users_strategy_still_catches_a_wrong_patch_and_reports_the_minimal_input(
    pair: Callable[[str], Pair], route: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check_equivalent(*pair("llama_fused_qkv_noncausal"), inputs=ROUTES[route], max_examples=60)
    message = str(failure.value)
    assert re.match(
        r"check_equivalent\(seed=0, max_examples=60\): example \d+ of 60 failed; shrunk in \d+ more runs", message
    )
    # the smallest integer whose batch has two tokens, the fewest on which non-causal attention differs
    minimal = _batch_from_seed(4)["input_ids"].tolist()
    assert f"\ninputs: input_ids={minimal}\n" in message
    assert "first diverging module: model.layers.0.self_attn" in message
