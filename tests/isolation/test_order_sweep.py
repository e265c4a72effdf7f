"""Outcomes do not depend on order: the isolation and fixture scenarios, in many shuffled orders, in one session.

Every scenario is a real test on a session-shared tiny Llama: patches of every kind (a class
mapping, a method patch, context patches, a loader wrapper on the Auto class), each either
one that must fail (it changes the numbers) or one that must pass. One pytest session runs
them ``MODELPATCH_ORDER_SWEEP`` times over (default 10; CI's sweep step runs 200), each
block in its own seeded random order, so cached references, checkpoints and output-capture
hooks are shared across every order, as in a real session. A wrong outcome in any block is
an order dependence: a poisoned shared reference, a leaked patch, a lost capture hook.
"""

from __future__ import annotations

import json
import os

import pytest

BLOCKS = int(os.environ.get("MODELPATCH_ORDER_SWEEP", "10"))

CONFTEST = """
import json
import random

import pytest

BLOCKS = {blocks}
WRONG = []
RAN = []


@pytest.fixture(autouse=True, params=range(BLOCKS), ids=lambda b: f"order{{b}}")
def _block(request):
    return request.param


def pytest_collection_modifyitems(items):
    blocks = {{}}
    for item in items:
        blocks.setdefault(item.callspec.params["_block"], []).append(item)
    ordered = []
    for block, members in sorted(blocks.items()):
        random.Random(block).shuffle(members)  # each block its own order
        ordered += members
    items[:] = ordered


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        name = report.nodeid.split("::")[-1].split("[")[0]
        expected = "failed" if name.startswith("test_fail_") else "passed"
        if report.when == "call" or report.outcome == "failed":
            RAN.append(report.nodeid)
            if report.outcome != expected or report.when != "call":
                WRONG.append(f"{{report.nodeid}}: {{report.when}} {{report.outcome}}, expected {{expected}}")


def pytest_sessionfinish(session):
    with open("sweep.json", "w") as out:
        json.dump({{"ran": len(RAN), "wrong": WRONG}}, out)
"""

SCENARIOS = """
import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
)
from pytest_modelpatch import assert_equivalent

IDS = torch.tensor([[5, 9, 2, 7, 1, 3]])


def hidden_states(model):
    return model(input_ids=IDS, output_hidden_states=True).hidden_states


class MyDecoderLayer(LlamaDecoderLayer):
    pass


class NoWeightRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(hidden_states.dtype)


class scaled_LlamaMLP:
    _PATCHED_CLASS_ = LlamaMLP
    _PATCHES_ = ["forward"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 1.01)


@contextlib.contextmanager
def scaled_rope(factor):
    original = LlamaRotaryEmbedding.forward
    LlamaRotaryEmbedding.forward = lambda self, x, position_ids: original(self, x, position_ids * factor)
    try:
        yield
    finally:
        LlamaRotaryEmbedding.forward = original


@contextlib.contextmanager
def doubling_loader():
    original = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        model.lm_head.weight.data.mul_(2)
        return model

    AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        AutoModelForCausalLM.from_pretrained = classmethod(original)


@pytest.mark.model("llama")
def test_pass_plain_reference_keeps_hidden_states(reference_model):
    states = hidden_states(reference_model)
    assert states is not None and len(states) == reference_model.config.num_hidden_layers + 1


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_pass_plain_models_agree(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert len(hidden_states(patched_model)) == len(hidden_states(reference_model))


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaDecoderLayer": MyDecoderLayer})
def test_pass_decoder_layer_patch_keeps_hidden_states(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert len(hidden_states(patched_model)) == len(hidden_states(reference_model)) == 3


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaRMSNorm": NoWeightRMSNorm})
def test_fail_norm_ignoring_its_weight(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(methods=[scaled_LlamaMLP])
def test_fail_method_patch(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(context=scaled_rope, factor=2)
def test_fail_context_patch(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(context=scaled_rope, factor=1)
def test_pass_noop_context_patch(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(context=doubling_loader)
def test_fail_loader_wrapper(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
def test_pass_reference_untouched_by_earlier_patches(reference_model):
    assert type(reference_model.model.norm) is LlamaRMSNorm
    assert type(reference_model.model.layers[0]) is LlamaDecoderLayer
    assert LlamaMLP.forward.__qualname__ == "LlamaMLP.forward"
    assert LlamaRotaryEmbedding.forward.__qualname__ == "LlamaRotaryEmbedding.forward"
"""


def test_every_scenario_keeps_its_outcome_in_every_shuffled_order(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.format(blocks=BLOCKS))
    pytester.makepyfile(test_scenarios=SCENARIOS)
    result = pytester.runpytest("-q", "--tb=no", "-rN", "-p", "no:randomly", "-p", "no:cacheprovider")
    summary = json.loads((pytester.path / "sweep.json").read_text())
    scenarios = SCENARIOS.count("\ndef test_")
    print(f"order sweep: {BLOCKS} shuffled orders x {scenarios} scenarios = {summary['ran']} runs, "
          f"{len(summary['wrong'])} wrong outcomes")  # fmt: skip
    assert summary["ran"] == BLOCKS * scenarios, result.stdout.str()[-3000:]
    assert summary["wrong"] == [], "\n".join(summary["wrong"][:20])
    result.assert_outcomes(passed=BLOCKS * (scenarios - SCENARIOS.count("\ndef test_fail_")),
                           failed=BLOCKS * SCENARIOS.count("\ndef test_fail_"))  # fmt: skip
