"""One test, several families: ``@pytest.mark.model(["llama", "gemma"])`` runs it once per model type.

A kernel is rarely written for one family: a key like ``^(Llama|Gemma)RMSNorm$`` replaces
both. Gemma's norm computes ``(1 + weight) * x``, so a Llama-style norm passes on Llama and
must fail on Gemma, and on the VLMs whose text tower is Gemma (PaliGemma).
"""

from __future__ import annotations

import json

import pytest
from _support.runs import IN_ORDER

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

    def forward(self, {name}):
        wide = {name}.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * wide.to({name}.dtype)


# Gemma names forward's argument x, Llama and Mistral hidden_states; every layer passes it by position
@pytest.mark.model(["llama", "mistral", "llava", "gemma", "paligemma"])
@pytest.mark.patch({{"^(Llama|Mistral|Gemma)RMSNorm$": LlamaStyleNorm}})
def test_norm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(("llama",), num_hidden_layers=3)
def test_overrides_apply_to_every_family(reference_model):
    assert reference_model.config.get_text_config().num_hidden_layers == 3
"""


@pytest.mark.parametrize("name", ["hidden_states", "x"])
def test_a_llama_style_norm_passes_on_llama_mistral_llava_and_fails_on_the_gemmas_on_numbers(
    pytester: pytest.Pytester, name: str
) -> None:
    # whatever the norm calls its tensor, the lint lets it through: the Gemma rows fail on (1 + weight)
    pytester.makepyfile(test_sweep=SWEEP.format(name=name))
    result = pytester.runpytest(*IN_ORDER, "-rA")
    result.assert_outcomes(passed=4, failed=2)
    for family in ("llama", "mistral", "llava"):
        result.stdout.fnmatch_lines([f"PASSED test_sweep.py::test_norm[[]{family}[]]"], consecutive=False)
    for family in ("gemma", "paligemma"):
        result.stdout.fnmatch_lines(
            [f"FAILED test_sweep.py::test_norm[[]{family}[]] - AssertionError*"], consecutive=False
        )
    result.stdout.fnmatch_lines(["*first diverging module: *layers.0.input_layernorm (GemmaRMSNorm*"])
    assert "SIGNATURE" not in result.stdout.str() and "PatchUsageError" not in result.stdout.str()


def test_a_sweep_that_is_not_a_list_of_model_types_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.model(["llama", "llama"])
        def test_twice(reference_model):
            pass
        """
    )
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*a sweep is a list of distinct model types*"])


PATCHED_SWEEP = """
import pytest
from fixtures.patches.mechanisms import GemmaStyleNorm, LlamaStyleNorm
from pytest_modelpatch import assert_equivalent


@pytest.mark.model(families="patched")
@pytest.mark.patch({"^GemmaRMSNorm$": LlamaStyleNorm})
def test_llama_norm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(families="patched")
@pytest.mark.patch({"^GemmaRMSNorm$": GemmaStyleNorm})
def test_gemma_norm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_families_patched_runs_every_family_the_mapping_reaches_towers_included(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_patched=PATCHED_SWEEP)
    result = pytester.runpytest(*IN_ORDER, "-rA", "--modelpatch-report", "report.json")
    # GemmaRMSNorm runs in Gemma, in PaliGemma's text tower and in Pi0's (a PaliGemma)
    result.assert_outcomes(passed=3, failed=3)
    for family in ("gemma", "paligemma", "pi0"):
        result.stdout.fnmatch_lines([f"PASSED test_patched.py::test_gemma_norm[[]{family}[]]"], consecutive=False)
        result.stdout.fnmatch_lines([f"FAILED test_patched.py::test_llama_norm[[]{family}[]]*"], consecutive=False)
    # the sweep's summary: one line per swept test, the failing families named with where they diverge
    result.stdout.fnmatch_lines([
        "*modelpatch sweeps*",
        "test_patched.py::test_gemma_norm: passes on 3 families*",
        "test_patched.py::test_llama_norm: fails on 3 families: gemma, paligemma, pi0 (replaced module whose own output "
        "differs: *GemmaRMSNorm in the reference, LlamaStyleNorm*",
    ], consecutive=False)  # fmt: skip
    sweeps = json.loads((pytester.path / "report.json").read_text())["sweeps"]
    assert {family: o["outcome"] for family, o in sweeps["test_patched.py::test_llama_norm"].items()} == dict.fromkeys(
        ("gemma", "paligemma", "pi0"), "failed"
    )
    assert "GemmaRMSNorm" in sweeps["test_patched.py::test_llama_norm"]["gemma"]["divergence"]


def test_families_all_runs_every_family_and_skips_the_documented_ones_with_their_reason(
    pytester: pytest.Pytester,
) -> None:
    from pytest_modelpatch.families.catalog import available_model_types

    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.model(families="all")
        def test_builds(reference_model):
            assert reference_model.config.model_type
        """
    )
    collected = pytester.runpytest(*IN_ORDER, "--collect-only", "-q")
    assert f"{len(available_model_types())} tests collected" in collected.stdout.str()
    chosen = [f"test_families_all_runs_every_family_and_skips_the_documented_ones_with_their_reason.py::test_builds[{family}]"
              for family in ("bark", "dinat", "mistral")]  # fmt: skip
    result = pytester.runpytest(*IN_ORDER, "-rs", *chosen)
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*bark does not run here (inputs): `BarkModel` has no forward*",
                                 "*dinat does not run here (build): needs natten*"], consecutive=False)  # fmt: skip


UNRESOLVABLE = {
    "no_mapping": ('@pytest.mark.model(families="patched")', "*this test has no class mapping or method patch*"),
    "no_match": ('@pytest.mark.model(families="patched")\n'
                 '@pytest.mark.patch({"^NoSuchNorm$": object}, allow={"^NoSuchNorm$": ["NO_MATCH"]})',
                 "*replace no class of any family*"),
    "unknown": ('@pytest.mark.model(families="some")', "*a sweep is one of 'patched', 'all', or a list of model types*"),
    "both": ('@pytest.mark.model("llama", families="all")', "*families= chooses the model types; drop the positional 'llama'*"),
}  # fmt: skip


def test_a_families_sweep_that_cannot_be_resolved_is_a_usage_error_naming_the_test(pytester: pytest.Pytester) -> None:
    # one session, a file per case: each file's collection error stands alone
    pytester.makepyfile(**{f"test_{case}": f"import pytest\n\n\n{marks}\ndef test_swept(reference_model):\n    pass\n"
                           for case, (marks, _) in UNRESOLVABLE.items()})  # fmt: skip
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(errors=len(UNRESOLVABLE))
    for case, (_, message) in UNRESOLVABLE.items():
        result.stdout.fnmatch_lines(
            [f"PatchUsageError: @pytest.mark.model on test_{case}.py::test_swept: {message}"], consecutive=False
        )
    assert "_caller.py" not in result.stdout.str()  # the message, not a traceback through pluggy and the plugin


def test_patched_families_follow_the_lint_index_and_the_towers() -> None:
    from pytest_modelpatch.models.sweeps import sweep_families

    swept = {f.model_type for f in sweep_families("patched", ["^(Llama|Gemma)RMSNorm$"])}
    assert {"llama", "gemma", "llava", "paligemma"} <= swept
    assert not {"mistral", "bert", "gemma2", "qwen2"} & swept  # their own norms, which the key does not match
    assert {f.model_type for f in sweep_families("patched", ["Qwen3MoeSparseMoeBlock"])} == {"qwen3_moe"}


def test_the_sweep_summary_counts_passes_and_names_failures_with_the_first_divergence() -> None:
    from pytest_modelpatch.reporting.report import sweep_lines

    where = "first diverging module: model.norm (GemmaRMSNorm in the reference, LlamaStyleNorm in the patched model)"
    families = {f: ("passed", "") for f in ("llama", "mistral", "qwen2", "phi3")}
    families |= {"gemma": ("failed", where), "paligemma": ("failed", ""), "bark": ("skipped", "")}
    assert sweep_lines({"t.py::test_norm": families}) == [
        f"t.py::test_norm: passes on 4 families; fails on 2 families: gemma, paligemma ({where}); skips 1 family: bark"
    ]
    # families transformers refuses are counted apart, their refusals in short (the class that said it dropped)
    refused = {f"f{i}": ("not applicable", f"F{i}Model does not support an attention implementation through sdpa yet. "
                                           "Please request it.") for i in range(4)}  # fmt: skip
    refused["g"] = ("not applicable", "GModel does not support setting experts implementation.")
    assert sweep_lines({"t.py::test_sdpa": {"llama": ("passed", ""), **refused}}) == [
        "t.py::test_sdpa: passes on 1 family: llama; not applicable on 5 families (4: does not support an attention "
        "implementation through sdpa yet; 1: does not support setting experts implementation)"
    ]


NOT_APPLICABLE = """
import pytest
from pytest_modelpatch import assert_equivalent


def checkpointing(model):
    model.gradient_checkpointing_enable()  # transformers refuses it where a model has none (CTRL)


def own_refusal(model):
    raise ValueError("this transform does not support anything")  # the user's own error: not transformers' refusal


@pytest.mark.model(["llama", "xlm"])
@pytest.mark.patch(attn_implementation="sdpa")
def test_sdpa(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(["qwen3_moe", "llama"])
@pytest.mark.patch(experts_implementation="grouped_mm")
def test_grouped_mm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(["llama", "ctrl"])
@pytest.mark.patch(transform=checkpointing)
def test_checkpointing(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model(["llama"])
@pytest.mark.patch(transform=own_refusal)
def test_own_refusal(reference_model, patched_model):
    pass


@pytest.mark.model("xlm")
@pytest.mark.patch(attn_implementation="sdpa")
def test_xlm_alone(reference_model, patched_model):
    pass
"""

SDPA_REFUSAL = (
    "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention yet"
)


def test_a_refused_implementation_is_not_applicable_in_a_sweep_and_an_error_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_refused=NOT_APPLICABLE)
    result = pytester.runpytest(*IN_ORDER, "-rsE", "--modelpatch-report", "report.json")
    # swept: llama passes twice, qwen3_moe once; xlm (sdpa), llama (grouped_mm) and ctrl (checkpointing) are
    # skipped with transformers' reason; alone, xlm errors, and so does the user's own ValueError in a sweep
    result.assert_outcomes(passed=3, skipped=3, errors=2)
    result.stdout.fnmatch_lines([
        f"SKIPPED [[]1[]] *: not applicable: XLMWithLMHeadModel {SDPA_REFUSAL}. Please request the support*",
        "SKIPPED [[]1[]] *: not applicable: LlamaForCausalLM does not support setting experts implementation.",
        "SKIPPED [[]1[]] *: not applicable: CTRLLMHeadModel does not support activation checkpointing.",
    ], consecutive=False)  # fmt: skip
    result.stdout.fnmatch_lines([
        "*modelpatch sweeps*",
        "test_refused.py::test_checkpointing: passes on 1 family: llama; not applicable on 1 family: ctrl "
        "(does not support activation checkpointing)",
        "test_refused.py::test_grouped_mm: passes on 1 family: qwen3_moe; not applicable on 1 family: llama "
        "(does not support setting experts implementation)",
        "test_refused.py::test_own_refusal: fails on 1 family: llama",
        f"test_refused.py::test_sdpa: passes on 1 family: llama; not applicable on 1 family: xlm ({SDPA_REFUSAL})",
    ], consecutive=False)  # fmt: skip
    result.stdout.fnmatch_lines([
        f"E*pytest_modelpatch.errors.NotApplicableError: test_refused.py::test_xlm_alone: transformers refuses what this "
        f"test asks of the model: XLMWithLMHeadModel {SDPA_REFUSAL}.*",
        "E*This family cannot take the patch. Swept over families*",
        "*ERROR test_refused.py::test_own_refusal[[]llama[]] - ValueError*",
    ], consecutive=False)  # fmt: skip
    sweeps = json.loads((pytester.path / "report.json").read_text())["sweeps"]
    assert sweeps["test_refused.py::test_sdpa"]["xlm"]["outcome"] == "not applicable"
    assert sweeps["test_refused.py::test_sdpa"]["xlm"]["reason"].startswith(f"XLMWithLMHeadModel {SDPA_REFUSAL}.")
