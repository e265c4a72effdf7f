"""assert_backward_equivalent in real pytest runs: model marker, patch marker, report rows of kind backward."""

from __future__ import annotations

import json

import pytest

TESTS = """
import pytest
from fixtures import load_patch
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent

BROKEN = load_patch("llama_swiglu_autograd_broken").MAPPING
GOOD = load_patch("llama_swiglu_autograd").MAPPING
TRAINING_ONLY = load_patch("llama_training_path_mlp").MAPPING


@pytest.mark.model("llama")
@pytest.mark.patch(BROKEN)
def test_broken_forward(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(BROKEN)
def test_broken_backward(reference_model, patched_model):
    assert_backward_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(GOOD)
@pytest.mark.parametrize("kwargs", [{}, {"use_reentrant": True}, {"use_reentrant": False}])
def test_good_backward(reference_model, patched_model, kwargs):
    assert_backward_equivalent(reference_model, patched_model, gradient_checkpointing=bool(kwargs),
                               gradient_checkpointing_kwargs=kwargs or None)


@pytest.mark.model("llama")
@pytest.mark.patch(TRAINING_ONLY)
def test_training_only(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert_backward_equivalent(reference_model, patched_model)
"""


def test_broken_kernel_fails_only_backward_and_rows_say_backward(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernels=TESTS)
    result = pytester.runpytest("--modelpatch-report=report.json")
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines([
        "*first module in backward order whose gradient diverges: model.layers.1.mlp (LlamaMLP in the reference, "
        "LlamaDroppedUpSwiGLUMLP in the patched model)*",
        "*first diverging module: model.layers.0.mlp (LlamaMLP in the reference, LlamaTrainingPathMLP*",
    ])  # fmt: skip
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    backward = {r["nodeid"].rpartition("::")[2]: r["outcome"] for r in rows if r["kind"] == "backward"}
    assert backward == {
        "test_broken_backward": "failed", "test_good_backward[kwargs0]": "passed",
        "test_good_backward[kwargs1]": "passed", "test_good_backward[kwargs2]": "passed", "test_training_only": "failed",
    }  # fmt: skip
