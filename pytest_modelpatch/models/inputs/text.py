"""Token inputs: ids inside the ordinary vocabulary, masks, segment and decoder ids."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel

from pytest_modelpatch.errors import ModelPatchError
from pytest_modelpatch.models.inputs.request import InputRequest, forward_parameters
from pytest_modelpatch.models.tiny_configs import special_token_ids


def text_request_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` for ``request``."""
    return text_inputs(request.config, request.batch_size, request.seq_len, request.generator)


def text_companions(
    config: PretrainedConfig, model_class: type[PreTrainedModel], input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Inputs that go with ``input_ids``: segment ids for encoders, decoder ids for encoder-decoders."""
    params = forward_parameters(model_class)
    extra: dict[str, torch.Tensor] = {}
    if "token_type_ids" in params and getattr(config.get_text_config(), "type_vocab_size", 0):
        extra["token_type_ids"] = torch.zeros_like(input_ids)
    if config.is_encoder_decoder and "decoder_input_ids" in params:
        extra["decoder_input_ids"] = input_ids.clone()
    return extra


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
