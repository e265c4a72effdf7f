"""``assert_trains_equivalent`` on a patched model sharded across 2 gloo ranks: one pytest run, one pool of ranks.

Under FSDP2 the checks run in any order on one model (each puts the weights back through the
sharded parameters), a stale packed MLP fails at step 1 with its report on rank 0 and no rank
crashes, and the next test in the same ranks passes. Tensor parallelism trains the stock model;
ranks fed different batches get a hint that says so.
"""

from __future__ import annotations

import json

import pytest

SHARDED_TRAINING = """
import pytest
import torch
import torch.distributed as dist
from fixtures.patches import llama_stale_packed_mlp as stale
from pytest_modelpatch import assert_equivalent, assert_trains_equivalent


@pytest.mark.model("llama")
@pytest.mark.parallel("fsdp")
def test_1_fsdp_equivalent_trains_equivalent(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    assert_trains_equivalent(reference_model, patched_model, steps=3)
    # the weights were put back: a second training from the same start, then the untrained outputs again
    assert_trains_equivalent(reference_model, patched_model, steps=2)
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(stale.MAPPING)
@pytest.mark.parallel("fsdp")
def test_2_fsdp_stale_packed_mlp(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)  # the forward is right
    assert_trains_equivalent(reference_model, patched_model, steps=3)


@pytest.mark.model("llama")
@pytest.mark.parallel("fsdp")
def test_3_fsdp_next_test_in_the_same_ranks(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.parallel("tp")
def test_4_tp_trains(reference_model, patched_model):
    assert type(patched_model.model.layers[0].mlp.gate_proj.weight).__name__ == "DTensor"
    assert_trains_equivalent(reference_model, patched_model, steps=3)
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.parallel("ddp")
def test_5_ddp_fed_different_batches(reference_model, patched_model):
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    assert_trains_equivalent(reference_model, patched_model, {"input_ids": ids}, steps=2)
"""


def test_training_sharded_puts_weights_back_through_the_shards_and_reports_each_failure(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_train=SHARDED_TRAINING)
    result = pytester.runpytest("-p", "no:randomly", "--modelpatch-report=report.json")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines_random([
        # the stale packed MLP: its own report, from rank 0, both ranks failed the same way (none crashed)
        "*AssertionError: patched FSDPLlamaForCausalLM trains differently from reference LlamaForCausalLM*"
        "first diverging at step 1: loss, gradient norm",
        "*  step 0: loss * (ok), gradient norm * (ok)",
        "*at step 1, first diverging module: model.layers.0.mlp (LlamaMLP in the reference, LlamaStalePackedMLP in the "
        "patched model; sharded: FSDP2 over 2 ranks (gloo), seen on rank 0)",
        "parallel('fsdp', world_size=2) on gloo: failed on rank 0 of 2 (the report above is its); rank 1 failed",
        # different batches per rank: said so
        "*hint: the ranks were given different batches (rank 1's differ from rank 0's). DistributedDataParallel "
        "averages the gradients over the ranks*",
    ])  # fmt: skip
    assert "SIGSEGV" not in result.stdout.str() and "during the test" not in result.stdout.str()
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    outcomes = [(r["nodeid"].rpartition("::")[2][:6], r["kind"], r["outcome"]) for r in rows]
    assert sorted(outcomes) == sorted([
        ("test_1", "equivalence", "passed"), ("test_1", "training", "passed"), ("test_1", "training", "passed"),
        ("test_1", "equivalence", "passed"),
        ("test_2", "equivalence", "passed"), ("test_2", "training", "failed"),
        ("test_3", "equivalence", "passed"),
        ("test_4", "training", "passed"), ("test_4", "equivalence", "passed"),
        ("test_5", "training", "failed"),
    ])  # fmt: skip
    # the second training starts where the first did: the weights were restored, not left trained
    fsdp = [r for r in rows if r["nodeid"].endswith("test_1_fsdp_equivalent_trains_equivalent")]
    assert [r["max_abs_error"] for r in fsdp if r["kind"] == "equivalence"] == [0, 0]
