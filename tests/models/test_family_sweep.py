"""One test, several families: ``@pytest.mark.model(["llama", "gemma"])`` runs it once per model type.

A kernel is rarely written for one family: a key like ``^(Llama|Gemma)RMSNorm$`` replaces
both. Gemma's norm computes ``(1 + weight) * x``, so a Llama-style norm passes on Llama and
must fail on Gemma, and on the VLMs whose text tower is Gemma (PaliGemma).
"""

from __future__ import annotations

import pytest

SWEEP = """
import pytest
import torch
from torch import nn
from pytest_modelpatch import assert_equivalent


class LlamaStyleNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        wide = hidden_states.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * wide.to(hidden_states.dtype)


@pytest.mark.model(["llama", "gemma", "llava", "paligemma"])
# Gemma names forward's argument x, Llama hidden_states; their layers pass it by position (SIGNATURE allowed)
@pytest.mark.patch({"^(Llama|Gemma)RMSNorm$": LlamaStyleNorm}, allow={"^(Llama|Gemma)RMSNorm$": ["BROAD", "SIGNATURE"]})
def test_norm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(("llama",), num_hidden_layers=3)
def test_overrides_apply_to_every_family(reference_model):
    assert reference_model.config.get_text_config().num_hidden_layers == 3
"""


def test_a_llama_style_norm_passes_on_llama_and_llava_and_fails_on_gemma_and_paligemma(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_sweep=SWEEP)
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:xdist", "-rA")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["PASSED test_sweep.py::test_norm[[]llama[]]", "PASSED test_sweep.py::test_norm[[]llava[]]"],
                                consecutive=False)
    result.stdout.fnmatch_lines(["FAILED test_sweep.py::test_norm[[]gemma[]]*", "FAILED test_sweep.py::test_norm[[]paligemma[]]*"],
                                consecutive=False)


def test_a_sweep_that_is_not_a_list_of_model_types_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.model(["llama", "llama"])
        def test_twice(reference_model):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:xdist")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*a sweep is a list of distinct model types*"])
