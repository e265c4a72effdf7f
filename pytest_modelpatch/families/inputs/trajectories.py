"""Offline reinforcement-learning trajectories: states, actions, returns-to-go and timesteps."""

from __future__ import annotations

import torch

from pytest_modelpatch.families.inputs.request import InputRequest


def trajectory_inputs(request: InputRequest) -> dict[str, torch.Tensor] | None:
    """Decision Transformer: one trajectory of ``seq_len`` steps per row, every step attended."""
    config, batch, steps = request.config, request.batch_size, request.seq_len
    if not (getattr(config, "state_dim", None) and getattr(config, "act_dim", None)):
        return None
    timesteps = torch.arange(steps).repeat(batch, 1) % getattr(config, "max_ep_len", steps)
    return {
        "states": request.randn(batch, steps, config.state_dim),
        "actions": request.randn(batch, steps, config.act_dim).tanh(),  # tanh-squashed, like the policy's
        "rewards": request.randn(batch, steps, 1),
        "returns_to_go": request.randn(batch, steps, 1),
        "timesteps": timesteps,
        "attention_mask": torch.ones(batch, steps, dtype=torch.long),
    }
