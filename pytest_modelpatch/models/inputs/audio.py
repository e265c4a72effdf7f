"""Audio inputs: log-mel ``input_features`` and raw ``input_values`` waveforms."""

from __future__ import annotations

import torch

from pytest_modelpatch.models.inputs.request import InputRequest

WAVEFORM_SAMPLES = 4000


def mel_features(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """Whisper-style features: two stride-2 convolutions need ``2 * max_source_positions`` frames."""
    config = request.config
    if not hasattr(config, "max_source_positions"):
        return None
    frames = 2 * config.max_source_positions
    return {"input_features": request.randn(request.batch_size, config.num_mel_bins, frames)}


def waveform(request: InputRequest) -> dict[str, torch.Tensor]:
    """wav2vec2-style raw audio."""
    return {"input_values": request.randn(request.batch_size, WAVEFORM_SAMPLES)}
