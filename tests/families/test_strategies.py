"""Hypothesis strategies: padded model inputs and valid tiny configs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from transformers import PretrainedConfig

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.families.strategies import drawn_bytes, model_inputs, positions_from_mask, tiny_configs
from pytest_modelpatch.models.checkpoints import seeded_model

LLAMA = tiny_config("llama", pad_token_id=0)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(inputs=model_inputs(LLAMA, padding=("left", "right")))
def test_model_inputs_stay_in_vocab_and_keep_a_real_token_per_row(inputs: dict[str, torch.Tensor]) -> None:
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.dtype == torch.long and ids.shape == mask.shape
    assert int(ids.min()) >= 0 and int(ids.max()) < LLAMA.vocab_size
    assert bool((mask.sum(-1) >= 1).all())
    assert bool((ids[mask == 0] == LLAMA.pad_token_id).all())


@FAST
@given(inputs=model_inputs(LLAMA, padding="left"))
def test_left_padding_puts_padding_first_and_positions_count_real_tokens(inputs: dict[str, torch.Tensor]) -> None:
    mask, positions = inputs["attention_mask"], inputs["position_ids"]
    assert torch.equal(mask, mask.sort(-1).values)  # zeros, then ones
    for row in range(mask.shape[0]):
        real = mask[row].bool()
        assert positions[row][real].tolist() == list(range(int(real.sum())))


@FAST
@given(inputs=model_inputs(LLAMA, padding="right"))
def test_right_padding_puts_padding_last(inputs: dict[str, torch.Tensor]) -> None:
    mask = inputs["attention_mask"]
    assert torch.equal(mask, mask.sort(-1, descending=True).values)


def test_model_inputs_draw_every_padding_side_and_the_requested_sizes() -> None:
    strategy = model_inputs(LLAMA, batch_sizes=[2], seq_lens=st.integers(3, 5))
    left = find(strategy, lambda x: bool((x["attention_mask"][:, 0] == 0).any()))
    right = find(strategy, lambda x: bool((x["attention_mask"][:, -1] == 0).any()))
    for found in (left, right):
        assert found["input_ids"].shape[0] == 2 and 3 <= found["input_ids"].shape[1] <= 5


def test_model_inputs_shrink_to_a_minimal_example() -> None:
    # the smallest input with a token above 10: one row, one token, just past 10
    minimal = find(model_inputs(LLAMA), lambda x: bool((x["input_ids"] > 10).any()))
    assert minimal["input_ids"].shape == (1, 1)
    assert int(minimal["attention_mask"].sum()) == 1


def test_model_inputs_bytes_order_shapes_so_that_shrinking_never_moves_to_a_later_shape() -> None:
    drawn = drawn_bytes(model_inputs(LLAMA, batch_sizes=[1, 2], seq_lens=[1, 2, 3]))
    assert drawn is not None
    rest = bytes(len(find(drawn.raw, lambda raw: True)) - 2)  # after 2 index bytes: 4 seed bytes, a pad byte per row
    # every index value, in order, walks the shapes in order (batch, then length), never back: taken
    # modulo the count, 0x0100 would be an earlier shape than 0x00ff, and shrinking would stall there
    walked = [tuple(drawn.build(v.to_bytes(2, "big") + rest)["input_ids"].shape) for v in range(0, 65536, 97)]
    assert walked == sorted(walked) and len(set(walked)) == 6
    simplest = drawn.build(bytes(2) + rest)
    assert simplest["input_ids"].shape == (1, 1) and simplest["attention_mask"].tolist() == [[1]]
    # equal bytes, equal inputs (what lets check_equivalent skip an input it compared already)
    raw = b"\xff\xff\x00\x00\x00\x07\x02\x01"
    first, again = drawn.build(raw), drawn.build(raw)
    assert first["attention_mask"].sum() < first["attention_mask"].numel()  # the pad bytes padded the rows
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_only_model_inputs_strategies_expose_their_bytes() -> None:
    assert drawn_bytes(model_inputs(LLAMA)) is not None
    assert drawn_bytes(model_inputs(LLAMA).map(dict)) is None  # a user's mapping may change what the bytes mean
    assert drawn_bytes(model_inputs(LLAMA, seq_lens=st.integers(1, 4))) is None  # sizes drawn as a strategy


def test_model_inputs_are_deterministic_for_a_given_seed() -> None:
    def draw_all(seed: int) -> list[list[int]]:
        seen: list[list[int]] = []

        @settings(max_examples=10, database=None, derandomize=False)
        @given(inputs=model_inputs(LLAMA))
        def record(inputs: dict[str, torch.Tensor]) -> None:
            seen.append(inputs["input_ids"].flatten().tolist())

        from hypothesis import seed as hypothesis_seed

        hypothesis_seed(seed)(record)()
        return seen

    assert draw_all(7) == draw_all(7)


def test_model_inputs_add_token_type_ids_for_encoders_and_run_through_the_model() -> None:
    config = tiny_config("bert")
    model = seeded_model(config)
    inputs = find(model_inputs(config), lambda x: bool((x["attention_mask"] == 0).any()))
    assert set(inputs) >= {"input_ids", "attention_mask", "token_type_ids"}
    with torch.no_grad():
        assert model(**inputs).logits.shape[:2] == inputs["input_ids"].shape


def test_min_seq_len_bounds_the_default_lengths() -> None:
    shortest = find(model_inputs(LLAMA, min_seq_len=2, max_seq_len=5), lambda x: True)
    assert shortest["input_ids"].shape == (1, 2)  # the simplest input is now two tokens
    longest = find(model_inputs(LLAMA, min_seq_len=2, max_seq_len=5), lambda x: x["input_ids"].shape[1] >= 5)
    assert longest["input_ids"].shape[1] == 5
    with pytest.raises(PatchUsageError, match="min_seq_len <= max_seq_len"):
        model_inputs(LLAMA, min_seq_len=6, max_seq_len=5)


def test_model_inputs_reject_an_unknown_padding_side() -> None:
    with pytest.raises(PatchUsageError, match="padding must be among"):
        model_inputs(LLAMA, padding="middle")


def test_positions_from_mask_follows_generate_for_left_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[1, 1, 0, 1], [0, 1, 2, 3]]


@settings(max_examples=15, deadline=None)
@given(config=tiny_configs("qwen2"))
def test_tiny_configs_are_valid_grouped_query_combinations(config: PretrainedConfig) -> None:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    assert heads % kv == 0
    assert config.hidden_size // heads in (8, 16) and config.hidden_size % heads == 0
    assert 1 <= config.num_hidden_layers <= 3


@settings(max_examples=8, deadline=None)
@given(config=tiny_configs("gpt2"), inputs=st.data())
def test_tiny_configs_build_and_run_with_drawn_inputs(config: PretrainedConfig, inputs: st.DataObject) -> None:
    model = seeded_model(config)
    batch = inputs.draw(model_inputs(config, max_seq_len=6))
    with torch.no_grad():
        assert model(**batch).logits.shape[-1] == config.vocab_size


def test_tiny_configs_keep_fixed_values() -> None:
    config = find(tiny_configs("llama", num_attention_heads=4, vocab_size=128), lambda c: c.num_hidden_layers == 3)
    assert (config.num_attention_heads, config.vocab_size) == (4, 128)


def test_tiny_configs_fail_fast_on_an_unknown_type() -> None:
    with pytest.raises(PatchUsageError, match="unknown model type"):
        tiny_configs("lama")
