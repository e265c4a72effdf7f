"""The contract lint on real transformers classes: signatures, weight names, parallelism plans.

transformers 5.23's attentions no longer take ``cache_position``; the cache (``past_key_values``,
``cache`` from 5.24) is the parameter a forward reads for generation, so the "accepted but never
used" case is shown on it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from typing import Any

import pytest
from _support.runs import IN_ORDER
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer
from transformers.models.vibevoice_asr.modeling_vibevoice_asr import VibeVoiceAsrMultiModalProjector

from fixtures import PATCH_MODULES, load_patch
from fixtures.patches import llama_fused_qkv
from pytest_modelpatch.errors import ModelPatchWarning, PatchUsageError
from pytest_modelpatch.lint.findings import Kind
from pytest_modelpatch.lint.model_structures import meta_structures
from pytest_modelpatch.lint.patterns import Finding, lint_for_registration, lint_patterns

# transformers 5.24 renamed the attention's past_key_values to cache
CACHE = "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


class NoPositionIdsAttention(LlamaAttention):
    """No **kwargs: the decoder layer's position_ids= and use_cache= raise TypeError."""

    def forward(
        self, hidden_states: Any, position_embeddings: Any = None, attention_mask: Any = None, cache: Any = None
    ) -> Any:
        return super().forward(hidden_states, position_embeddings, attention_mask, cache)


class IgnoresCacheAttention(LlamaAttention):
    """The cache falls into **kwargs and is never read: fine for one forward, wrong for generate."""

    def forward(
        self, hidden_states: Any, position_embeddings: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> Any:
        return super().forward(hidden_states, position_embeddings, attention_mask, None)


class PassThroughAttention(LlamaAttention):
    """*args/**kwargs handed to super().forward: everything reaches the original, nothing is swallowed."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output, weights = super().forward(*args, **kwargs)
        return output * 1.0, weights


class NoLayerIdxAttention(LlamaAttention):
    """LlamaDecoderLayer builds LlamaAttention(config=config, layer_idx=layer_idx)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, 0)


class RenamedLayer(LlamaDecoderLayer):
    """Same weights, a new class name: LlamaPreTrainedModel._no_split_modules no longer covers it."""


def kinds(findings: list[Finding]) -> list[str]:
    return [str(f.kind) for f in findings]


def contract(
    mapping: dict[str, type],
    conversions: dict[str, list[Any]] | None = None,
    checks: tuple[str, ...] = ("signature", "weights", "plan"),
) -> list[Finding]:
    return lint_patterns(
        mapping, families=["llama"], conversions=conversions, checks=checks, structures=meta_structures
    )


def test_forward_missing_a_keyword_the_parent_passes_is_a_signature_finding() -> None:
    (finding,) = contract({"LlamaAttention": NoPositionIdsAttention}, checks=("signature",))
    assert finding.kind is Kind.SIGNATURE
    assert "LlamaDecoderLayer (transformers.models.llama.modeling_llama, line " in finding.message
    assert "no parameter position_ids, use_cache" in finding.message
    assert "Accept the same parameters (LlamaAttention.forward(hidden_states" in finding.message


def test_kwargs_that_swallow_the_cache_get_the_unused_argument_warning() -> None:
    (finding,) = contract({"LlamaAttention": IgnoresCacheAttention}, checks=("signature",))
    assert finding.kind is Kind.UNUSED_ARGUMENT
    assert f"accepts {CACHE!r} through **kwargs but never reads it" in finding.message
    assert finding.suggestion == CACHE


@pytest.mark.skipif(CACHE != "cache", reason="transformers < 5.24 passes past_key_values")
def test_a_forward_naming_past_key_values_gets_the_cache_rename_named() -> None:
    stale = load_patch("llama_past_key_values_only")
    (finding,) = contract(stale.MAPPING, checks=("signature",))
    assert finding.kind is Kind.UNUSED_ARGUMENT and finding.suggestion == "cache"
    assert "forward names 'past_key_values', which transformers renamed to 'cache'" in finding.message
    assert "Accept 'cache', or both spellings" in finding.message
    fixed = {"LlamaAttention": load_patch("llama_new_kv_only").MAPPING["LlamaAttention"].__mro__[1]}
    assert contract(fixed, checks=("signature",)) == []  # CacheStepAttention takes both spellings


class RenamedWithoutDecorator(LlamaAttention):
    """A parameter no caller passes while **kwargs swallows the one they do: the rename is guessed."""

    def forward(
        self,
        hidden_states: Any,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        kv: Any = None,
        **kwargs: Any,
    ) -> Any:
        return super().forward(hidden_states, position_embeddings, attention_mask, kv)


def test_a_parameter_no_caller_passes_is_named_as_the_old_spelling() -> None:
    (finding,) = contract({"LlamaAttention": RenamedWithoutDecorator}, checks=("signature",))
    assert finding.kind is Kind.UNUSED_ARGUMENT
    assert "its own 'kv' is a parameter LlamaAttention.forward does not take and no caller passes" in finding.message
    assert f"If 'kv' is what {CACHE!r} was called before, accept {CACHE!r}, or both spellings" in finding.message


def test_kwargs_passed_on_to_super_forward_are_not_unused() -> None:
    assert contract({"LlamaAttention": PassThroughAttention}, checks=("signature",)) == []


def test_init_without_layer_idx_is_a_signature_finding() -> None:
    (finding,) = contract({"LlamaAttention": NoLayerIdxAttention}, checks=("signature",))
    assert finding.kind is Kind.SIGNATURE
    assert (
        "calls it with (config=..., layer_idx=...): got an unexpected keyword argument 'layer_idx'" in finding.message
    )
    assert finding.suggestion == "LlamaAttention.__init__(config, layer_idx)"


def test_fused_qkv_without_its_conversion_names_missing_and_unexpected_keys() -> None:
    (finding,) = contract(llama_fused_qkv.MAPPING, checks=("weights",))
    assert finding.kind is Kind.WEIGHT_NAMES
    assert "missing keys (initialised randomly at load): layers.0.self_attn.qkv_proj.weight" in finding.message
    assert "unexpected keys (in the checkpoint, ignored): layers.0.self_attn.k_proj.weight" in finding.message
    assert finding.suggestion == (
        "WeightConverter(source_patterns=['k_proj', 'q_proj', 'v_proj'], target_patterns=['qkv_proj'], "
        "operations=[Concatenate(dim=0)])"
    )


def test_fused_qkv_with_its_conversion_has_no_weight_findings() -> None:
    assert contract(llama_fused_qkv.MAPPING, llama_fused_qkv.CONVERSIONS, checks=("weights",)) == []


def test_a_conversion_that_does_not_produce_the_names_is_reported() -> None:
    from transformers.core_model_loading import WeightRenaming

    wrong = {"llama": [WeightRenaming("q_proj", "query")]}
    (finding,) = contract(llama_fused_qkv.MAPPING, wrong, checks=("weights",))
    assert "The registered conversions for 'llama' (WeightRenaming(['q_proj'] -> ['query']))" in finding.message


def test_fused_qkv_on_llama_breaks_the_tp_plan_entries_of_q_k_v() -> None:
    findings = contract(llama_fused_qkv.MAPPING, llama_fused_qkv.CONVERSIONS, checks=("plan",))
    assert [f.suggestion for f in findings] == [
        "layers.*.self_attn.q_proj",
        "layers.*.self_attn.k_proj",
        "layers.*.self_attn.v_proj",
    ]
    assert all(f.kind is Kind.PARALLEL_PLAN and "(it has qkv_proj instead)" in f.message for f in findings)
    assert all("prove it sharded with @pytest.mark.parallel('tp')" in f.message for f in findings)


def test_a_renamed_no_split_class_is_a_parallel_plan_finding() -> None:
    (finding,) = contract({"LlamaDecoderLayer": RenamedLayer}, checks=("plan",))
    assert "LlamaPreTrainedModel._no_split_modules names LlamaDecoderLayer" in finding.message
    assert finding.suggestion == "RenamedLayer"


@pytest.mark.parametrize("name", PATCH_MODULES)
def test_good_examples_have_a_clean_contract(name: str) -> None:
    patch = load_patch(name)
    if patch.EXPECTED != "equivalent":
        pytest.skip(f"{name} is not a good example ({patch.EXPECTED})")
    found = lint_patterns(
        patch.MAPPING,
        families=[patch.MODEL_TYPE],
        conversions=patch.CONVERSIONS,
        checks=("signature", "weights"),
        structures=meta_structures,
    )
    assert found == []


def test_registration_refuses_signature_and_warns_unused() -> None:
    with pytest.raises(PatchUsageError, match=r"\[SIGNATURE\].*layer_idx"):
        lint_for_registration({"LlamaAttention": NoLayerIdxAttention}, families=["llama"], structures=meta_structures)
    with pytest.warns(
        ModelPatchWarning, match=r"\[UNUSED_ARGUMENT\].*allow=\{'LlamaAttention': \['UNUSED_ARGUMENT'\]\}"
    ):
        lint_for_registration({"LlamaAttention": IgnoresCacheAttention}, families=["llama"], structures=meta_structures)
    lint_for_registration(
        {"LlamaAttention": IgnoresCacheAttention},
        families=["llama"],
        structures=meta_structures,
        allow={"LlamaAttention": ["UNUSED_ARGUMENT"]},
    )


def test_a_mark_without_its_conversion_fails_at_registration_and_the_good_one_runs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from fixtures.patches import llama_fused_qkv as fused


        @pytest.mark.model("llama")
        @pytest.mark.patch(fused.MAPPING)
        def test_without_conversion():
            pass


        @pytest.mark.model("llama")
        @pytest.mark.patch(fused.MAPPING, conversions=fused.CONVERSIONS)
        def test_with_conversion():
            pass
        """
    )
    result = pytester.runpytest(
        "-p", "no:xdist", "-p", "no:randomly", "-W", "error::pytest_modelpatch.errors.ModelPatchWarning"
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*[[]WEIGHT_NAMES[]]*missing keys*qkv_proj*unexpected keys*q_proj*"])


# Families whose built-in conversions add "model." for legacy ForXxx checkpoints: loading the base
# model strips that level again (transformers' base_model_prefix step), so a no-op patch loads cleanly.
PREFIXED_PROJECTORS = [
    ("vibevoice_asr", "VibeVoiceAsrMultiModalProjector"),
    ("qwen2_audio", "Qwen2AudioMultiModalProjector"),
    ("llava", "LlavaMultiModalProjector"),
]


def no_op(family: str, class_name: str) -> type:
    """A subclass of the family's class that changes nothing."""
    original = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), class_name)
    return type(f"NoOp{class_name}", (original,), {"__module__": __name__})


@pytest.mark.parametrize(("family", "class_name"), PREFIXED_PROJECTORS)
def test_a_no_op_patch_keeps_the_weight_names_where_conversions_add_the_base_prefix(
    family: str, class_name: str
) -> None:
    assert (
        lint_patterns(
            {class_name: no_op(family, class_name)}, families=[family], checks=("weights",), structures=meta_structures
        )
        == []
    )


class RenamedAcousticProjector(VibeVoiceAsrMultiModalProjector):
    """acoustic_linear_1 renamed acoustic_in: a checkpoint's weights for it no longer load."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.acoustic_in = self.acoustic_linear_1
        del self.acoustic_linear_1


def test_a_renamed_weight_under_the_base_prefix_is_still_a_weight_names_finding() -> None:
    (finding,) = lint_patterns(
        {"VibeVoiceAsrMultiModalProjector": RenamedAcousticProjector},
        families=["vibevoice_asr"],
        checks=("weights",),
        structures=meta_structures,
    )
    assert finding.kind is Kind.WEIGHT_NAMES
    assert "missing keys (initialised randomly at load): multi_modal_projector.acoustic_in.bias" in finding.message
    # the names from_pretrained(..., output_loading_info=True) reports for this patch
    assert (
        "unexpected keys (in the checkpoint, ignored): multi_modal_projector.acoustic_linear_1.bias" in finding.message
    )
    assert finding.suggestion == "WeightRenaming('acoustic_linear_1', 'acoustic_in')"


def test_a_no_op_patch_on_vibevoice_asr_runs_and_a_renaming_one_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from transformers.models.vibevoice_asr import modeling_vibevoice_asr as vv

        from pytest_modelpatch import assert_equivalent


        class NoOp(vv.VibeVoiceAsrMultiModalProjector):
            pass


        class Renamed(vv.VibeVoiceAsrMultiModalProjector):
            def __init__(self, config):
                super().__init__(config)
                self.acoustic_in = self.acoustic_linear_1
                del self.acoustic_linear_1


        @pytest.mark.model("vibevoice_asr")
        @pytest.mark.patch({"VibeVoiceAsrMultiModalProjector": NoOp})
        def test_no_op(reference_model, patched_model):
            assert_equivalent(reference_model, patched_model)


        @pytest.mark.model("vibevoice_asr")
        @pytest.mark.patch({"VibeVoiceAsrMultiModalProjector": Renamed})
        def test_renamed(reference_model, patched_model):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:xdist", "-p", "no:randomly")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_renamed*",
            "*[[]WEIGHT_NAMES[]]*missing keys*acoustic_in*unexpected keys*acoustic_linear_1*",
        ]
    )


def test_the_function_the_cli_and_the_marker_give_the_same_findings(pytester: pytest.Pytester) -> None:
    from pytest_modelpatch.lint import lint_patterns

    # the fused attention without its conversion: the checkpoint's q/k/v no longer load, llama's TP plan breaks
    # (and BROAD: families other than llama bind LlamaAttention too)
    found = lint_patterns(llama_fused_qkv.MAPPING, families=["llama"])
    assert sorted({str(f.kind) for f in found}) == ["BROAD", "PARALLEL_PLAN", "WEIGHT_NAMES"]
    assert len(lint_patterns(llama_fused_qkv.MAPPING, families=["llama"], structures=None)) == 1  # BROAD only
    no_conversion = "fixtures.patches.llama_new_kv_only:CONVERSIONS"  # {}
    cli = subprocess.run([sys.executable, "-m", "pytest_modelpatch", "lint", "--family", "llama", "--mapping", "fixtures.patches.llama_fused_qkv:MAPPING",
                          "--conversions", no_conversion, "--json"], capture_output=True, text=True)  # fmt: skip
    assert cli.returncode == 1, cli.stderr
    assert [{k: v for k, v in f.items() if k != "failing"} for f in json.loads(cli.stdout)["findings"]] == [
        f.to_json() for f in found
    ]
    pytester.makepyfile(
        """
        import pytest
        from fixtures.patches import llama_fused_qkv


        @pytest.mark.model("llama")
        @pytest.mark.patch(llama_fused_qkv.MAPPING)
        def test_without_conversion():
            pass
        """
    )
    marked = pytester.runpytest(*IN_ORDER)
    marked.assert_outcomes(errors=1)
    registration = [f for f in found if str(f.kind) == "WEIGHT_NAMES"]  # what fails registration
    for finding in registration:
        assert str(finding) in marked.stdout.str()
