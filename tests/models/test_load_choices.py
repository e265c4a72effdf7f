"""The patched side's load choices: implementations, from_pretrained keywords and transforms on the patch marker.

Each reaches the patched load only; for an implementation axis the patch sets, the reference
loads with transformers' ground truth (``"eager"``), so a custom function is compared with the
original computation, not with itself. Each scenario has a broken twin that must fail.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from _support.runs import IN_ORDER

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.per_test.patch_spec import IMPLEMENTATIONS
from pytest_modelpatch.models.builder import ModelRequest, validate_implementation

ATTENTION = """
import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from pytest_modelpatch import assert_equivalent


def good_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def wrong_scale_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling * 1.5, dropout=dropout, **kwargs)


AttentionInterface.register("good_attn", good_attention)
AttentionInterface.register("wrong_scale_attn", wrong_scale_attention)


@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="good_attn")
def test_good(reference_model, patched_model):
    assert reference_model.config._attn_implementation == "eager"
    assert patched_model.config._attn_implementation == "good_attn"
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="wrong_scale_attn")
def test_wrong_scale(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama", attn_implementation="sdpa")
@pytest.mark.patch(attn_implementation="good_attn")
def test_reference_on_the_model_markers_choice(reference_model, patched_model):
    assert reference_model.config._attn_implementation == "sdpa"


@pytest.mark.model("llama", attn_implementation="wrong_scale_attn")
@pytest.mark.patch(unpatched=True)
def test_shared_on_the_model_marker_warns(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)  # vacuous: both run it


@pytest.mark.model("llama")
@pytest.mark.patch(attn_implementation="good_atn")
def test_typo(patched_model):
    pass
"""


def test_a_custom_attention_is_judged_against_eager_and_a_wrong_scale_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_attention=ATTENTION)
    result = pytester.runpytest(*IN_ORDER, "-rA", "--modelpatch-report", "report.json")
    result.assert_outcomes(passed=3, failed=1, errors=1, warnings=1)
    result.stdout.fnmatch_lines(["*implementations: attention eager (reference) vs wrong_scale_attn (patched)*"])
    # the report row names each side's implementation too, so a gate or a dashboard can tell the runs apart
    rows = {row["nodeid"]: row for row in json.loads((pytester.path / "report.json").read_text())["rows"]}
    implementations = rows["test_attention.py::test_wrong_scale"]["implementations"]
    assert implementations["reference"]["attention"] == "eager"
    assert implementations["patched"]["attention"] == "wrong_scale_attn"
    assert rows["test_attention.py::test_good"]["implementations"]["patched"]["attention"] == "good_attn"
    result.stdout.fnmatch_lines(["FAILED test_attention.py::test_wrong_scale*"])
    result.stdout.fnmatch_lines(
        [
            "*test_shared_on_the_model_marker_warns: @pytest.mark.model(attn_implementation='wrong_scale_attn') loads both models*cannot judge it*"
        ]
    )
    result.stdout.fnmatch_lines(
        ["*attn_implementation='good_atn' is not an attention implementation. Did you mean 'good_attn'*"]
    )


EXPERTS = """
import pytest
import torch
from transformers.integrations.moe import ExpertsInterface, batched_mm_experts_forward
from pytest_modelpatch import assert_equivalent


def wrong_router_experts(self, hidden_states, top_k_index, top_k_weights):
    # each token's weights go to the wrong experts: the first weight to the second expert and so on
    return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights.flip(-1))


ExpertsInterface.register("wrong_router", wrong_router_experts)


@pytest.mark.model("qwen3_moe")
@pytest.mark.patch(experts_implementation="batched_mm")
def test_batched_mm(reference_model, patched_model):
    assert reference_model.config._experts_implementation == "eager"
    assert patched_model.config._experts_implementation == "batched_mm"
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("qwen3_moe")
@pytest.mark.patch(experts_implementation="wrong_router")
def test_wrong_router(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("qwen3_moe", experts_implementation="batched_mm")
@pytest.mark.patch(unpatched=True)  # the model marker's choice reaches both models
def test_model_marker_takes_experts_implementation(reference_model, patched_model):
    assert reference_model.config._experts_implementation == patched_model.config._experts_implementation == "batched_mm"
"""


def test_batched_mm_experts_pass_and_experts_that_route_to_the_wrong_experts_fail(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_experts=EXPERTS)
    result = pytester.runpytest(*IN_ORDER, "-rA")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*implementations: experts eager (reference) vs wrong_router (patched)*"])
    result.stdout.fnmatch_lines(["FAILED test_experts.py::test_wrong_router*"])


TRANSFORMS = """
import types

import pytest
import torch
from pytest_modelpatch import assert_equivalent, assert_decodes_equivalent

SEEN = []


def spy_kwargs(model):
    SEEN.append(model.config._attn_implementation)


def bump_a_weight(model):
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0


def rebind_rmsnorm_forward(model):
    # an instance patcher: every RMSNorm's forward rebound to an equivalent function
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            def forward(self, hidden_states):
                variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
                normed = hidden_states.to(torch.float32) * torch.rsqrt(variance + self.variance_epsilon)
                return self.weight * normed.to(hidden_states.dtype)
            module.forward = types.MethodType(forward, module)
    return model


@pytest.mark.model("llama")
@pytest.mark.patch(load_kwargs={"attn_implementation": "sdpa"}, transform=spy_kwargs)
def test_load_kwargs_reach_the_patched_load_only(reference_model, patched_model):
    assert SEEN == ["sdpa"] and reference_model.config._attn_implementation == "eager"


@pytest.mark.model("llama")
@pytest.mark.patch(transform=bump_a_weight)
def test_weight_changed(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=[rebind_rmsnorm_forward, spy_kwargs])
def test_instance_patcher(reference_model, patched_model):
    assert all(type(m).__name__ != "LlamaRMSNorm" or "forward" in vars(m) for m in patched_model.modules())
    # (the reference's own forward is the plugin's: it resolves the class's in the pristine world)
    assert not any("forward" in vars(m) for m in reference_model.modules() if type(m).__name__ == "LlamaRMSNorm")
    assert_equivalent(reference_model, patched_model)
    assert_decodes_equivalent(reference_model, patched_model, max_new_tokens=3)
"""


def test_transforms_reach_the_patched_model_only_and_a_changed_weight_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_transforms=TRANSFORMS)
    result = pytester.runpytest(*IN_ORDER, "-rA")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_transforms.py::test_weight_changed*"])
    result.stdout.fnmatch_lines(["*first diverging module: model.layers.0.mlp.down_proj*"])


def test_bad_load_choices_are_usage_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.model("llama")
        @pytest.mark.patch(transform="not callable")
        def test_bad_transform(patched_model):
            pass


        @pytest.mark.model("qwen3_moe")
        @pytest.mark.patch(experts_implementation="batchd_mm")
        def test_bad_experts(patched_model):
            pass


        @pytest.mark.patch(load_kwargs=["use_kernels"])
        def test_bad_load_kwargs():
            pass
        """
    )
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(["*transform must be a callable fn(model) returning a model or None*"])
    result.stdout.fnmatch_lines(
        ["*experts_implementation='batchd_mm' is not an experts implementation. Did you mean 'batched_mm'*"]
    )
    result.stdout.fnmatch_lines(["*load_kwargs must be a dict of from_pretrained keywords*"])


PEFT = """
import pytest
import torch
from peft import LoraConfig, get_peft_model
from pytest_modelpatch import assert_equivalent, assert_decodes_equivalent


def zero_lora(model):
    return get_peft_model(model, LoraConfig(target_modules=["v_proj"], r=4))  # lora_B starts at zero: the model


def random_lora(model):
    wrapped = zero_lora(model)
    torch.manual_seed(0)
    for name, parameter in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    return wrapped


@pytest.mark.model("llama")
@pytest.mark.patch(transform=zero_lora)
def test_zero_lora(reference_model, patched_model):
    assert type(patched_model).__name__ == "PeftModel"
    assert_equivalent(reference_model, patched_model)
    assert_decodes_equivalent(reference_model, patched_model, max_new_tokens=3)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=random_lora)
def test_random_lora(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("bert")
@pytest.mark.patch(unpatched=True)
def test_another_model_is_still_refused(patched_model):
    from pytest_modelpatch.errors import ModelMismatchError
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = get_peft_model(LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, vocab_size=64)),
                           LoraConfig(target_modules=["v_proj"], r=2))
    with pytest.raises(ModelMismatchError, match="model_type 'bert' vs 'llama'"):
        assert_equivalent(patched_model, llama)
"""


def test_a_zero_lora_passes_and_a_random_lora_fails_naming_the_adapted_projection(pytester: pytest.Pytester) -> None:
    pytest.importorskip("peft")
    pytester.makepyfile(test_peft=PEFT)
    result = pytester.runpytest(*IN_ORDER, "-rA", "-W", "ignore::FutureWarning")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_peft.py::test_random_lora*"])
    # PEFT's LoRA layer is a class named Linear too; the name is the wrapped model's, as in the reference
    result.stdout.fnmatch_lines(["*first diverging module: model.layers.0.self_attn.v_proj (Linear)*"])


EVERY_CHECK = """
import pytest
from fixtures.patches import mechanisms
from pytest_modelpatch import (
    assert_backward_equivalent, assert_compiles_equivalent, assert_exports_equivalent, check_equivalent, check_decodes_equivalent,
)

GOOD = pytest.mark.patch(transform=mechanisms.rmsnorm_instance_patcher)
BROKEN = pytest.mark.patch(transform=mechanisms.rmsnorm_instance_patcher_no_eps)
CHECKS = {
    "property": lambda r, p: check_equivalent(r, p, max_examples=4),
    "backward": lambda r, p: assert_backward_equivalent(r, p),
    "generation": lambda r, p: check_decodes_equivalent(r, p, max_examples=2, max_new_tokens=2),
    "export": lambda r, p: assert_exports_equivalent(r, p),
    "compile": lambda r, p: assert_compiles_equivalent(r, p),
}


@pytest.mark.model("llama")
@GOOD
@pytest.mark.parametrize("check", list(CHECKS))
def test_good(check, reference_model, patched_model):
    CHECKS[check](reference_model, patched_model)


@pytest.mark.model("llama")
@BROKEN
@pytest.mark.parametrize("check", list(CHECKS))
def test_broken(check, reference_model, patched_model):
    CHECKS[check](reference_model, patched_model)
"""


def test_every_check_runs_a_transformed_patched_model_and_catches_a_broken_transform(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_every_check=EVERY_CHECK)
    result = pytester.runpytest(*IN_ORDER, "-rA")
    result.assert_outcomes(passed=5, failed=5)
    for check in ("property", "backward", "generation", "export", "compile"):
        result.stdout.fnmatch_lines([f"PASSED test_every_check.py::test_good[[]{check}[]]*"], consecutive=False)
        result.stdout.fnmatch_lines([f"FAILED test_every_check.py::test_broken[[]{check}[]]*"], consecutive=False)


ROUNDTRIP = """
import pytest
from fixtures.patches import mechanisms


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.rmsnorm_instance_patcher)
def test_instance_patcher(reference_model, roundtrip):
    report = roundtrip.check(reference_model)
    assert report.outputs_checked


def scale_v_proj(model):
    import torch
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(2.0)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=scale_v_proj)
def test_weight_changed(reference_model, roundtrip):
    roundtrip.check(reference_model)


@pytest.mark.model("llama")
@pytest.mark.patch(transform=mechanisms.zero_lora)
def test_lora(reference_model, roundtrip):
    roundtrip.check(reference_model)
"""


def test_a_roundtrip_saves_the_transformed_model_and_a_transform_that_changes_a_weight_fails(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_roundtrip_choices=ROUNDTRIP)
    result = pytester.runpytest(*IN_ORDER, "-rA")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "PASSED test_roundtrip_choices.py::test_instance_patcher",
        # the transform ran on the patched load: the saved checkpoint holds the changed weight
        "FAILED test_roundtrip_choices.py::test_weight_changed - AssertionError*",
        # a LoRA injected into the base model saves its adapter layers in place of v_proj: not the checkpoint
        "FAILED test_roundtrip_choices.py::test_lora - AssertionError*",
    ], consecutive=False)  # fmt: skip
    result.stdout.fnmatch_lines(["*layers.0.self_attn.v_proj.weight*"])


TOWERS = """
import pytest
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from pytest_modelpatch import assert_equivalent


def wrong_scale_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling * 1.5, dropout=dropout, **kwargs)


AttentionInterface.register("wrong_scale_attn", wrong_scale_attention)


def vision_tower_on_eager(model):
    model.set_attn_implementation({"vision_config": "eager"})


@pytest.mark.model("llava")
@pytest.mark.patch(attn_implementation="sdpa")
def test_every_tower(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llava")
@pytest.mark.patch(attn_implementation="wrong_scale_attn", transform=vision_tower_on_eager)
def test_one_tower_left_on_eager(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_a_composite_models_implementations_are_reported_per_tower(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_towers=TOWERS)
    result = pytester.runpytest(*IN_ORDER, "--modelpatch-report", "report.json")
    result.assert_outcomes(passed=1, failed=1)
    rows = {row["nodeid"]: row for row in json.loads((pytester.path / "report.json").read_text())["rows"]}
    # the eager reference reaches every tower of LLaVA (its CLIP vision tower and its Llama text model), as sdpa does
    attention = {side: {k: v for k, v in axes.items() if k.startswith("attention")}
                 for side, axes in rows["test_towers.py::test_every_tower"]["implementations"].items()}  # fmt: skip
    towers = ("attention", "attention.vision_config", "attention.text_config")
    assert attention == {"reference": dict.fromkeys(towers, "eager"), "patched": dict.fromkeys(towers, "sdpa")}
    # a tower on another implementation than its model is named in the failure
    result.stdout.fnmatch_lines(
        ["E*implementations: attention eager (reference) vs wrong_scale_attn (vision_config: eager) (patched)"]
    )
    patched = rows["test_towers.py::test_one_tower_left_on_eager"]["implementations"]["patched"]
    assert (patched["attention.vision_config"], patched["attention.text_config"]) == ("eager", "wrong_scale_attn")


def test_every_implementation_axis_is_a_model_marker_keyword_with_its_name_check() -> None:
    # one table (settings.IMPLEMENTATION_AXES): a new axis fails here until the marker takes it
    fields = {field.name for field in dataclasses.fields(ModelRequest)}
    assert IMPLEMENTATIONS and set(IMPLEMENTATIONS) <= fields
    for axis in IMPLEMENTATIONS:
        request = ModelRequest.from_marker(("llama",), {axis: "eager"}, "here")
        assert request.load_kwargs() == {axis: "eager"}
        with pytest.raises(PatchUsageError, match=f"{axis}='no-such' is not an? "):
            ModelRequest.from_marker(("llama",), {axis: "no-such"}, "here")
        validate_implementation(axis, None)  # none chosen
