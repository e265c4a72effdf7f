"""On a CUDA GPU, what the GPU lane (.ci/gpu) proves: devices and dtypes, bf16 equivalence and greedy
generation on a few families with their patches, one GPU per xdist worker, the GPU's name on report rows.

Every test here is marked ``gpu``: skipped with the reason on a machine without one (so the CPU
suite only collects them), an error under ``--modelpatch-require-gpu``, as .ci/gpu runs them.
docs/ci.md quotes their last run on a GPU, with the card's name.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_devices import MARKED

from fixtures.patches import llama_fused_qkv, mechanisms, mistral_fused_qkv, qwen3_moe_router
from pytest_modelpatch import assert_decodes_equivalent, assert_equivalent, assert_trains_equivalent

# fresh_interpreter: pytester runs start a new interpreter, since CUDA does not work in a child forked
# from a process that initialised it (the warm fork server's imports may ask torch.cuda.is_available())
pytestmark = [pytest.mark.gpu, pytest.mark.fresh_interpreter]

# dense with GQA, sliding-window attention, mixture of experts, Gemma's (1 + weight) norm: each with a patch that is right
FAMILY_PATCHES = [
    pytest.param("llama", marks=[pytest.mark.model("llama"),
                 pytest.mark.patch(llama_fused_qkv.MAPPING, conversions=llama_fused_qkv.CONVERSIONS)]),
    pytest.param("mistral", marks=[pytest.mark.model("mistral"),
                 pytest.mark.patch(mistral_fused_qkv.MAPPING, conversions=mistral_fused_qkv.CONVERSIONS)]),
    pytest.param("qwen3_moe", marks=[pytest.mark.model("qwen3_moe"), pytest.mark.patch(qwen3_moe_router.MAPPING)]),
    pytest.param("gemma", marks=[pytest.mark.model("gemma"), pytest.mark.patch(
        {"^GemmaRMSNorm$": mechanisms.GemmaStyleNorm}, allow={"^GemmaRMSNorm$": ["SIGNATURE"]})]),
]  # fmt: skip


@pytest.mark.parametrize("family", FAMILY_PATCHES)
@pytest.mark.dtypes("bfloat16")
def test_bf16_forward_and_greedy_generation_match_on_the_gpu(
    reference_model: torch.nn.Module, patched_model: torch.nn.Module, device: str, dtype: torch.dtype, family: str
) -> None:
    assert patched_model.device.type == "cuda" and patched_model.dtype == torch.bfloat16
    assert reference_model.device == patched_model.device
    assert_equivalent(reference_model, patched_model)  # the tolerance follows the dtype
    assert_decodes_equivalent(reference_model, patched_model)


@pytest.mark.model("llama", num_hidden_layers=1)
@pytest.mark.patch(llama_fused_qkv.MAPPING, conversions=llama_fused_qkv.CONVERSIONS)
@pytest.mark.dtypes("float32", "float16", "bfloat16")
def test_fused_qkv_in_every_dtype_on_the_gpu(
    reference_model: torch.nn.Module, patched_model: torch.nn.Module, device: str, dtype: torch.dtype
) -> None:
    assert device.startswith("cuda") and patched_model.dtype == dtype
    assert_equivalent(reference_model, patched_model)


def test_the_device_and_dtype_markers_run_every_cell_with_a_gpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MARKED)  # gpu, cpu, and devices("cpu", "cuda") x dtypes("fp32", "bfloat16")
    result = pytester.runpytest("-rA", "--modelpatch-require-gpu")
    result.assert_outcomes(passed=6)  # without a GPU, 3 pass and 3 skip (test_devices.py)
    result.stdout.fnmatch_lines_random(["PASSED *::test_needs_gpu", "PASSED *::test_grid?cuda-bfloat16?"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU per xdist worker needs two GPUs")
def test_each_xdist_worker_gets_its_own_gpu(pytester: pytest.Pytester) -> None:
    tests = "".join(f"def test_{i}(device):\n    open(f'ran-on-{{device}}-{i}', 'w').close()\n\n\n" for i in range(4))
    pytester.makepyfile(tests)
    result = pytester.runpytest("-n", "2", "--modelpatch-device", "cuda", "--modelpatch-require-gpu")
    result.assert_outcomes(passed=4)
    used = {path.name.rpartition("-")[0] for path in pytester.path.glob("ran-on-*")}
    assert used == {"ran-on-cuda:0", "ran-on-cuda:1"}  # worker gwN gets cuda:{N % device_count}


ROW_ON_THE_GPU = """
import pytest
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_stock(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


def test_report_rows_and_header_carry_this_gpus_name(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ROW_ON_THE_GPU)
    result = pytester.runpytest(
        "--modelpatch-device", "cuda", "--modelpatch-require-gpu", "--modelpatch-report", "r.json"
    )
    result.assert_outcomes(passed=1)
    data = json.loads((pytester.path / "r.json").read_text())
    name = torch.cuda.get_device_name(0)
    (row,) = data["rows"]
    assert (row["device"], row["device_class"]) == ("cuda:0", name)
    header = data["header"]
    assert header["accelerators"][0] == name and header["default_device_class"] == name
    assert header["default_device"] == "cuda" and header["device_classes"] == [name]


@pytest.mark.model("qwen3_vl", fusion_config={"patch_embeddings": True})
def test_float32_checks_run_without_the_callers_tf32(
    reference_model: torch.nn.Module, patched_model: torch.nn.Module, device: str
) -> None:
    # the reference's patch embedding is a Conv3d (cuDNN: TF32 by default on Ampere and later),
    # the fused one a Linear: on an H200 they differed by 1e-3 until checks ran at IEEE float32
    from pytest_modelpatch.compare._engine.inputs import default_inputs

    backends = (torch.backends.cudnn.conv, torch.backends.cuda.matmul)
    saved = [flag.fp32_precision for flag in backends]
    try:
        for flag in backends:
            flag.fp32_precision = "tf32"
        if torch.cuda.get_device_capability()[0] >= 8:  # a card with TF32: the flags matter here
            inputs = default_inputs(reference_model)
            with torch.no_grad():
                by_hand = [model(**inputs).last_hidden_state for model in (reference_model, patched_model)]
            assert (by_hand[0] - by_hand[1]).abs().max().item() > 1e-4  # over the float32 allowance
        assert_equivalent(reference_model, patched_model)
        assert [flag.fp32_precision for flag in backends] == ["tf32", "tf32"]
    finally:
        for flag, value in zip(backends, saved):
            flag.fp32_precision = value


@pytest.mark.model("llama", num_hidden_layers=1)
@pytest.mark.patch(llama_fused_qkv.MAPPING, conversions=llama_fused_qkv.CONVERSIONS)
@pytest.mark.parametrize("check", ["assert_equivalent", "assert_trains_equivalent"])
def test_a_check_leaves_the_gpus_generator_as_found(
    reference_model: torch.nn.Module, patched_model: torch.nn.Module, device: str, check: str
) -> None:
    # each forward and each training step seeds the GPU's generator: the caller's stream must go on as before
    torch.cuda.manual_seed(1234)
    expected = torch.rand(4, device=device)
    torch.cuda.manual_seed(1234)
    if check == "assert_equivalent":
        assert_equivalent(reference_model, patched_model)
    else:
        assert_trains_equivalent(reference_model, patched_model, steps=2)
    assert torch.equal(torch.rand(4, device=device), expected)
