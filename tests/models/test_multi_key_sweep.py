"""A sweep over several keys: a Liger-style norm and MLP, each key applying where its class is built.

``{"^(Llama|Qwen2|Mistral)RMSNorm$": ..., "^(Llama|Qwen2|Mistral)MLP$": ...}`` reaches Llama,
Mistral, Qwen2 and the models built on them. Qwen2-VL's text model builds ``Qwen2MLP`` but its own
norm, so there the norm key replaces nothing and only the MLP key is linted and checked; Qwen2.5-VL's
vision tower defines a copied ``Qwen2MLP`` it never builds, so it is not swept at all. The runs pick a
handful of the ~35 families the mapping reaches (every one costs a tiny model on 2 busy cores), the
ones where a key replaces nothing among them.
"""

from __future__ import annotations

import pytest
from _support.runs import IN_ORDER

LIGER = """
import pytest
import torch
from torch import nn
from pytest_modelpatch import assert_equivalent


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        wide = hidden_states.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * wide.to(hidden_states.dtype)


class SwiGLU(nn.Module):
    def __init__(self, config, *args, **kwargs):
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj({activation}(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.model(families="patched")
@pytest.mark.patch({{"^(Llama|Qwen2|Mistral)RMSNorm$": RMSNorm, "^(Llama|Qwen2|Mistral)MLP$": SwiGLU}})
def test_liger(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(families="patched")
@pytest.mark.patch({{"^(Llama|Qwen2|Mistral)MLP$": SwiGLU}})
def test_mlp(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""

# the first four build one class of the two: the norm key replaces nothing there
CHOSEN = ("qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text", "llama", "mistral", "qwen2", "llava")
NEVER_BUILT = ("qwen2_5_vl_vision", "hyperclovax_vision_v2")  # define a copied Qwen2MLP, build none


def _chosen(test: str) -> list[str]:
    return [f"test_liger.py::{test}[{family}]" for family in CHOSEN]


# the MLP key alone, on the Qwen2-VL text models, which build Qwen2MLP under their own norm
MLP_ALONE = [f"test_liger.py::test_mlp[{family}]" for family in ("qwen2_vl_text", "qwen2_5_vl_text")]


@pytest.mark.parametrize("activation, outcome", [("nn.functional.silu", "passed"), ("nn.functional.gelu", "failed")])
def test_a_norm_and_mlp_sweep_gives_no_errors_where_one_key_replaces_nothing(
    pytester: pytest.Pytester, activation: str, outcome: str
) -> None:
    pytester.makepyfile(test_liger=LIGER.format(activation=activation))
    result = pytester.runpytest(*IN_ORDER, "-rA", *_chosen("test_liger"), *MLP_ALONE)
    # errors=0: assert_outcomes counts every outcome it is not given as 0
    result.assert_outcomes(**{outcome: len(CHOSEN) + len(MLP_ALONE)})
    for test in [*_chosen("test_liger"), *MLP_ALONE]:
        result.stdout.fnmatch_lines([f"{outcome.upper()} {test.replace('[', '[[]')}*"], consecutive=False)
    if outcome == "failed":  # the broken MLP is found on numbers, in the Qwen2-VL text models too
        result.stdout.fnmatch_lines(["*first diverging module: *mlp*"])
    assert "NO_MATCH" not in result.stdout.str() and "PatchNotAppliedError" not in result.stdout.str()


def test_a_family_that_never_builds_the_class_is_not_swept(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_liger=LIGER.format(activation="nn.functional.silu"))
    collected = pytester.runpytest(*IN_ORDER, "--collect-only", "-q")
    lines = collected.stdout.str()
    assert "errors" not in lines and "test_liger.py::test_mlp[qwen2_5_vl]" in lines, lines
    for family in NEVER_BUILT:
        assert f"[{family}]" not in lines


STRICT = """
import pytest
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, config, *args, **kwargs):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


MAPPING = {"^(Llama|Qwen2|Mistral)RMSNorm$": SwiGLU, "^(Llama|Qwen2|Mistral)MLP$": SwiGLU}


@pytest.mark.model("qwen2_vl_text")
@pytest.mark.patch(MAPPING)
def test_alone(patched_model):
    pass


@pytest.mark.model("qwen2_vl_text")
@pytest.mark.patch(MAPPING, allow={"^(Llama|Qwen2|Mistral)RMSNorm$": ["NO_MATCH"]})
def test_alone_allowed(patched_model):
    pass
"""


def test_named_alone_a_key_that_replaces_nothing_is_a_finding_and_its_suggested_allow_works(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_strict=STRICT)
    result = pytester.runpytest(*IN_ORDER, "-rA")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*[[]NO_MATCH[]] pattern '^(Llama|Qwen2|Mistral)RMSNorm$' matches no class in *qwen2_vl*",
        "*allow={'^(Llama|Qwen2|Mistral)RMSNorm$': [[]'NO_MATCH'[]]}*",
    ], consecutive=False)  # fmt: skip
    result.stdout.fnmatch_lines(["PASSED test_strict.py::test_alone_allowed*"], consecutive=False)
    assert "PatchNotAppliedError" not in result.stdout.str()


TYPO = """
import pytest
from torch import nn


@pytest.mark.model(families="patched")
@pytest.mark.patch({{"^MistralMLP$": nn.Identity, "^MistralRMSNrom$": nn.Identity}}{allow})
def test_typo(reference_model):
    pass
"""


def test_in_a_sweep_a_key_that_replaces_nothing_anywhere_is_a_usage_error_with_a_fix_that_works(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_typo=TYPO.format(allow=""))
    # a usage error found at collection fails its own test at setup, with the message
    result = pytester.runpytest(*IN_ORDER, "-q")
    assert result.parseoutcomes().get("errors") == 1, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*'^MistralRMSNrom$' replace(s) no class of any family this sweep runs*"
            "@pytest.mark.patch(..., allow={'^MistralRMSNrom$': [[]'NO_MATCH'[]]})*"
        ]
    )
    pytester.makepyfile(test_typo=TYPO.format(allow=", allow={'^MistralRMSNrom$': ['NO_MATCH']}"))
    followed = pytester.runpytest(*IN_ORDER, "--collect-only", "-q")
    followed.stdout.fnmatch_lines(["test_typo.py::test_typo[[]mistral[]]"], consecutive=False)
    assert "error" not in followed.stdout.str()
