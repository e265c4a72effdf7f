"""Inputs for audio language models: audio for the audio tower, its placeholders spliced into text.

Each model scatters the audio tower's output into the positions of one placeholder token and
checks that the counts agree, so every builder here counts the embeddings the tower will
yield (with the modeling module's own length rule where it has one) and splices that many
placeholders into every row's text, after two ordinary tokens.
"""

from __future__ import annotations

import sys

import torch

from pytest_modelpatch.errors import ModelPatchError
from pytest_modelpatch.models.inputs.audio import mel_features_for
from pytest_modelpatch.models.inputs.request import InputRequest
from pytest_modelpatch.models.inputs.text import text_inputs

AUDIO_TOKENS = 4  # audio embeddings per row: enough that a patch of the tower shows, few enough to stay cheap
TEXT_PREFIX = 2  # ordinary tokens before the first placeholder run, as a chat template puts a role first


def spliced_ids(request: InputRequest, *runs: tuple[str, int]) -> dict[str, torch.Tensor]:
    """Random text with runs of placeholders, ``(config key of the token id, count)``, after
    its first two tokens, every position attended."""
    config = request.config
    placeholders = []
    for key, count in runs:
        token_id = getattr(config, key, None)
        if not isinstance(token_id, int) or isinstance(token_id, bool) or count < 1:
            raise ModelPatchError(
                f"example_inputs cannot splice {count} audio placeholders into {config.model_type}'s text: "
                f"its config's {key} is {token_id!r}; set it to a token id or pass inputs= explicitly"
            )
        placeholders.append(torch.full((request.batch_size, count), token_id, dtype=torch.long))
    text = text_inputs(config, request.batch_size, request.seq_len, request.generator)["input_ids"]
    ids = torch.cat([text[:, :TEXT_PREFIX], *placeholders, text[:, TEXT_PREFIX:]], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def qwen3_asr_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Qwen3-ASR: one clip per row, as many placeholders as the encoder yields (the modeling
    module's own length formula)."""
    config = request.config
    audio = mel_features_for(request, config.audio_config)
    frames = audio["input_features"].shape[-1]
    lengths = sys.modules[request.model_class.__module__]._get_feat_extract_output_lengths
    count = int(lengths(torch.tensor(frames), config.audio_config.n_window))
    return {**spliced_ids(request, ("audio_token_id", count)), **audio}
