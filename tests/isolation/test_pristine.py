"""The reference stays the unpatched model for every patch kind: methods, contexts, loader wrappers.

Each scenario pairs a patch that changes the numbers (it must fail) with a harmless twin (it must
pass): before the reference was kept pristine, both passed, since both models ran the same code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

PATCHES = """
import contextlib

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding


@contextlib.contextmanager
def scaled_rope(factor):
    # rebinds a class method, as kernel libraries do, and undoes it on exit
    original = LlamaRotaryEmbedding.forward

    def forward(self, x, position_ids):
        return original(self, x, position_ids * factor)

    LlamaRotaryEmbedding.forward = forward
    try:
        yield
    finally:
        LlamaRotaryEmbedding.forward = original


@contextlib.contextmanager
def rebind_norm_without_undo():
    # Liger-style: rebinds the module global and never restores it
    class UnnormalizedRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            return self.weight * hidden_states

    modeling_llama.LlamaRMSNorm = UnnormalizedRMSNorm
    yield


class patched_LlamaMLP:
    _PATCHED_CLASS_ = LlamaMLP
    _PATCHES_ = ["forward"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 1.01)


class same_LlamaMLP:
    _PATCHED_CLASS_ = LlamaMLP
    _PATCHES_ = ["forward"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


SEEN = []


@contextlib.contextmanager
def quantizing_loader():
    # how quantization libraries wrap loading: on the Auto class, swapping MLPs while loading
    original = AutoModelForCausalLM.from_pretrained.__func__

    class ScaledMLP(LlamaMLP):
        def forward(self, x):
            return super().forward(x) * 2

    def from_pretrained(cls, *args, **kwargs):
        SEEN.append(cls.__name__)
        model = original(cls, *args, **kwargs)
        for layer in model.model.layers:
            scaled = ScaledMLP(model.config)
            scaled.load_state_dict(layer.mlp.state_dict())
            layer.mlp = scaled
        return model

    AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        AutoModelForCausalLM.from_pretrained = classmethod(original)
"""


@pytest.fixture
def patches(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(my_patches=PATCHES)


def test_context_patch_that_changes_numbers_fails_and_a_noop_one_passes(
    pytester: pytest.Pytester, patches: None
) -> None:
    pytester.makepyfile(
        """
import pytest
from my_patches import scaled_rope
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(context=scaled_rope, factor=2)
def test_scaled(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(context=scaled_rope, factor=1)
def test_noop(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*differs from reference*", "*FAILED*test_scaled*"])


def test_context_that_leaves_a_module_global_rebound_never_reaches_the_reference(
    pytester: pytest.Pytester, patches: None
) -> None:
    pytester.makepyfile(
        """
import pytest
from transformers.models.llama import modeling_llama
from my_patches import rebind_norm_without_undo
from pytest_modelpatch import assert_equivalent

ORIGINAL = modeling_llama.LlamaRMSNorm


@pytest.mark.model("llama")
@pytest.mark.patch(context=rebind_norm_without_undo)
def test_unnormalized_norm(reference_model, patched_model):
    assert type(patched_model.model.norm).__name__ == "UnnormalizedRMSNorm"
    assert type(reference_model.model.norm) is ORIGINAL
    assert_equivalent(reference_model, patched_model)


def test_the_context_left_nothing_behind():
    assert modeling_llama.LlamaRMSNorm is ORIGINAL
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_unnormalized_norm*"])


def test_method_patch_is_caught_by_check_equivalent_and_its_noop_twin_passes(
    pytester: pytest.Pytester, patches: None
) -> None:
    pytester.makepyfile(
        """
import pytest
from my_patches import patched_LlamaMLP, same_LlamaMLP
from pytest_modelpatch import check_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(methods=[patched_LlamaMLP])
def test_scaled_mlp(reference_model, patched_model):
    check_equivalent(reference_model, patched_model, max_examples=5)


@pytest.mark.model("llama")
@pytest.mark.patch(methods=[same_LlamaMLP])
def test_same_mlp(reference_model, patched_model):
    check_equivalent(reference_model, patched_model, max_examples=5)
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_scaled_mlp*"])


def test_loader_wrapper_on_the_auto_class_patches_only_the_patched_model(
    pytester: pytest.Pytester, patches: None
) -> None:
    pytester.makepyfile(
        """
import pytest
import my_patches
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(context=my_patches.quantizing_loader)
def test_wrapped(reference_model, patched_model):
    assert type(patched_model.model.layers[0].mlp).__name__ == "ScaledMLP"
    assert type(reference_model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert my_patches.SEEN == ["AutoModelForCausalLM"]  # the patched load went through the Auto class
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
def test_later_test_shares_a_clean_reference(reference_model):
    assert type(reference_model.model.layers[0].mlp).__name__ == "LlamaMLP"
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*differs from reference*", "*FAILED*test_wrapped*"])


def test_decoder_layer_patch_then_plain_test_both_keep_hidden_states(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from pytest_modelpatch import assert_equivalent


class MyDecoderLayer(LlamaDecoderLayer):
    pass


def hidden_states(model):
    ids = __import__("torch").tensor([[1, 2, 3, 4]])
    return model(input_ids=ids, output_hidden_states=True).hidden_states


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaDecoderLayer": MyDecoderLayer})
def test_a_patched_first(patched_model, reference_model):
    patched = hidden_states(patched_model)
    assert patched is not None and len(patched) == patched_model.config.num_hidden_layers + 1
    reference = hidden_states(reference_model)
    assert reference is not None and len(reference) == len(patched)
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
def test_b_plain(reference_model):
    states = hidden_states(reference_model)
    assert states is not None and len(states) == reference_model.config.num_hidden_layers + 1
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_a_reference_patched_behind_the_plugins_back_is_refused_not_compared(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
from transformers.models.llama.modeling_llama import LlamaMLP
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)  # patched behind the plugin's back, in the body
def test_body_patch(reference_model, patched_model, monkeypatch):
    monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: x)
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_after(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*ReferenceNotPristineError*", "*LlamaMLP.forward was replaced*", "*@pytest.mark.patch(methods=*"]
    )


def test_a_reference_call_runs_unpatched_while_the_tests_registries_stay_in_place(tmp_path: Path) -> None:
    # running_pristine() (every reference call) swaps method and context patches only: registered
    # mappings and conversions act while a model is built, and the reference was built in pristine().
    from transformers.models.llama import modeling_llama

    from fixtures import load_patch
    from pytest_modelpatch.isolation.per_test.patch_spec import PatchSpec
    from pytest_modelpatch.isolation.pristine import pristine
    from pytest_modelpatch.isolation.registration import ActivePatches
    from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest

    builder, request = ModelBuilder(tmp_path), ModelRequest("llama")
    reference = builder.reference(request)
    inputs = {"input_ids": torch.tensor([[3, 7, 11, 5]]), "output_hidden_states": True}
    with torch.no_grad():
        expected = reference(**inputs)
    original = modeling_llama.LlamaRMSNorm.forward

    def scaled_norm(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return original(self, hidden_states) * 2

    class scaled_LlamaRMSNorm:  # noqa: N801 - named like the class it patches, as the fixtures do
        _PATCHED_CLASS_ = modeling_llama.LlamaRMSNorm
        _PATCHES_ = ["forward"]
        forward = scaled_norm

    swiglu = load_patch("llama_swiglu_autograd")  # a decoder-side mapping, and a method patch on the norm
    active = ActivePatches(PatchSpec(mapping=dict(swiglu.MAPPING), methods=[scaled_LlamaRMSNorm], overwrite=True))
    try:
        patched = builder.patched(request)
        with torch.no_grad():
            ours, theirs = reference(**inputs), patched(**inputs)
            with pristine():  # the whole pristine world: what the reference must compute
                full = reference.forward(**inputs)
        assert modeling_llama.LlamaRMSNorm.forward is scaled_norm  # the test's world is back after each call
        from transformers import monkey_patching

        assert "LlamaMLP" in monkey_patching.get_patch_mapping()
    finally:
        active.close()
    assert torch.equal(ours.logits, expected.logits) and torch.equal(ours.logits, full.logits)
    assert len(ours.hidden_states) == len(expected.hidden_states) == reference.config.num_hidden_layers + 1
    assert not torch.allclose(theirs.logits, expected.logits)  # the method patch reached the patched model


FIRST_IMPORT = """
import contextlib
import importlib

import pytest
import torch
from pytest_modelpatch import assert_equivalent


@contextlib.contextmanager
def norm(scale):
    # as Liger-Kernel's apply_liger_kernel_to_* do: the modeling module is imported by the patch itself
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")

    class ScaledRMSNorm(modeling.LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * scale

    modeling.LlamaRMSNorm = ScaledRMSNorm
    yield


@pytest.mark.model("llama")
@pytest.mark.patch(context=norm, scale={scale})
def test_first_in_the_session(reference_model, patched_model):
    assert type(reference_model.model.norm).__name__ == "LlamaRMSNorm"
    assert type(patched_model.model.norm).__name__ == "ScaledRMSNorm"
    assert_equivalent(reference_model, patched_model)
"""


@pytest.mark.fresh_interpreter  # a new interpreter: no modeling module is imported before the patch imports it
@pytest.mark.parametrize(("scale", "outcome"), [(1.5, "failed"), (1.0, "passed")])
def test_a_context_that_imports_the_modeling_module_it_rebinds_still_leaves_the_reference_unpatched(
    pytester: pytest.Pytester, scale: float, outcome: str
) -> None:
    pytester.makepyfile(FIRST_IMPORT.replace("{scale}", str(scale)))
    result = pytester.runpytest("-p", "no:randomly")
    # before: the reference was built from the patched module (so the wrong scale passed), and the
    # context's rebinding was then reported as the test's own leak at teardown
    result.assert_outcomes(**{outcome: 1})
    assert "leaked" not in result.stdout.str()
    if outcome == "failed":
        result.stdout.fnmatch_lines(["*differs from reference*"])
