"""Token inputs: ids inside the ordinary vocabulary, masks, segment and decoder ids."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers import PretrainedConfig, PreTrainedModel

from pytest_modelpatch.errors import ModelPatchError
from pytest_modelpatch.families.inputs.request import InputRequest, forward_parameters
from pytest_modelpatch.families.shrink.configs import special_token_ids


def text_request_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` for ``request``."""
    return text_inputs(request.config, request.batch_size, request.seq_len, request.generator)


def text_companions(
    config: PretrainedConfig, model_class: type[PreTrainedModel], input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Inputs that go with ``input_ids``: segment ids for encoders, decoder ids for encoder-decoders."""
    params = forward_parameters(model_class)
    extra: dict[str, torch.Tensor] = {}
    if "token_type_ids" in params and getattr(config.get_text_config(), "type_vocab_size", None):
        extra["token_type_ids"] = torch.zeros_like(input_ids)
    if config.is_encoder_decoder and "decoder_input_ids" in params:
        extra["decoder_input_ids"] = input_ids.clone()
    unnamed = KWARG_COMPANIONS.get(config.model_type)
    if unnamed is not None:
        extra.update(unnamed(config, model_class))
    return extra


# Voxtral Realtime's parent model conditions every text layer on the audio delay
# (``default_num_delay_tokens``, 6 by default), handed down through ``**kwargs``.
VOXTRAL_DELAY_TOKENS = 6


def _delay_condition(config: PretrainedConfig, model_class: type[PreTrainedModel]) -> dict[str, torch.Tensor]:
    """``t_cond`` as ``VoxtralRealtimeModel`` computes it, with its own time embedding: without it the text model
    run alone cannot run."""
    embedding = sys.modules[model_class.__module__].VoxtralRealtimeTimeEmbedding(config.hidden_size)
    condition = embedding(torch.full((1,), float(VOXTRAL_DELAY_TOKENS)))[None]  # (1, hidden): broadcast over the batch
    # a loaded model's config holds its dtype; the condition feeds a Linear, so it must match
    dtype = getattr(config, "dtype", None)
    return {"t_cond": condition.to(dtype) if isinstance(dtype, torch.dtype) and dtype.is_floating_point else condition}


# model type -> inputs its layers read from ``**kwargs``, which no forward signature names
KWARG_COMPANIONS: dict[str, Callable[[PretrainedConfig, type[PreTrainedModel]], dict[str, torch.Tensor]]] = {
    "voxtral_realtime_text": _delay_condition,
}


def text_inputs(
    config: PretrainedConfig, batch_size: int, seq_len: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random ``input_ids`` over the ordinary tokens of the vocabulary, all attended."""
    allowed = ordinary_token_ids(config)
    picks = torch.randint(len(allowed), (batch_size, seq_len), generator=generator)
    return {
        "input_ids": allowed[picks],
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
    }


def ordinary_token_ids(config: PretrainedConfig) -> torch.Tensor:
    """Token ids below the text vocab size that no ``*_token_id`` key of the config names.

    Multimodal models treat image/audio placeholder ids specially, so random text
    must avoid them.
    """
    vocab = int(getattr(config.get_text_config(), "vocab_size", 0) or 0)
    if vocab <= 0:
        raise ModelPatchError(f"{type(config).__name__} has no vocab_size: pass inputs= explicitly")
    special = special_token_ids(config.to_dict())
    ids = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    return ids if len(ids) else torch.arange(vocab)
