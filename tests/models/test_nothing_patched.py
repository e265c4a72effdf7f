"""A patched model with nothing patched is a usage error, not a pass: it would be the reference compared with itself."""

from __future__ import annotations

import pytest
from _support.runs import IN_ORDER

SUITE = """
import pytest
from transformers.models.llama.modeling_llama import LlamaMLP
from pytest_modelpatch import assert_equivalent
from pytest_modelpatch.models.builder import ModelRequest


class SameMLP(LlamaMLP):
    pass


@pytest.mark.model("llama")
def test_nothing(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patches({"LlamaMLP": SameMLP})
def test_misspelled(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(allow={"LlamaMLP": ["NO_MATCH"]})
def test_marked_but_empty(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": SameMLP})
def test_real(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_baseline(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


def test_builder(model_builder):
    with pytest.raises(Exception, match="nothing patches this model"):
        model_builder.patched(ModelRequest("llama"))
    model_builder.patched(ModelRequest("llama"), unpatched=True)


def test_registered_in_the_body(model_builder, patch_registry):
    patch_registry.register({"LlamaMLP": SameMLP})
    assert type(model_builder.patched(ModelRequest("llama")).model.layers[0].mlp) is SameMLP
"""


def test_a_patched_model_with_no_patch_fails_naming_what_is_missing_and_a_real_patch_passes(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest(*IN_ORDER, "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=4, errors=3)
    for name in ("test_nothing", "test_marked_but_empty"):
        result.stdout.fnmatch_lines(
            [
                f"*ERROR at setup of {name}*",
                "*PatchUsageError: *patched_model: nothing patches this model: no class "
                "mapping or conversions are registered, no method or context patch is active*",
            ]
        )
    result.stdout.fnmatch_lines(["*ERROR at setup of test_misspelled*", "*Did you mean @pytest.mark.patch?*"])
    result.stdout.fnmatch_lines(["*@pytest.mark.patch(unpatched=True)*"])


def test_unpatched_must_be_a_bool(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.patch(unpatched="yes")
        def test_x():
            pass
        """
    )
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*unpatched must be True*or False, got 'yes'*"])
