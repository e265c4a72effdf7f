"""Blame lands on the module that introduced a difference, also when it did so by mutating its input."""

from __future__ import annotations

import pytest


def test_a_norm_that_normalises_its_input_in_place_is_named_not_its_decoder_layer(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from pytest_modelpatch import assert_equivalent


class InPlaceRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        # in place: its own output is right, but the caller's residual (the same tensor) is rescaled too
        hidden_states.mul_(torch.rsqrt(variance + self.variance_epsilon))
        return self.weight * hidden_states


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaRMSNorm": InPlaceRMSNorm})
def test_in_place(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*first diverging module: model.layers.0.input_layernorm (LlamaRMSNorm in the reference, InPlaceRMSNorm*",
            "*it changes its input args[[]0[]] in place, which the original does not*",
        ]
    )
