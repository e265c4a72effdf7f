"""The inputs a check runs on when none are given, and how a report writes inputs down."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import model_device
from pytest_modelpatch.compare._engine.outputs import _describe_leaf, flatten_outputs
from pytest_modelpatch.isolation.pristine import running_pristine


def default_inputs(model: torch.nn.Module) -> dict[str, Any]:
    """Example inputs drawn from the model's config, on its device.

    Read in the pristine world: the inputs follow the unpatched class's ``forward`` signature,
    not a patch's (a replacement ``forward(self, *args, **kwargs)`` would drop the named inputs).
    """
    from pytest_modelpatch.families.inputs import example_inputs

    with running_pristine():
        return example_inputs(model.config, device=str(model_device(model)), model_class=type(model))


def describe_inputs(inputs: Mapping[str, Any], limit: int = 64) -> str:
    """``input_ids=[[5, 1, 9]], attention_mask=...``: values when small, shape and dtype when not."""
    parts = []
    for path, leaf in flatten_outputs(dict(inputs), caches=False):
        small = isinstance(leaf, torch.Tensor) and leaf.numel() <= limit
        parts.append(f"{path}={leaf.tolist() if small else _describe_leaf(leaf)}")
    return ", ".join(parts)
