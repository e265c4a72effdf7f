"""Running the models a check compares: a seeded forward on the model's device, and the reference in float64 for the oracle policy.

``forward`` runs a model the one way every check runs it (seeded, so a model that draws in eval
mode draws the same for both sides); ``oracle_outputs`` runs a float64 copy of the reference.
What the outputs are compared with is :mod:`.outputs`'; the eval-mode block and devices are
:mod:`.devices`', full float32 precision :mod:`.precision`'."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from pytest_modelpatch.compare._engine.devices import model_device, move_inputs
from pytest_modelpatch.compare._engine.precision import ieee_float32
from pytest_modelpatch.compare._engine.tolerance import ToleranceSpec
from pytest_modelpatch.models.devices import seeded_generators

_FLOAT64_COPIES: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def oracle_outputs(reference: torch.nn.Module, inputs: Mapping[str, Any], spec: ToleranceSpec) -> Any:
    """The reference's output in float64 when ``spec`` is the ``oracle`` policy, else ``None``.

    The float64 copy is made once per reference model (it is the unpatched model, so copying
    it changes nothing global); floating inputs are cast to float64 too.
    """
    if not spec.uses_oracle:
        return None
    if reference not in _FLOAT64_COPIES:
        _FLOAT64_COPIES[reference] = copy.deepcopy(reference).to(torch.float64).eval()
    wide = {
        k: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }
    with torch.no_grad():
        return forward(_FLOAT64_COPIES[reference], wide)


FORWARD_SEED = 0


def forward(model: torch.nn.Module, inputs: Mapping[str, Any]) -> Any:
    """``model(**inputs)`` on the model's device, from the same random state every time.

    Some forwards draw random numbers even in eval mode (ViT-MAE's masking, VITS's noise):
    both models of a comparison must draw the same ones, and the caller's generator must
    not move.
    """
    device = model_device(model)
    if device.type != "cpu":
        with seeded_generators(device, FORWARD_SEED), ieee_float32():
            return model(**move_inputs(inputs, device))
    # CPU: the default generator alone; torch.manual_seed also probes every accelerator
    # backend, which costs more than a tiny model's forward
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(FORWARD_SEED)
    try:
        with ieee_float32():
            return model(**move_inputs(inputs, device))
    finally:
        generator.set_state(state)
