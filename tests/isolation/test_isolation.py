"""The patch marker and leak guard leave transformers' global patch state as they found it."""

from __future__ import annotations

import pytest

PATCHED_ATTENTION = """
import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.monkey_patching import get_patch_mapping, register_patch_mapping, clear_patch_mapping


class MyAttention(LlamaAttention):
    pass
"""


def test_teardown_restores_after_pass_fail_and_error(pytester: pytest.Pytester, xdist_args: tuple[str, ...]) -> None:
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
@pytest.fixture
def broken_fixture():
    raise RuntimeError("fixture setup failed")


@pytest.mark.patch({"LlamaAttention": MyAttention})
def test_1_passes():
    assert get_patch_mapping() == {"LlamaAttention": MyAttention}


@pytest.mark.patch({"LlamaAttention": MyAttention})
def test_2_fails():
    assert get_patch_mapping() == {}


@pytest.mark.patch({"LlamaAttention": MyAttention})
def test_3_errors(broken_fixture):
    pass


def test_4_sees_a_clean_registry():
    assert get_patch_mapping() == {}
"""
    )
    result = pytester.runpytest(*xdist_args)
    result.assert_outcomes(passed=2, failed=1, errors=1)


def test_the_tests_scope_spans_its_function_fixtures_and_not_wider_ones(pytester: pytest.Pytester) -> None:
    # The scope opens before the first function-scoped fixture and closes after the last one's
    # teardown: the marker's patches reach those fixtures, their leaks are the test's, and a
    # module fixture the test is the first to use is neither patched nor charged to it.
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
SEEN = {}


@pytest.fixture(scope="module")
def module_patch():
    SEEN["module"] = dict(get_patch_mapping())
    register_patch_mapping({"LlamaMLP": MyAttention})
    yield
    clear_patch_mapping()


@pytest.fixture
def sees_the_marker():
    return dict(get_patch_mapping())


@pytest.fixture
def leaks_at_teardown():
    yield
    register_patch_mapping({"LlamaRMSNorm": MyAttention}, overwrite=True)


@pytest.mark.patch({"LlamaAttention": MyAttention})
def test_a_fixtures_see_the_marker(module_patch, sees_the_marker):
    assert SEEN["module"] == {}
    assert sees_the_marker == {"LlamaMLP": MyAttention, "LlamaAttention": MyAttention}


def test_b_module_patch_is_the_baseline(module_patch, leaks_at_teardown):
    assert get_patch_mapping() == {"LlamaMLP": MyAttention}
"""
    )
    result = pytester.runpytest("-p", "no:randomly", "-o", "modelpatch_leaks=error")  # test_b uses no plugin feature
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_b_module_patch_is_the_baseline leaked transformers patch state*", "*LlamaRMSNorm*"]
    )
    result.stdout.no_fnmatch_line("*fixture 'module_patch' leaked*")
    result.stdout.no_fnmatch_line("*LlamaMLP*registered*")


def test_a_bad_patch_marker_errors_its_test_and_leaves_the_fixtures_usable(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
@pytest.fixture
def value():
    return 1


@pytest.fixture
def skips():
    pytest.skip("a fixture that skips must not hide the bad marker")


@pytest.mark.patch({"LlamaAttention": 42})
def test_a_bad_marker(value):
    pass


@pytest.mark.patch({"LlamaAttention": 42})
def test_a_bad_marker_and_a_skipping_fixture(skips):
    pass


@pytest.mark.patch({"LlamaAttention": MyAttention})
def test_b_same_fixture(value):
    assert get_patch_mapping() == {"LlamaAttention": MyAttention}


def test_c_clean(value):
    assert get_patch_mapping() == {}
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_a_bad_marker *", "PatchUsageError: *"])
    result.stdout.fnmatch_lines(["*ERROR at setup of test_a_bad_marker_and_a_skipping_fixture*", "PatchUsageError: *"])


def test_teardown_restores_when_the_run_is_interrupted(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
def pytest_unconfigure(config):
    from transformers.monkey_patching import get_patch_mapping
    print("MAPPING AT EXIT:", sorted(get_patch_mapping()))
"""
    )
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
@pytest.mark.patch({"LlamaAttention": MyAttention})
def test_interrupted():
    raise KeyboardInterrupt
"""
    )
    result = pytester.runpytest_subprocess("-s")
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*", "MAPPING AT EXIT: []"])


RECORDER_LEAK = (
    PATCHED_ATTENTION
    + """
from conftest import LAYERS


def _eager(path):
    return LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")


{patched_test}


def test_b_fresh_model_records_every_attention(llama_checkpoint):
    out = _eager(llama_checkpoint)(torch.tensor([[1, 2, 3]]), output_attentions=True)
    assert len(out.attentions or ()) == LAYERS
"""
)


def test_output_recorders_restored_after_patched_from_pretrained(
    pytester: pytest.Pytester, tiny_llama_conftest: None, xdist_args: tuple[str, ...]
) -> None:
    patched_test = """
@pytest.mark.patch({"LlamaAttention": MyAttention})
def test_a_patched_model(llama_checkpoint):
    model = _eager(llama_checkpoint)
    assert type(model.model.layers[0].self_attn) is MyAttention
    out = model(torch.tensor([[1, 2, 3]]), output_attentions=True)
    assert len(out.attentions) == LAYERS
"""
    pytester.makepyfile(RECORDER_LEAK.format(patched_test=patched_test))
    result = pytester.runpytest(*xdist_args)
    result.assert_outcomes(passed=2)


def test_without_the_plugin_transformers_leaks_output_recorders(
    pytester: pytest.Pytester, tiny_llama_conftest: None
) -> None:
    # The control for the test above: the same sequence by hand, guard off, loses the attentions.
    patched_test = """
def test_a_patched_model(llama_checkpoint):
    register_patch_mapping({"LlamaAttention": MyAttention})
    try:
        _eager(llama_checkpoint)
    finally:
        clear_patch_mapping()
"""
    pytester.makepyfile(RECORDER_LEAK.format(patched_test=patched_test))
    result = pytester.runpytest_subprocess("-o", "modelpatch_leaks=off")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*assert 0 == 2*"])


def test_conversion_overwrite_is_undone_for_the_next_test(
    pytester: pytest.Pytester, xdist_args: tuple[str, ...]
) -> None:
    pytester.makepyfile(
        """
import pytest
from transformers import conversion_mapping
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

RENAME = WeightRenaming(source_patterns=r"\\.mlp\\.", target_patterns=".ffn.")
BUILTIN = repr(get_checkpoint_conversion_mapping("mixtral"))


@pytest.mark.patch(conversions={"mixtral": [RENAME]}, overwrite=True)
def test_a_overrides_builtin():
    assert [t.source_patterns for t in get_checkpoint_conversion_mapping("mixtral")] == [RENAME.source_patterns]


def test_b_builtin_is_back():
    assert repr(get_checkpoint_conversion_mapping("mixtral")) == BUILTIN
    assert not getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", set())


@pytest.mark.patch(conversions={"mixtral": [RENAME]})
def test_c_overriding_builtin_needs_overwrite():
    pass
"""
    )
    result = pytester.runpytest(*xdist_args)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*conversions for ?'mixtral'? already exist*Pass overwrite=True*"])


def test_leaking_test_is_reported_by_name_and_restored(pytester: pytest.Pytester, xdist_args: tuple[str, ...]) -> None:
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming


def test_leaky():
    register_patch_mapping({"LlamaAttention": MyAttention})
    register_checkpoint_conversion_mapping("llama", [WeightRenaming("a", "b")])


def test_after():
    assert get_patch_mapping() == {}
"""
    )
    result = pytester.runpytest(*xdist_args, "-o", "modelpatch_leaks=error")  # a plain test: errors only when asked
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaky*",
            "*test_leaky leaked transformers patch state*",
            "*'LlamaAttention' -> test_leaking_test_is_reported_by_name_and_restored.MyAttention was registered*",
            "*checkpoint conversions: *'llama' was registered*",
        ]
    )


def test_leak_mode_warn_reports_without_failing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
def test_leaky():
    register_patch_mapping({"LlamaAttention": MyAttention})


def test_after():
    assert get_patch_mapping() == {}
"""
    )
    result = pytester.runpytest("-o", "modelpatch_leaks=warn")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(["*ModelPatchWarning*test_leaky leaked*"])
    strict = pytester.runpytest(
        "-o", "modelpatch_leaks=warn", "-W", "error::pytest_modelpatch.errors.ModelPatchWarning"
    )
    strict.assert_outcomes(passed=2, errors=1)


def test_unknown_leak_mode_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("-o", "modelpatch_leaks=loud")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*modelpatch_leaks = 'loud': use one of error, warn, off*"])


def test_leaked_recorder_table_is_named(pytester: pytest.Pytester, tiny_llama_conftest: None) -> None:
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
def test_leaky(llama_checkpoint):
    register_patch_mapping({"LlamaAttention": MyAttention})
    try:
        LlamaForCausalLM.from_pretrained(llama_checkpoint)
    finally:
        clear_patch_mapping()
"""
    )
    result = pytester.runpytest("-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*LlamaPreTrainedModel._can_record_outputs?'attentions'? is *MyAttention (was *LlamaAttention)"]
    )


def test_method_and_context_patches_are_undone(pytester: pytest.Pytester, xdist_args: tuple[str, ...]) -> None:
    pytester.makepyfile(
        """
from contextlib import contextmanager
import pytest
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

ORIGINAL_FORWARD = LlamaRotaryEmbedding.forward
ORIGINAL_ROPE_INIT = vars(LlamaRotaryEmbedding)["compute_default_rope_parameters"]
EVENTS = []


class patched_LlamaRotaryEmbedding:
    _PATCHED_CLASS_ = LlamaRotaryEmbedding
    _PATCHES_ = ["forward", "compute_default_rope_parameters"]

    def forward(self, x, position_ids):
        return "patched"

    @staticmethod
    def compute_default_rope_parameters(config=None, device=None, seq_len=None):
        return 42


@contextmanager
def recording(label):
    EVENTS.append(("enter", label))
    yield
    EVENTS.append(("exit", label))


@pytest.mark.patch(methods=[patched_LlamaRotaryEmbedding], context=recording, label="rope")
def test_a_patched():
    assert LlamaRotaryEmbedding.forward is patched_LlamaRotaryEmbedding.__dict__["forward"]
    assert LlamaRotaryEmbedding.compute_default_rope_parameters() == 42  # still a staticmethod
    assert EVENTS == [("enter", "rope")]


def test_b_restored():
    assert LlamaRotaryEmbedding.forward is ORIGINAL_FORWARD
    assert vars(LlamaRotaryEmbedding)["compute_default_rope_parameters"] is ORIGINAL_ROPE_INIT
    assert EVENTS == [("enter", "rope"), ("exit", "rope")]
"""
    )
    pytester.makepyfile(
        test_stale="""
import pytest
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


class patched_Stale:
    _PATCHED_CLASS_ = LlamaRotaryEmbedding
    _PATCHES_ = ["renamed_upstream"]

    def renamed_upstream(self):
        pass


@pytest.mark.patch(methods=[patched_Stale])
def test_stale():
    pass
"""
    )
    result = pytester.runpytest(*xdist_args)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*patched_Stale patches ?'renamed_upstream'? on LlamaRotaryEmbedding*stale*"])


def test_marks_merge_across_module_class_and_function(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        PATCHED_ATTENTION
        + """
from transformers.models.llama.modeling_llama import LlamaMLP


class MyMLP(LlamaMLP):
    pass


class MyRMSNorm(torch.nn.Module):
    pass


pytestmark = pytest.mark.patch({"LlamaAttention": MyAttention})


@pytest.mark.patch({"LlamaMLP": MyMLP})
class TestMerged:
    @pytest.mark.patch({"LlamaRMSNorm": MyRMSNorm})
    def test_all_three(self):
        assert get_patch_mapping() == {"LlamaAttention": MyAttention, "LlamaMLP": MyMLP, "LlamaRMSNorm": MyRMSNorm}

    @pytest.mark.patch({"LlamaAttention": MyMLP})
    def test_conflict(self):
        pass
"""
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*patch key 'LlamaAttention' is given two different values: *MyMLP (mark on *test_conflict) "
            "and *MyAttention (mark on *test_marks_merge_across_module_class_and_function.py)*"
        ]
    )
