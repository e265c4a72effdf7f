"""``@pytest.mark.parallel(mesh={"fsdp": 2, "tp": 2})``: FSDP2 over tensor parallelism on a 2-D mesh of 4 gloo ranks.

transformers builds the mesh from ``DistributedConfig(tp_size=, fsdp_size=)``, shards by its TP
plan on ``tp`` and by its FSDP plan on ``fsdp``; every check gathers the patched side. A right
patch passes and its broken twin fails, in one pytest run (one pool of 4 ranks). The marker's
arguments are refused with a fix before any rank starts.
"""

from __future__ import annotations

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.parallel.marker import ParallelSpec

MESH_TESTS = """
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from fixtures.patches import llama_fused_qkv_tp as qkv
from fixtures.patches import llama_rmsnorm_autograd as right
from fixtures.patches import llama_rmsnorm_autograd_broken as broken
from pytest_modelpatch import assert_backward_equivalent, assert_equivalent
from pytest_modelpatch.compare._engine.sharded import sharding_line


@pytest.mark.model("llama")
@pytest.mark.patch(right.MAPPING)
@pytest.mark.parallel(mesh={"fsdp": 2, "tp": 2})
def test_right_rmsnorm(reference_model, patched_model):
    assert type(patched_model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"
    assert patched_model.model.layers[0].self_attn.q_proj.weight.device_mesh.mesh_dim_names == ("fsdp", "tp")
    where = sharding_line(patched_model)
    assert where == f"sharded: FSDP2 over tensor parallel over 4 ranks, mesh fsdp=2 x tp=2 (gloo), seen on rank {dist.get_rank()}"
    assert_equivalent(reference_model, patched_model)
    assert_backward_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(broken.MAPPING)
@pytest.mark.parallel(mesh={"fsdp": 2, "tp": 2})
def test_broken_rmsnorm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)  # its forward is right
    assert_backward_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(qkv.MAPPING, conversions=qkv.CONVERSIONS, tp_plan=qkv.TP_PLAN)
@pytest.mark.parallel(mesh={"fsdp": 2, "tp": 2})
def test_fused_qkv_from_a_conversion(reference_model, patched_model):
    # the truth, from the weights: the block this tensor-parallel rank computes with, against its
    # own slices of q, k and v in order (what parallel("tp") loads, and the attention splits)
    attention, fused = reference_model.model.layers[0].self_attn, patched_model.model.layers[0].self_attn.qkv_proj.weight
    block = fused.redistribute(placements=[Replicate(), fused.placements[1]]).to_local()
    rank = fused.device_mesh.get_local_rank("tp")
    in_order = torch.cat([p.weight.chunk(2)[rank] for p in (attention.q_proj, attention.k_proj, attention.v_proj)])
    if torch.equal(block, in_order):
        assert_equivalent(reference_model, patched_model)
    else:  # the model computes with misordered weights: the check must fail and say why
        with pytest.raises(AssertionError, match=r"hint: model\\.layers\\.0\\.self_attn\\.qkv_proj\\.weight \\(and 1 more"):
            assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.parallel("tp", mesh={"fsdp": 2, "tp": 2})
def test_kind_and_mesh(patched_model):
    pass


@pytest.mark.model("llama")
@pytest.mark.parallel(mesh={"fsdp": 2, "tp": 3})
def test_tp_size_that_does_not_divide_the_heads(patched_model):
    pass
"""


def _distributed_config_takes_sizes() -> bool:
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return "fsdp_size" in getattr(DistributedConfig, "__dataclass_fields__", {})


@pytest.mark.skipif(not _distributed_config_takes_sizes(), reason="transformers has no DistributedConfig(fsdp_size=)")
def test_mesh_passes_a_right_patch_and_fails_its_broken_twin_on_four_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mesh=MESH_TESTS)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=1, errors=2)  # the usage errors fail the setup, before any rank
    result.stdout.fnmatch_lines_random([
        "*AssertionError: patched FSDPLlamaForCausalLM differs from reference LlamaForCausalLM in training*",
        "*replaced module whose own gradients differ: model.norm*",
        "parallel(mesh={'fsdp': 2, 'tp': 2}) on gloo: failed on rank 0 of 4 (the report above is its); "
        "rank 1 failed, rank 2 failed, rank 3 failed",
        "*PatchUsageError: @pytest.mark.parallel on test_mesh.py::test_kind_and_mesh: give either a kind or mesh=*",
        "PatchUsageError: parallel(mesh={'fsdp': 2, 'tp': 3}) cannot shard LlamaForCausalLM: *do not divide by 3. "
        "Use a 'tp' size that divides both (2, 4)*",
    ])  # fmt: skip


def test_mesh_sets_the_world_size_to_the_product_of_its_sizes() -> None:
    spec = ParallelSpec.from_marker((), {"mesh": {"tp": 2, "dp_replicate": 2, "fsdp": 2}}, "t")
    assert (spec.kind, spec.world_size, spec.tp_size) == ("mesh", 8, 2)
    assert spec.mesh == (("dp_replicate", 2), ("fsdp", 2), ("tp", 2))  # outermost first, as transformers' mesh
    assert str(spec) == "parallel(mesh={'dp_replicate': 2, 'fsdp': 2, 'tp': 2})"
    assert ParallelSpec.from_marker((), {"mesh": {"fsdp": 2, "tp": 2}, "world_size": 4}, "t").world_size == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mesh": {"fsdp": 2, "pp": 2}}, r"mesh dimension\(s\) \['pp'\] unknown; use dp_replicate, fsdp, tp"),
        ({"mesh": {"fsdp": 2, "tp": 1}}, r"mesh\['tp'\] must be an int of at least 2, got 1; leave out a dimension"),
        ({"mesh": {"fsdp": 4}}, r"is not two-dimensional.*use the kind: @pytest.mark.parallel\('tp'\) or \('fsdp'\)"),
        ({"mesh": {"dp_replicate": 2, "tp": 2}}, r"dp_replicate \(HSDP\) replicates FSDP2's shards"),
        ({"mesh": [("fsdp", 2), ("tp", 2)]}, r"mesh must be a dict of dimension name to size"),
        ({"mesh": {"fsdp": 2, "tp": 2}, "world_size": 2}, r"world_size=2 but mesh=.* needs 4 ranks"),
        ({"mesh": {"fsdp": 2, "tp": 2}, "layout": "per_module"}, r"layout= is for parallel\('fsdp'\)"),
        ({"kind": "tp", "layout": "per_module"}, r"layout='per_module' is not an FSDP layout of parallel\('tp'\)"),
        ({"kind": "fsdp", "layout": "torchtitan"}, r"layout= takes 'root' or 'per_module'"),
    ],
)
def test_wrong_mesh_or_layout_is_a_usage_error_naming_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(PatchUsageError, match=message):
        ParallelSpec.from_marker((), kwargs, "t")
