"""The leak guard catches what kernel libraries really change, charges it to the right test or fixture,
and restores it; a revert by ``importlib.reload`` is no leak."""

from __future__ import annotations

import pytest

HEADER = """
import importlib
import pytest
import torch
import transformers
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

ORIGINAL_NORM = modeling_llama.LlamaRMSNorm
ORIGINAL_MLP_FORWARD = modeling_llama.LlamaMLP.forward


class MyNorm(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


def fast_forward(self, x):
    return x


def my_attn(*args, **kwargs):
    raise NotImplementedError
"""


def test_each_leak_kind_is_named_restored_and_fails_its_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        HEADER
        + """
def test_rebinds_module_global():
    modeling_llama.LlamaRMSNorm = MyNorm


def test_rebinds_class_method():
    modeling_llama.LlamaMLP.forward = fast_forward


def test_registers_attention_function():
    AttentionInterface.register("my_attn", my_attn)


@pytest.mark.xfail(reason="the body fails as expected; the leak must still fail it")
def test_leaks_in_xfail():
    modeling_llama.LlamaRMSNorm = MyNorm
    assert False


def test_patches_a_module_imported_in_the_test():
    from transformers.models.gpt2 import modeling_gpt2
    modeling_gpt2.GPT2MLP.forward = fast_forward


def test_z_sees_the_originals():
    from transformers.models.gpt2 import modeling_gpt2
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM
    assert modeling_llama.LlamaMLP.forward is ORIGINAL_MLP_FORWARD
    assert "my_attn" not in AttentionInterface._global_mapping
    assert modeling_gpt2.GPT2MLP.forward is not fast_forward
"""
    )
    result = pytester.runpytest("-o", "modelpatch_leaks=error")  # plain tests: explicit, as a suite opts in
    result.assert_outcomes(passed=5, errors=5, xfailed=1)
    result.stdout.fnmatch_lines_random(
        [
            "*test_rebinds_module_global leaked transformers patch state*",
            "*modeling_llama.LlamaRMSNorm: LlamaRMSNorm -> MyNorm",
            "*LlamaMLP.forward replaced",
            "*transformers.modeling_utils.AttentionInterface._global_mapping?'my_attn'? added (my_attn)",
            "*GPT2MLP.forward replaced",
            "ERROR *test_leaks_in_xfail*",
        ]
    )


def test_warn_mode_reports_without_failing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(HEADER + "\ndef test_rebinds():\n    modeling_llama.LlamaRMSNorm = MyNorm\n")
    result = pytester.runpytest("-o", "modelpatch_leaks=warn", "-W", "default")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*modeling_llama.LlamaRMSNorm: LlamaRMSNorm -> MyNorm*"])


def test_revert_by_reload_is_not_a_leak_and_the_originals_come_back(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        HEADER
        + """
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


def test_a_patches_then_reloads():
    # what Liger-Kernel's own tests do to undo apply_liger_kernel_to_llama()
    modeling_llama.LlamaRMSNorm = MyNorm
    modeling_llama.LlamaForCausalLM.forward = fast_forward
    importlib.reload(modeling_llama)
    assert modeling_llama.LlamaRMSNorm is not MyNorm


def test_b_sees_the_original_classes():
    assert modeling_llama.LlamaForCausalLM is transformers.LlamaForCausalLM is LlamaForCausalLM
    assert MODEL_FOR_CAUSAL_LM_MAPPING[LlamaConfig] is LlamaForCausalLM
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM
    assert LlamaForCausalLM.forward is not fast_forward
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32)
    assert type(AutoModelForCausalLM.from_config(config)) is LlamaForCausalLM
"""
    )
    result = pytester.runpytest("-o", "modelpatch_leaks=error")  # plain tests: explicit, as a suite opts in
    result.assert_outcomes(passed=2)


# What a kernel hub decorator makes of a function, three ways; each leaves a class as it is.
KERNEL_DECORATORS = {
    # kernels 0.16's use_kernel_forward_from_hub: an instance of an nn.Module class made per call
    "class-per-call": """
def kernel_func(layer_name):
    def decorator(target):
        if isinstance(target, type):
            return target

        class Func(torch.nn.Module):
            kernel_layer_name = layer_name

            def forward(self, *args, **kwargs):
                return target(*args, **kwargs)

        return Func()

    return decorator
""",
    "callable-object": """
class KernelFunc:
    def __init__(self, func, layer_name):
        self.func, self.layer_name = func, layer_name

    def __call__(self, *args, **kwargs):
        return self.func(*args, **kwargs)


def kernel_func(layer_name):
    return lambda target: target if isinstance(target, type) else KernelFunc(target, layer_name)
""",
    "functools-wraps": """
def kernel_func(layer_name):
    def decorator(target):
        if isinstance(target, type):
            return target

        @functools.wraps(target)
        def wrapper(*args, **kwargs):
            return target(*args, **kwargs)

        return wrapper

    return decorator
""",
}


@pytest.mark.parametrize("decorator", KERNEL_DECORATORS.values(), ids=KERNEL_DECORATORS.keys())
def test_reload_rebuilds_a_kernel_decorated_function_and_a_patch_of_it_is_still_a_leak(
    pytester: pytest.Pytester, decorator: str
) -> None:
    # With kernels installed (CI's transformers 5.17 lane), modeling_llama's apply_rotary_pos_emb
    # is what kernels' decorator made of it, and a reload makes another. Without kernels, the
    # decorator above stands in for kernels' in transformers.integrations, where modeling_llama
    # reads it when a reload re-executes it, and builds the session's baseline the same way.
    pytester.makeconftest(
        """
import functools
import types

import torch
import transformers.integrations
from transformers.models.llama import modeling_llama
"""
        + decorator
        + """

if isinstance(modeling_llama.apply_rotary_pos_emb, types.FunctionType):  # kernels not installed
    # as if modeling_llama had been imported with it (use_kernel_func_from_hub: transformers 5.3)
    for name in ("use_kernel_forward_from_hub", "use_kernel_func_from_hub"):
        setattr(transformers.integrations, name, kernel_func)
        if hasattr(modeling_llama, name):
            setattr(modeling_llama, name, kernel_func)
    modeling_llama.apply_rotary_pos_emb = kernel_func("rotary_pos_emb")(modeling_llama.apply_rotary_pos_emb)
"""
    )
    pytester.makepyfile(
        HEADER
        + """
from transformers import integrations

ORIGINAL_ROPE = modeling_llama.apply_rotary_pos_emb


def my_rope(q, k, cos, sin, unsqueeze_dim=1):
    return q, k


def test_a_patches_then_reloads():
    modeling_llama.apply_rotary_pos_emb = integrations.use_kernel_forward_from_hub("rotary_pos_emb")(my_rope)
    modeling_llama.LlamaRMSNorm = MyNorm
    importlib.reload(modeling_llama)
    assert modeling_llama.apply_rotary_pos_emb is not ORIGINAL_ROPE  # built anew by the decorator


def test_b_runs_the_original():
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_ROPE
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32)
    assert LlamaForCausalLM(config)(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 32)


def test_c_reloads_then_patches_the_decorated_function():
    importlib.reload(modeling_llama)
    modeling_llama.apply_rotary_pos_emb = integrations.use_kernel_forward_from_hub("rotary_pos_emb")(my_rope)


def test_d_sees_the_original():
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_ROPE
"""
    )
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=4, errors=1)
    # the label names the function inside the decorator's object: Func(apply_rotary_pos_emb) -> Func(my_rope)
    result.stdout.fnmatch_lines(["*test_c_reloads_then_patches_the_decorated_function leaked*",
                                 "*modeling_llama.apply_rotary_pos_emb: *apply_rotary_pos_emb* -> *my_rope*"])  # fmt: skip
    result.stdout.no_fnmatch_line("*test_a_patches_then_reloads leaked*")


def test_patches_outside_the_leaking_test_are_charged_to_their_fixture(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
from transformers.models.llama import modeling_llama
# patched at import time, as `import my_kernels` does: the session's baseline, not a leak
modeling_llama.LlamaMLP.conftest_marker = True
"""
    )
    pytester.makepyfile(
        HEADER
        + """
from transformers.monkey_patching import register_patch_mapping, clear_patch_mapping


class ExplodingAttention(modeling_llama.LlamaAttention):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("replacement __init__ failed")


@pytest.fixture(scope="session")
def fast_norm():
    modeling_llama.LlamaRMSNorm = MyNorm
    yield
    modeling_llama.LlamaRMSNorm = ORIGINAL_NORM


@pytest.fixture(scope="module")
def failed_patched_load():
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32)
    register_patch_mapping({"LlamaAttention": ExplodingAttention})
    try:
        LlamaForCausalLM(config)  # raises inside transformers' apply_patches
    except RuntimeError:
        pass
    finally:
        clear_patch_mapping()


@pytest.fixture(scope="module")
def leaky_module_fixture():
    modeling_llama.LlamaMLP.forward = fast_forward


def test_uses_the_session_patch(fast_norm):
    assert modeling_llama.LlamaRMSNorm is MyNorm


def test_after_a_failed_load_in_a_module_fixture(failed_patched_load):
    assert modeling_llama.LlamaAttention is not ExplodingAttention
    assert modeling_llama.LlamaMLP.conftest_marker


def test_uses_the_leaky_fixture(leaky_module_fixture):
    pass
"""
    )
    result = pytester.runpytest("-o", "modelpatch_leaks=error")  # plain tests: explicit, as a suite opts in
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*module-scoped fixture 'leaky_module_fixture' leaked transformers patch state*", "*LlamaMLP.forward replaced"]
    )
    result.stdout.no_fnmatch_line("*fast_norm*leaked*")
    result.stdout.no_fnmatch_line("*conftest_marker*")


def test_a_leak_that_keeps_sizes_and_values_is_caught_after_clean_tests(pytester: pytest.Pytester) -> None:
    # Clean tests first: the guard then compares with the state the last restore left (its fast
    # path). Each leak below keeps every dict's size, and most keep its values in order too.
    pytester.makepyfile(
        HEADER
        + """
from transformers import conversion_mapping


def test_a_clean():
    pass


def test_b_clean():
    pass


def test_c_renames_the_last_global_keeping_its_value():
    namespace = modeling_llama.__dict__
    key = list(namespace)[-1]
    namespace["renamed_" + key] = namespace.pop(key)


def test_d_registers_a_conversion_name_only():
    if not hasattr(conversion_mapping, "USER_REGISTERED_MAPPINGS"):
        pytest.skip("this transformers keeps no set of user-registered conversion names")
    conversion_mapping.USER_REGISTERED_MAPPINGS.add("my_family")


def test_e_replaces_a_recorder_target_in_place():
    modeling_llama.LlamaPreTrainedModel._can_record_outputs["attentions"] = MyNorm


def test_z_sees_the_originals():
    assert not any(key.startswith("renamed_") for key in vars(modeling_llama))
    assert "my_family" not in getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", ())
    assert modeling_llama.LlamaPreTrainedModel._can_record_outputs["attentions"] is modeling_llama.LlamaAttention
"""
    )
    from transformers import conversion_mapping

    named = hasattr(conversion_mapping, "USER_REGISTERED_MAPPINGS")  # transformers 5.3 has no such set
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=6 if named else 5, skipped=0 if named else 1, errors=3 if named else 2)
    expected = ["*modeling_llama.renamed_* added*", "*_can_record_outputs?'attentions'? is *MyNorm*"]
    if named:
        expected.append("*checkpoint conversions: 'my_family' was registered and not removed")
    result.stdout.fnmatch_lines_random(expected)


def test_a_wider_fixture_requested_from_a_test_body_is_charged_to_the_fixture(pytester: pytest.Pytester) -> None:
    # request.getfixturevalue() sets a module fixture up inside the test's guard: its patch is the
    # baseline of every later test of the module, not a leak of the test that happened to ask first
    pytester.makepyfile(
        test_a_module=HEADER
        + """
@pytest.fixture(scope="module")
def fast_norm():
    modeling_llama.LlamaRMSNorm = MyNorm
    yield
    modeling_llama.LlamaRMSNorm = ORIGINAL_NORM


@pytest.fixture(scope="module")
def leaky_mlp():
    modeling_llama.LlamaMLP.forward = fast_forward


def test_a_asks_from_its_body(request):
    request.getfixturevalue("fast_norm")
    assert modeling_llama.LlamaRMSNorm is MyNorm


def test_b_still_sees_the_fixtures_patch(fast_norm):
    assert modeling_llama.LlamaRMSNorm is MyNorm


def test_c_asks_for_a_leaky_fixture(request):
    request.getfixturevalue("leaky_mlp")
    assert modeling_llama.LlamaMLP.forward is fast_forward


def test_d_still_sees_it():
    assert modeling_llama.LlamaMLP.forward is fast_forward
""",
        test_b_module=HEADER
        + """
def test_z_sees_the_originals():
    assert modeling_llama.LlamaRMSNorm is ORIGINAL_NORM
    assert modeling_llama.LlamaMLP.forward is ORIGINAL_MLP_FORWARD
""",
    )
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=5, errors=1)
    result.stdout.fnmatch_lines(["*module-scoped fixture 'leaky_mlp' leaked*", "*LlamaMLP.forward replaced"])
    result.stdout.no_fnmatch_line("*test_*_asks_* leaked*")
    result.stdout.no_fnmatch_line("*fast_norm*leaked*")
