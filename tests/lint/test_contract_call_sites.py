"""SIGNATURE judges what transformers' calls pass, not the original's parameter names.

transformers 5.24 names the norm's argument ``x`` in Gemma and ``hidden_states`` in Llama, and
every layer passes it by position: a kernel written once binds in both. What does not bind is
a keyword a call writes out that the replacement lacks, and a required parameter that no
argument written out supplies (``**kwargs`` swallows ``hidden_states=``, ``x`` stays unbound).
The audit sample at the end checks the lint against real runs of tiny models.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconAttention
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM

from benchmarks.lint_audit import identity_outcome, lint_pair, role_pairs, run_pair
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.lint.findings import Finding, Kind
from pytest_modelpatch.lint.model_structures import meta_structures
from pytest_modelpatch.lint.patterns import lint_for_registration, lint_patterns
from pytest_modelpatch.lint.scan_index import load_index
from pytest_modelpatch.models.specs import config_families

NORMS = "^(Llama|Gemma)RMSNorm$"


class HiddenStatesNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.weight * hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)


class XNorm(HiddenStatesNorm):
    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return super().forward(x)


class TwoTensorNorm(HiddenStatesNorm):
    """BROKEN: requires a second tensor no layer passes."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states + residual)


class XAttention(LlamaAttention):
    """BROKEN: LlamaDecoderLayer calls self_attn(hidden_states=..., ...); **kwargs swallows it, x stays unbound."""

    def forward(self, x: Any, position_embeddings: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
        return super().forward(x, position_embeddings, attention_mask, **kwargs)


def signature(mapping: dict[str, type], family: str) -> list[Finding]:
    return lint_patterns(
        mapping, families=[family], checks=("signature",), structures=None
    )  # no model built: every call


def kinds(findings: list[Finding]) -> list[str]:
    return [str(f.kind) for f in findings]


@pytest.mark.parametrize("norm", [HiddenStatesNorm, XNorm], ids=["hidden_states", "x"])
@pytest.mark.parametrize("family", ["llama", "gemma", "mistral", "paligemma"])
def test_a_norm_binds_in_every_family_whatever_it_names_its_tensor(norm: type, family: str) -> None:
    key = "^(Llama|Mistral|Gemma)RMSNorm$"
    families = config_families(tiny_config(family))  # as the patch marker lints: PaliGemma with its Gemma tower
    findings = lint_patterns({key: norm}, families=families, checks=("signature",), structures=None)
    assert set(kinds(findings)) <= {"RENAMED_PARAMETER"}  # a note, never a failing kind or a warning
    lint_for_registration({key: norm}, families=families, structures=meta_structures)


def test_a_renamed_positional_parameter_is_a_note_naming_both_names() -> None:
    notes = signature({NORMS: XNorm}, "llama")
    assert kinds(notes) == ["RENAMED_PARAMETER"]
    assert "forward names 'x' where LlamaRMSNorm.forward has 'hidden_states'" in notes[0].message
    assert "every call the lint reads passes it by position, so it binds" in notes[0].message
    assert notes[0].suggestion == "hidden_states"


def test_a_required_parameter_no_layer_passes_is_refused_at_the_layer_that_calls_it() -> None:
    findings = signature({NORMS: TwoTensorNorm}, "gemma")
    assert kinds(findings) == ["RENAMED_PARAMETER", "SIGNATURE"]  # __init__'s hidden_size is Gemma's dim: a note
    finding = findings[1]
    assert "GemmaDecoderLayer (transformers.models.gemma.modeling_gemma, line " in finding.message
    assert "calls it with (<0>): missing a required argument: 'residual'" in finding.message


def test_a_forward_renaming_what_the_layer_passes_by_keyword_is_refused_naming_that_call() -> None:
    (finding,) = signature({"LlamaAttention": XAttention}, "llama")
    assert finding.kind is Kind.SIGNATURE
    assert "LlamaDecoderLayer (transformers.models.llama.modeling_llama, line " in finding.message
    assert "calls it with (hidden_states=..., " in finding.message
    assert "missing a required argument: 'x'" in finding.message
    assert finding.suggestion.startswith("LlamaAttention.forward(hidden_states, ")


def test_the_same_forward_fails_at_run_time_as_the_finding_says() -> None:
    from transformers.monkey_patching import apply_patches, register_patch_mapping

    from pytest_modelpatch.isolation.guard import isolated_patch_state

    with isolated_patch_state():
        register_patch_mapping({"LlamaAttention": XAttention})
        with apply_patches():
            model = LlamaForCausalLM(tiny_config("llama"))
    with pytest.raises(TypeError, match=r"XAttention.forward\(\) missing 1 required positional argument: 'x'"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_renamed_tensor_swallowed_by_kwargs_is_not_an_unused_argument() -> None:
    # LlamaRMSNorm.forward reads hidden_states; XNorm takes it as x by position, **kwargs swallows nothing
    assert Kind.UNUSED_ARGUMENT not in {f.kind for f in signature({NORMS: XNorm}, "llama")}


class RenamedConfig(LlamaForCausalLM):
    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)


class ExtraRequired(LlamaForCausalLM):
    """BROKEN: nothing in transformers passes a second argument."""

    def __init__(self, config: Any, scale: float) -> None:
        super().__init__(config)


def test_with_no_call_to_read_the_required_parameters_are_compared_by_position() -> None:
    # nothing in modeling_llama builds LlamaForCausalLM: from_pretrained does, with the config by position
    assert kinds(signature({"^LlamaForCausalLM$": RenamedConfig}, "llama")) == ["RENAMED_PARAMETER"]
    (finding,) = signature({"^LlamaForCausalLM$": ExtraRequired}, "llama")
    assert finding.kind is Kind.SIGNATURE
    assert "no call of LlamaForCausalLM can be read" in finding.message
    assert "missing a required argument: 'scale'" in finding.message


def test_a_lookup_table_call_is_read_as_a_call_site() -> None:
    # FalconDecoderLayer builds FALCON_ATTENTION_CLASSES[...](config, layer_idx): LlamaAttention's __init__ binds
    assert signature({"^(LlamaAttention|FalconAttention)$": LlamaAttention}, "falcon") == []
    # and runs it as self.self_attention(hidden_states=..., alibi, ...): Falcon's alibi is not passed in Llama
    (finding,) = signature({"^(LlamaAttention|FalconAttention)$": FalconAttention}, "llama")
    assert "missing a required argument: 'alibi'" in finding.message


def test_a_call_the_built_model_never_makes_is_not_judged() -> None:
    from fixtures.patches.bert_broad_attention import BertSdpaSelfAttention  # forward(hidden_states, mask, cache, ...)
    from pytest_modelpatch.lint import lint_patterns as with_models

    mapping = {"^BertAttention$": BertSdpaSelfAttention}
    # BertLayer runs self.crossattention(h, None, enc, enc_mask, cache=..., **kwargs) in a decoder with cross-attention
    (finding,) = [f for f in signature(mapping, "bert") if f.kind is Kind.SIGNATURE]  # no model built: every call
    assert (
        "calls it with (<0>, <1>, <2>, <3>, cache=..., **...): multiple values for argument 'cache'" in finding.message
    )
    # the tiny BERT encoder builds no crossattention, so that call is never made
    assert Kind.SIGNATURE not in {f.kind for f in with_models(mapping, families=["bert"], checks=("signature",))}


def test_a_mark_refuses_the_x_attention_at_setup_naming_the_call_site(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from transformers.models.llama.modeling_llama import LlamaAttention


        class Attn(LlamaAttention):
            def forward(self, x, position_embeddings=None, attention_mask=None, **kwargs):
                return super().forward(x, position_embeddings, attention_mask, **kwargs)


        @pytest.mark.model("llama")
        @pytest.mark.patch({"LlamaAttention": Attn})
        def test_attention(reference_model, patched_model):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:xdist")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_attention*",
            "*[[]SIGNATURE[]]*Attn*LlamaDecoderLayer "
            "(transformers.models.llama.modeling_llama, line *) calls it with (hidden_states=...*"
            "missing a required argument: 'x'*",
        ]
    )


# ---------------------------------------------------------------------------
# the audit (benchmarks/lint_audit.py), on a sample
# ---------------------------------------------------------------------------

# deepseek_v4 and lxmert had calls misread as the class's own (two of 12 false findings when SIGNATURE judged parameter names);
# blip_2's tiny model cannot be built here, which once read as the replacement's WEIGHT_NAMES failure
IDENTITY_SAMPLE = [
    "llama",
    "gemma",
    "falcon",
    "qwen2_moe",
    "bert",
    "t5",
    "llava",
    "paligemma",
    "whisper",
    "mamba",
    "deepseek_v4",
    "lxmert",
    "blip_2",
]


@pytest.mark.parametrize("family", IDENTITY_SAMPLE)
def test_classes_replacing_themselves_have_no_contract_finding(family: str) -> None:
    outcome = identity_outcome(family, load_index())
    assert not outcome.skipped and outcome.classes > 0
    assert bool(outcome.sources_only) == (family == "blip_2")
    assert outcome.findings == []


def test_across_llama_gemma_and_falcon_every_finding_is_a_run_that_does_not_bind_and_back() -> None:
    outcomes = [(pair, bool(lint_pair(pair)), run_pair(pair)[0]) for pair in role_pairs(["llama", "gemma", "falcon"])]
    decided = [(pair, found, run) for pair, found, run in outcomes if run != "other"]
    wrong = [
        f"{pair}: lint {'found' if found else 'passed'}, run {run}"
        for pair, found, run in decided
        if found != (run == "binding")
    ]
    assert wrong == []
    # both sides are in the sample: pairs that do not bind (Falcon's alibi) and pairs that run
    assert {run for _, _, run in decided} == {"binding", "ok"} and len(decided) >= 20
