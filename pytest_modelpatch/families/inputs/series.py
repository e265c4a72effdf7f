"""Time-series inputs: past values with their masks and covariates, at the config's lengths.

Three shapes of model: GluonTS-style encoder-decoders (Time Series Transformer,
Informer, Autoformer) read ``context_length + max(lags_sequence)`` past steps plus time
features and predict ``prediction_length`` future steps; patch models (PatchTST,
PatchTSMixer) read ``(batch, context_length, channels)``; TimesFM reads univariate
series of whole patches.
"""

from __future__ import annotations

import torch

from pytest_modelpatch.families.inputs.request import InputRequest

TIMESFM_PATCHES = 2  # patches of history per TimesFM series


def series_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """Past values (and whatever the forward needs beside them) for a forecasting model."""
    config = request.config
    if getattr(config, "lags_sequence", None):
        return _lagged_inputs(request)
    if getattr(config, "num_input_channels", None) and getattr(config, "context_length", None):
        values = request.randn(request.batch_size, config.context_length, config.num_input_channels)
        return {"past_values": values}
    if getattr(config, "patch_length", None) and getattr(config, "horizon_length", None):
        return _timesfm_inputs(request)
    return None


def _timesfm_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    """Whole patches of history, nothing padded (padding 1 = a padded step), frequency class 0."""
    batch, steps = request.batch_size, TIMESFM_PATCHES * request.config.patch_length
    inputs = {"past_values": request.randn(batch, steps)}
    if request.takes("past_values_padding"):
        inputs["past_values_padding"] = torch.zeros(batch, steps)
    if request.takes("freq"):
        inputs["freq"] = torch.zeros(batch, 1, dtype=torch.long)
    return inputs


def _lagged_inputs(request: InputRequest) -> dict[str, torch.Tensor]:
    config, batch = request.config, request.batch_size
    past = config.context_length + max(config.lags_sequence)
    future = config.prediction_length
    size = config.input_size
    series = (size,) if size > 1 else ()
    inputs = {
        "past_values": request.randn(batch, past, *series),
        "past_time_features": request.randn(batch, past, config.num_time_features),
        "past_observed_mask": torch.ones(batch, past, *series),
        "future_values": request.randn(batch, future, *series),
        "future_time_features": request.randn(batch, future, config.num_time_features),
    }
    if config.num_static_categorical_features:
        cardinality = torch.tensor(config.cardinality)
        picks = torch.rand(batch, len(config.cardinality), generator=request.generator)
        inputs["static_categorical_features"] = (picks * cardinality).long()
    if config.num_static_real_features:
        inputs["static_real_features"] = request.randn(batch, config.num_static_real_features)
    return inputs
