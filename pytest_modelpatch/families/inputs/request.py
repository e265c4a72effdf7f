"""What every input builder is given: the config, the model class, its forward's parameters."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel


@dataclass
class InputRequest:
    """One ``example_inputs`` call: sizes, the seeded generator, and what the forward takes."""

    config: PretrainedConfig
    model_class: type[PreTrainedModel]
    batch_size: int
    seq_len: int
    generator: torch.Generator
    params: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.params = forward_parameters(self.model_class)

    def takes(self, name: str) -> bool:
        """Whether the forward accepts ``name``."""
        return name in self.params

    def requires(self, name: str) -> bool:
        """Whether the forward cannot run without ``name``."""
        return required(self.model_class, name)

    def randn(self, *shape: int) -> torch.Tensor:
        """Seeded normal values."""
        return torch.randn(*shape, generator=self.generator)


def required(model_class: type[PreTrainedModel], name: str) -> bool:
    """Whether ``model_class.forward`` has ``name`` without a default."""
    parameter = _signature(model_class.forward).parameters.get(name)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def forward_parameters(model_class: type[PreTrainedModel]) -> frozenset[str]:
    """Names the model's ``forward`` accepts."""
    return frozenset(_signature(model_class.forward).parameters)


@functools.lru_cache(maxsize=256)
def _signature(forward: Any) -> inspect.Signature:
    # Keyed by the function, which a patch may replace on the class. Read for every
    # drawn input, and inspect.signature costs as much as the rest of a draw.
    return inspect.signature(forward)
