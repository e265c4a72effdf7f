"""Inside the ranks the plugin isolates as everywhere: patches cleared after each test, leaks named, plans restored."""

from __future__ import annotations

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.parallel.marker import ParallelSpec

LEAKS = """
import pytest
import torch.distributed as dist
from transformers import LlamaConfig
from transformers.monkey_patching import get_patch_mapping, register_patch_mapping
from fixtures.patches import llama_fused_qkv, llama_fused_qkv_tp as tp

STOCK_PLAN = dict(LlamaConfig.base_model_tp_plan)


@pytest.mark.parallel()
def test_1_registers_and_leaks_in_the_ranks():
    register_patch_mapping(llama_fused_qkv.MAPPING)


@pytest.mark.parallel()
def test_2_assigns_the_class_plan():
    LlamaConfig.base_model_tp_plan = {"layers.*.self_attn.qkv_proj": "colwise"}


@pytest.mark.parallel()
def test_3_edits_the_class_plan_in_place():
    LlamaConfig.base_model_tp_plan["layers.*.mlp.up_proj"] = "rowwise"


@pytest.mark.model("llama")
@pytest.mark.patch(tp.MAPPING, conversions=tp.CONVERSIONS, tp_plan=tp.TP_PLAN)
@pytest.mark.parallel("tp")
def test_4_marks_register_and_plan_for_one_test(patched_model):
    assert type(patched_model.model.layers[0].self_attn).__name__ == "LlamaShardableQKVAttention"


@pytest.mark.parallel()
def test_5_every_rank_starts_clean():
    assert get_patch_mapping() == {}
    assert LlamaConfig.base_model_tp_plan == STOCK_PLAN and dist.get_world_size() == 2


def test_6_so_does_this_process():
    assert get_patch_mapping() == {}
    assert LlamaConfig.base_model_tp_plan == STOCK_PLAN
"""


def test_patches_and_plans_changed_in_the_ranks_are_named_and_restored(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_leaks=LEAKS)
    result = pytester.runpytest("-o", "modelpatch_leaks=error")
    result.assert_outcomes(passed=6, errors=3)
    result.stdout.fnmatch_lines_random([
        "*test_1_registers_and_leaks_in_the_ranks leaked transformers patch state*",
        "*patch mapping: 'LlamaAttention' -> fixtures.patches.llama_fused_qkv.LlamaFusedQKVAttention was registered*",
        "*LlamaConfig.base_model_tp_plan replaced*",
        "*LlamaConfig.base_model_tp_plan edited ('layers.*.mlp.up_proj': 'colwise' -> 'rowwise')*",
    ])  # fmt: skip


TP_PLAN_MISUSE = """
import pytest
from fixtures.patches import llama_fused_qkv_tp as tp


@pytest.mark.model("llama")
@pytest.mark.patch(tp.MAPPING, conversions=tp.CONVERSIONS, tp_plan={**tp.TP_PLAN, "layers.*.self_attn.qvk_proj": "colwise"})
@pytest.mark.parallel("tp")
def test_a_misspelt_entry(patched_model):
    pass


@pytest.mark.patch(tp_plan=["layers.*.self_attn.qkv_proj"])
def test_not_a_dict():
    pass


@pytest.mark.parallel("pipeline")
def test_unknown_kind():
    pass


@pytest.mark.parallel("tp", world_size=1)
def test_one_rank():
    pass
"""


def test_plan_entries_and_parallel_marks_that_cannot_work_are_usage_errors_naming_the_fix(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_misuse=TP_PLAN_MISUSE)
    result = pytester.runpytest()
    result.assert_outcomes(errors=4)
    result.stdout.fnmatch_lines_random([
        "*tp_plan entry 'layers.*.self_attn.qvk_proj' names no module or parameter of the patched model. "
        "Did you mean 'model.layers.*.self_attn.qkv_proj'?",
        "*tp_plan must be a dict {module pattern: style or None}*",
        "*@pytest.mark.parallel on test_misuse.py::test_unknown_kind: unknown kind 'pipeline'; use one of 'tp', 'fsdp', 'ddp', None.",
        "*world_size must be an int of at least 2 (the ranks to run), got 1.",
    ])  # fmt: skip


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("tp", "fsdp"), {}, "takes one positional argument"),
        ((), {"world_size": 2.0}, "world_size must be an int"),
        ((), {"timeout": 0}, "timeout must be a positive number"),
        ((), {"ranks": 2}, "unknown keyword(s) ['ranks']"),
    ],
)
def test_the_marker_refuses_wrong_arguments(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(PatchUsageError, match=rf".*{__import__('re').escape(message)}"):
        ParallelSpec.from_marker(args, kwargs, "test_x.py::test_x")


def test_the_marker_reads_kind_world_size_and_timeout() -> None:
    assert ParallelSpec.from_marker(("fsdp",), {"world_size": 4, "timeout": 30}, "t") == ParallelSpec("fsdp", 4, 30.0)
    assert ParallelSpec.from_marker((), {}, "t") == ParallelSpec(None, 2, 300.0)
