"""Hypothesis strategies for model inputs and tiny configs.

For users who write ``@given`` themselves (with models built once, at module or
session scope) and for ``check_equivalent``, which draws from ``model_inputs`` by
default. Every draw goes through hypothesis, so examples are reproducible from its
seed and shrink toward short, unpadded batches; token ids come from a drawn seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from transformers import PretrainedConfig, PreTrainedModel

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.families.inputs import forward_parameters, ordinary_token_ids, text_companions
from pytest_modelpatch.families.shrink.sizes import KV_HEAD_KEYS

PADDING_SIDES = ("none", "left", "right")

IntsSpec = SearchStrategy[int] | Sequence[int] | int


def _ints(spec: IntsSpec, name: str) -> SearchStrategy[int]:
    if isinstance(spec, SearchStrategy):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 1:
        return st.just(spec)
    if isinstance(spec, Sequence) and spec and all(isinstance(v, int) and v >= 1 for v in spec):
        return st.sampled_from(sorted(set(spec)))
    raise PatchUsageError(f"{name} must be a positive int, a list of them or a hypothesis strategy, not {spec!r}")


def model_inputs(
    config: PretrainedConfig,
    *,
    batch_sizes: IntsSpec | None = None,
    seq_lens: IntsSpec | None = None,
    padding: str | Sequence[str] = PADDING_SIDES,
    max_batch_size: int = 3,
    max_seq_len: int = 16,
    min_seq_len: int = 1,
    position_ids: bool | None = None,
    model_class: type[PreTrainedModel] | None = None,
) -> SearchStrategy[dict[str, torch.Tensor]]:
    """Text inputs for ``config``'s model: ids within the vocab, padded left, right or not at all.

    ``batch_sizes``/``seq_lens`` default to 1..``max_batch_size`` and
    ``min_seq_len``..``max_seq_len``. Each padded row keeps at least one real token; padded
    slots hold the pad token when the config has one. ``position_ids`` (default:
    when the forward takes them) count real tokens only, as ``generate`` does for
    left padding. ``token_type_ids``/``decoder_input_ids`` are added as in
    ``example_inputs``.

    Example::

        @given(inputs=model_inputs(model.config, padding="left"))
        def test_left_padding(inputs): ...
    """
    sides = (padding,) if isinstance(padding, str) else tuple(padding)
    unknown = [side for side in sides if side not in PADDING_SIDES]
    if unknown or not sides:
        raise PatchUsageError(f"padding must be among {PADDING_SIDES}, not {padding!r}")
    cls = model_class or model_class_for(config)
    batches = batch_sizes if batch_sizes is not None else range(1, max_batch_size + 1)
    if not 1 <= min_seq_len <= max_seq_len:
        raise PatchUsageError(
            f"model_inputs: need 1 <= min_seq_len <= max_seq_len, got {min_seq_len} and {max_seq_len}"
        )
    lengths = seq_lens if seq_lens is not None else range(min_seq_len, max_seq_len + 1)
    allowed = ordinary_token_ids(config)
    pad_id = _pad_token_id(config)
    with_positions = "position_ids" in forward_parameters(cls) if position_ids is None else position_ids

    def build(batch: int, length: int, side: str, seed: int, pad_bytes: bytes) -> dict[str, torch.Tensor]:
        # the shape goes into the generator's seed too (which keeps 32 bits): hypothesis often draws
        # the same seed again, and the same stream of ids at every shape would vary far less
        shape = ((batch << 16) + length) * len(PADDING_SIDES) + PADDING_SIDES.index(side)
        generator = torch.Generator().manual_seed((seed + shape * 0x9E3779B1) % 2**32)
        input_ids = allowed[torch.randint(len(allowed), (batch, length), generator=generator)]
        mask = torch.ones(batch, length, dtype=torch.long)
        if side != "none":
            # a pad byte per row; each row keeps a real token
            pads = torch.tensor(list(pad_bytes[:batch])).remainder_(length).unsqueeze(1)
            slots = torch.arange(length)
            padded = slots < pads if side == "left" else slots >= length - pads
            mask = mask.masked_fill(padded, 0)
            if pad_id is not None:
                input_ids = input_ids.masked_fill(padded, pad_id)
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        if with_positions:
            inputs["position_ids"] = positions_from_mask(mask)
        inputs.update(text_companions(config, cls, input_ids))
        return inputs

    # Hypothesis costs about as much per value drawn as a tiny model's forward (per-token draws
    # cost more than a whole input), so an input is one byte string when the shapes are listed.
    listed = _listed_shapes(batches, lengths, sides)
    if listed is None:
        shapes = st.tuples(
            _ints(batches, "batch_sizes"),
            _ints(lengths, "seq_lens"),
            st.sampled_from(sorted(sides, key=PADDING_SIDES.index)),
        )

        @st.composite
        def draw_inputs(draw: st.DrawFn) -> dict[str, torch.Tensor]:
            batch, length, side = draw(shapes)
            raw = draw(st.binary(min_size=4 + batch, max_size=4 + batch))
            return build(batch, length, side, int.from_bytes(raw[:4], "big"), raw[4:])

        return draw_inputs()
    rows = max(batch for batch, _, _ in listed)
    # one byte more than the shape index needs, so that no shape is much more likely than another
    index_bytes = ((len(listed) - 1).bit_length() + 7) // 8 + 1

    def from_bytes(raw: bytes) -> dict[str, torch.Tensor]:
        # The shape's index, the seed, then a pad byte per row. Hypothesis shrinks bytes from the
        # first, so towards the first shape (smallest batch, then length, "none" first), then
        # seed 0, then no padding. The index is scaled, not taken modulo the count: a smaller
        # number is never a later shape, or shrinking would stop at a wrap (0x0100 -> 0x00ff).
        index = (int.from_bytes(raw[:index_bytes], "big") * len(listed)) >> (8 * index_bytes)
        seed = int.from_bytes(raw[index_bytes : index_bytes + 4], "big")
        return build(*listed[index], seed, raw[index_bytes + 4 :])

    size = index_bytes + 4 + rows
    raw = st.binary(min_size=size, max_size=size)
    strategy = raw.map(from_bytes)
    # the strategy carries how it draws: property checks read it back (drawn_bytes), no table on the side
    setattr(strategy, _DRAWN_BYTES, DrawnBytes(raw, from_bytes, size))
    return strategy


_Built = TypeVar("_Built", covariant=True)


@dataclass(frozen=True)
class DrawnBytes(Generic[_Built]):
    """How a ``model_inputs`` strategy draws: one byte string per input, and the input it stands for.

    Equal bytes make equal inputs, so a caller can draw many distinct inputs at once
    (``st.lists(raw, unique=True)``) and recognise a repeat from the bytes alone. A check may
    compose its own (a prompt and a count), so what the bytes build is a parameter.
    """

    raw: SearchStrategy[bytes]
    build: Callable[[bytes], _Built]
    size: int  # every input's byte string has this length


_DRAWN_BYTES = "modelpatch_drawn_bytes"  # the attribute of a model_inputs strategy that holds its DrawnBytes


def drawn_bytes(strategy: SearchStrategy[Any]) -> DrawnBytes[dict[str, torch.Tensor]] | None:
    """The bytes behind a ``model_inputs`` strategy (listed shapes); ``None`` for any other strategy.

    A strategy derived from it (``.map``, ``.filter``) is another object, without them: its values may
    no longer be what the bytes build.
    """
    drawn = getattr(strategy, _DRAWN_BYTES, None)
    return drawn if isinstance(drawn, DrawnBytes) else None


def _listed_shapes(
    batch_sizes: IntsSpec | range, seq_lens: IntsSpec | range, sides: tuple[str, ...]
) -> list[tuple[int, int, str]] | None:
    """Every ``(batch, length, padding side)`` allowed, ordered by batch, then length, then side.

    ``"none"`` comes first among the sides when allowed, so a smaller index is a simpler shape.
    ``None`` when a size is a strategy (then drawn as it is).
    """
    batches, lengths = _listed(batch_sizes, "batch_sizes"), _listed(seq_lens, "seq_lens")
    if batches is None or lengths is None:
        return None
    ordered = sorted(sides, key=PADDING_SIDES.index)
    return [(batch, length, side) for batch in batches for length in lengths for side in ordered]


def _listed(spec: IntsSpec | range, name: str) -> list[int] | None:
    """The values ``spec`` allows, in ascending order; ``None`` for a strategy (drawn as it is)."""
    if isinstance(spec, range):
        return list(spec)
    if isinstance(spec, SearchStrategy):
        return None
    _ints(spec, name)  # validates, with the usual message
    return [spec] if isinstance(spec, int) else sorted(set(spec))


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting attended tokens only; padded slots get 1 (``generate``'s convention)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _pad_token_id(config: PretrainedConfig) -> int | None:
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    vocab = getattr(config.get_text_config(), "vocab_size", 0) or 0
    return pad if isinstance(pad, int) and 0 <= pad < vocab else None


def tiny_configs(
    model_type: str,
    *,
    layers: IntsSpec = (1, 2, 3),
    heads: IntsSpec = (1, 2, 4),
    head_dims: IntsSpec = (8, 16),
    **fixed: Any,
) -> SearchStrategy[PretrainedConfig]:
    """Tiny configs of ``model_type`` varying layers, heads, key/value heads and hidden size.

    The hidden size is ``heads * head_dim``; key/value heads range over the divisors
    of the head count when the family has them. Keyword arguments are fixed overrides
    passed to ``tiny_config`` and win over drawn values.

    Example::

        @given(config=tiny_configs("qwen2", vocab_size=128))
        def test_builds(config): ...
    """
    base = tiny_config(model_type, **fixed)  # fail fast, outside hypothesis, on a bad type or override
    kv_key = next((key for key in KV_HEAD_KEYS if isinstance(getattr(base, key, None), int)), None)
    layer_counts, head_counts, dims = _ints(layers, "layers"), _ints(heads, "heads"), _ints(head_dims, "head_dims")

    @st.composite
    def draw_config(draw: st.DrawFn) -> PretrainedConfig:
        n_heads = draw(head_counts)
        drawn: dict[str, Any] = {
            "num_hidden_layers": draw(layer_counts),
            "num_attention_heads": n_heads,
            "hidden_size": n_heads * draw(dims),
        }
        if kv_key is not None:
            drawn[kv_key] = draw(st.sampled_from([d for d in range(1, n_heads + 1) if n_heads % d == 0]))
        # attribute_map: GPT-2 calls them n_layer, n_head, n_embd
        aliases = getattr(base, "attribute_map", {})
        overrides = {aliases.get(key, key): value for key, value in drawn.items() if hasattr(base, key)}
        return tiny_config(model_type, **{**overrides, **fixed})

    return draw_config()
