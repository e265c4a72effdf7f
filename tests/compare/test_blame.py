"""A failing check names the replacement first: each replaced module replayed on its original's arguments.

The first module whose output crosses the tolerance may only amplify a difference: in bf16, a
norm without the float32 upcast shifts each hidden state by round-off, and ``lm_head`` is where the
logits cross. The report then names the norm's replacement first, in the text, the JSON row and
the HTML profile alike; a correct replacement beside a wrong one is not blamed.
"""

from __future__ import annotations

import json
import re

import pytest
from _support.runs import IN_ORDER

MODELS = """
import pytest
import torch
from torch import nn
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent
from fixtures.patches.llama_rmsnorm_autograd_broken import LlamaConstantScaleRMSNorm


class NoUpcastNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):  # in the input's dtype throughout: bf16 round-off
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class UnweightedNorm(NoUpcastNorm):
    def forward(self, hidden_states):  # forgets its weight: wrong in any dtype
        wide = hidden_states.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(hidden_states.dtype)


class FusedSwiGLU(nn.Module):
    def __init__(self, config, *args, **kwargs):
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):  # gate and up in one matmul: right, with its own round-off
        fused = nn.functional.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        gate, up = fused.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)

"""

BF16 = """
@pytest.mark.model("llama")
@pytest.mark.dtypes("bfloat16")
@pytest.mark.patch({"^LlamaRMSNorm$": NoUpcastNorm})
def test_no_upcast(reference_model, patched_model, dtype):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.dtypes("bfloat16")
@pytest.mark.tolerance(rtol=2e-3)  # tight enough that the logits cross where the hidden states do not
@pytest.mark.patch({"^LlamaRMSNorm$": NoUpcastNorm})
def test_no_upcast_tight(reference_model, patched_model, dtype):
    assert_equivalent(reference_model, patched_model)
"""

WRONG_NORM = """
@pytest.mark.model("llama")
@pytest.mark.patch({"^LlamaRMSNorm$": UnweightedNorm, "^LlamaMLP$": FusedSwiGLU})
def test_wrong_norm_beside_fused_mlp(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch({"^LlamaRMSNorm$": LlamaConstantScaleRMSNorm, "^LlamaMLP$": FusedSwiGLU})
def test_wrong_norm_backward_beside_fused_mlp(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)
"""


def _blame_line(text: str) -> str:
    found = re.search(r"replaced module whose own (?:output|gradients) differ[^\n]*", text)
    assert found is not None, text
    return found.group(0)


def _run(pytester: pytest.Pytester, tests: str) -> pytest.RunResult:
    pytester.makepyfile(test_blame=MODELS + tests)
    return pytester.runpytest(*IN_ORDER, "-rA", "--modelpatch-report", "report.json",
                              "--modelpatch-html", "profile.html")  # fmt: skip


def test_a_norm_without_upcast_in_bf16_passes_or_names_the_norm_first_never_lm_head_alone(
    pytester: pytest.Pytester,
) -> None:
    result = _run(pytester, BF16)
    rows = {r["nodeid"].split("::")[-1]: r for r in json.loads((pytester.path / "report.json").read_text())["rows"]}
    assert rows["test_no_upcast_tight[bfloat16]"]["outcome"] == "failed"
    # the default policy judges the norm's round-off as round-off where the CPU's bf16 matmuls round as
    # the tolerance assumes; where they round otherwise (AMX: one logit a fraction of an ulp over) the
    # check may fail, and then it must blame the norm as the tight one does
    failing = [test for test, row in rows.items() if row["outcome"] == "failed"]
    result.assert_outcomes(passed=2 - len(failing), failed=len(failing))
    text = result.stdout.str()
    for test in failing:
        failure = text[text.index(f"_ {test} _") :]
        blame = _blame_line(failure)
        assert blame.startswith("replaced module whose own output differs, within tolerance alone: model.layers.0."), (
            blame
        )
        assert "NoUpcastNorm" in blame and failure.index(blame) < failure.index("first diverging module: lm_head")
        # the row and the page name what the text does
        assert (
            rows[test]["blamed"][0] == "model.layers.0.input_layernorm" and rows[test]["first_diverging"] == "lm_head"
        )
    page = (pytester.path / "profile.html").read_text()
    assert "replaced module whose own output differs: <code>model.layers.0.input_layernorm," in page
    assert "first diverging module: <code>lm_head</code>" in page


def test_a_wrong_norm_is_blamed_and_the_correct_fused_mlp_beside_it_is_not(pytester: pytest.Pytester) -> None:
    result = _run(pytester, WRONG_NORM)
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    for test, kind in (("test_wrong_norm_beside_fused_mlp", "output"), ("test_wrong_norm_backward_beside_fused_mlp",
                                                                        "gradients")):  # fmt: skip
        blame = _blame_line(text[text.index(f"_ {test} _") :])
        assert blame.startswith(f"replaced module whose own {kind} differ"), blame
        assert "layernorm" in blame or "model.norm" in blame, blame
        assert "mlp" not in blame and "FusedSwiGLU" not in blame, blame
    rows = {r["nodeid"].split("::")[-1]: r for r in json.loads((pytester.path / "report.json").read_text())["rows"]}
    assert rows["test_wrong_norm_beside_fused_mlp"]["blamed"][0] == "model.layers.0.input_layernorm"
    assert not [name for name in rows["test_wrong_norm_backward_beside_fused_mlp"]["blamed"] if "mlp" in name]
