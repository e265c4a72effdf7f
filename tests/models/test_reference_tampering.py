"""A test that leaves the shared reference_model changed errors itself, naming the change; the next test gets a fresh one.

Each tampering below, left by a first test, used to make the second test's correct patch fail
("the patched model differs"). Now the first test errors at its teardown, and the second passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest
from pytest_modelpatch.models.reference import reference_changes

TWO_TESTS = """
import pytest
import torch
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent
from fixtures.patches.llama_swiglu_autograd import LlamaAutogradSwiGLUMLP

MODEL = pytest.mark.model("llama", attention_dropout=0.5)  # dropout, so that train mode shows in a forward


def double(module, args, output):
    return output * 2


def double_with_kwargs(module, args, kwargs, output):
    return output * 2


def double_input(module, args):
    return (args[0] * 2,)


def double_gradient(module, grad_input, grad_output):
    return (grad_input[0] * 2,)


@MODEL
def test_1_leaves_the_reference_changed(reference_model):
    {tamper}


@MODEL
@pytest.mark.patch({{"LlamaMLP": LlamaAutogradSwiGLUMLP}})
def test_2_a_correct_patch(reference_model, patched_model):
    {check}
"""

FORWARD = "assert_equivalent(reference_model, patched_model)"
BACKWARD = "assert_backward_equivalent(reference_model, patched_model)"
DIRECT = """inputs = torch.tensor([[1, 5, 7, 9, 3, 2]])
    with torch.no_grad():
        torch.testing.assert_close(reference_model(input_ids=inputs).logits, patched_model(input_ids=inputs).logits)"""

TAMPERINGS = [
    pytest.param(
        "reference_model.model.layers[0].mlp.register_forward_hook(double)",
        FORWARD,
        ["*model.layers.0.mlp: forward hook double (test_tamper.double) was left registered*", "*handle.remove()*"],
        id="forward-hook",
    ),
    pytest.param(
        "reference_model.model.layers[0].mlp.register_forward_hook(double_with_kwargs, with_kwargs=True)",
        FORWARD,
        ["*model.layers.0.mlp: forward hook double_with_kwargs (*with_kwargs=True) was left registered*"],
        id="forward-hook-with-kwargs",
    ),
    pytest.param(
        "reference_model.model.layers[1].mlp.register_forward_pre_hook(double_input)",
        FORWARD,
        ["*model.layers.1.mlp: forward pre-hook double_input (test_tamper.double_input) was left registered*"],
        id="forward-pre-hook",
    ),
    pytest.param(
        "reference_model.model.layers[0].mlp.register_full_backward_hook(double_gradient)",
        BACKWARD,
        ["*model.layers.0.mlp: full backward hook double_gradient (*) was left registered*"],
        id="backward-hook",
    ),
    pytest.param(
        "reference_model.model.layers[0].mlp.down_proj.weight.data.mul_(2)",
        FORWARD,
        ["*model.layers.0.mlp.down_proj.weight: values changed in place (norm * -> *, x2)*", "*model_builder*"],
        id="weight-edited-in-place",
    ),
    pytest.param(
        "reference_model.model.rotary_emb.inv_freq.mul_(2)",
        FORWARD,
        ["*model.rotary_emb.inv_freq: values changed in place (norm * -> *, x2)*"],
        id="buffer-edited-in-place",
    ),
    pytest.param(
        "reference_model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)",
        BACKWARD,
        ["*model.layers.0.mlp.down_proj.weight: requires_grad True -> False*"],
        id="requires-grad-flipped",
    ),
    pytest.param(
        "reference_model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.randn_like(reference_model.model.layers[0].mlp.down_proj.weight))",
        FORWARD,
        ["*model.layers.0.mlp.down_proj.weight: was replaced by another Parameter (norm * -> *)*"],
        id="parameter-replaced",
    ),
    pytest.param(
        "reference_model.model.layers[0].mlp = type(reference_model.model.layers[0].mlp)(reference_model.config)",
        FORWARD,
        ["*model.layers.0.mlp: was replaced by another LlamaMLP*"],
        id="submodule-replaced",
    ),
    pytest.param(
        "reference_model.train()",
        DIRECT,
        [
            "*left in train mode (built in eval mode): * of them (<the model itself>, model, *",
            "*reference_model.eval()*",
        ],
        id="left-in-train-mode",
    ),
    pytest.param(
        "reference_model.to(torch.bfloat16)",
        FORWARD,
        ["*dtype torch.float32 -> torch.bfloat16: * of them (model.embed_tokens.weight, *"],
        id="whole-model-to-bfloat16",
    ),
]


@pytest.mark.parametrize(("tamper", "check", "message"), TAMPERINGS)
def test_the_test_that_changed_the_reference_errors_and_the_next_one_passes(
    pytester: pytest.Pytester, tamper: str, check: str, message: list[str]
) -> None:
    pytester.makepyfile(test_tamper=TWO_TESTS.format(tamper=tamper, check=check))
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=1)  # test 1 passes, then errors at its teardown; test 2 passes
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_1_leaves_the_reference_changed*",
            "*reference_model is shared by the session's tests, and this test left it changed:*",
            *message,  # what changed, then how to fix it
        ]
    )
    result.stdout.fnmatch_lines(["*The next test would have compared its patch with this changed model*"])
    result.stdout.no_fnmatch_line("*test_2_a_correct_patch*FAILED*")


CLEAN = """
import pytest
import torch
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent, assert_trains_equivalent
from fixtures.patches.llama_swiglu_autograd import LlamaAutogradSwiGLUMLP

SEEN = []


def double(module, args, output):
    return output * 2


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": LlamaAutogradSwiGLUMLP})
def test_1_checks_that_train_the_reference_and_put_it_back(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert_backward_equivalent(reference_model, patched_model)
    # enabling checkpointing hooks the input embeddings (enable_input_require_grads): the check takes it off again
    assert_backward_equivalent(reference_model, patched_model, gradient_checkpointing=True)
    assert_trains_equivalent(reference_model, patched_model, steps=2)
    handle = reference_model.model.layers[0].mlp.register_forward_hook(double)
    handle.remove()  # a hook taken off again changes nothing
    inputs = torch.tensor([[1, 5, 7, 9]])
    reference_model(input_ids=inputs, labels=inputs).loss.backward()  # .grad left set: not a change of the model
    patched_model.model.layers[0].mlp.register_forward_hook(double)  # the test's own model: its business
    SEEN.extend([reference_model, patched_model])


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": LlamaAutogradSwiGLUMLP})
def test_2_gets_the_same_reference_without_gradients_and_a_fresh_patched_model(reference_model, patched_model):
    assert reference_model is SEEN[0] and patched_model is not SEEN[1]
    assert all(p.grad is None for p in reference_model.parameters())
    assert_equivalent(reference_model, patched_model)
"""


def test_checks_that_train_the_reference_and_put_it_back_raise_no_false_alarm(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_clean=CLEAN)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2)


@pytest.fixture
def builder(tmp_path: Path) -> ModelBuilder:
    return ModelBuilder(tmp_path)


def test_a_reference_changed_outside_the_fixture_is_rebuilt_when_asked_for_again(builder: ModelBuilder) -> None:
    reference = builder.reference(ModelRequest("llama"))
    reference.lm_head.register_forward_hook(lambda module, args, output: output * 2)
    fresh = builder.reference(ModelRequest("llama"))
    assert fresh is not reference and not reference_changes(fresh)
    assert builder.reference(ModelRequest("llama")) is fresh


def test_taking_back_an_unchanged_reference_keeps_it_cached(builder: ModelBuilder) -> None:
    reference = builder.reference(ModelRequest("llama"))
    with torch.no_grad():
        reference(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert builder.take_back(reference) is None
    assert builder.reference(ModelRequest("llama")) is reference


def test_a_buffer_the_model_re_derives_drops_it_from_the_cache_without_blame(builder: ModelBuilder) -> None:
    # dynamic RoPE recomputes inv_freq for an input longer than max_position_embeddings, in its forward
    request = ModelRequest("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}})
    reference = builder.reference(request)
    with torch.no_grad():
        reference(input_ids=torch.ones(1, reference.config.max_position_embeddings + 8, dtype=torch.long))
    changes = reference_changes(reference)
    assert changes.derived and changes.changes == []
    assert builder.take_back(reference) is None
    assert builder.reference(request) is not reference


@pytest.fixture(scope="module")
def big_bird(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return ModelBuilder(tmp_path_factory.mktemp("big_bird")).reference(ModelRequest("big_bird"))


def test_a_model_that_rewires_itself_is_not_blamed_but_a_hook_on_its_new_module_is(big_bird: torch.nn.Module) -> None:
    # BigBird swaps its block-sparse attention for full attention on a short input (its own forward)
    with torch.no_grad():
        big_bird(input_ids=torch.tensor([[5, 6, 7, 8]]))
    attention = big_bird.bert.encoder.layer[0].attention
    assert type(attention.self).__name__ == "BigBirdSelfAttention"
    assert not reference_changes(big_bird)
    handle = attention.self.register_forward_hook(lambda module, args, output: output)
    try:
        [change] = reference_changes(big_bird).changes
        assert change.where == "bert.encoder.layer.0.attention.self" and "forward hook" in change.what
    finally:
        handle.remove()
    assert not reference_changes(big_bird)
