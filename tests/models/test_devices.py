"""Device and dtype selection: pure logic for GPU paths, real pytest runs for the markers."""

from __future__ import annotations

import pytest
import torch

from pytest_modelpatch import PatchUsageError
from pytest_modelpatch.models.devices import (
    CudaStatus,
    dtype_name,
    gpu_missing_reason,
    parse_device,
    requested_device,
    select_device,
    to_torch_dtype,
    xdist_worker_index,
)

FOUR_GPUS = CudaStatus(available=True, device_count=4)
NO_GPU = CudaStatus(available=False, device_count=0)


@pytest.mark.parametrize(
    ("requested", "cuda", "worker", "expected"),
    [
        ("cuda", FOUR_GPUS, 5, "cuda:1"),
        ("cuda", FOUR_GPUS, 0, "cuda:0"),
        ("cuda", FOUR_GPUS, None, "cuda"),
        ("cuda", CudaStatus(True, 1), 3, "cuda"),
        ("cuda:2", FOUR_GPUS, 5, "cuda:2"),
        ("auto", FOUR_GPUS, 2, "cuda:2"),
        ("auto", NO_GPU, 2, "cpu"),
        ("cpu", FOUR_GPUS, 1, "cpu"),
    ],
)
def test_each_xdist_worker_gets_its_own_gpu(
    requested: str, cuda: CudaStatus, worker: int | None, expected: str
) -> None:
    assert select_device(requested, cuda, worker) == expected


def test_gpu_missing_reasons() -> None:
    assert "torch.cuda.is_available() is False" in gpu_missing_reason("cuda", NO_GPU)
    assert gpu_missing_reason("cuda:3", FOUR_GPUS) is None
    assert "has 4 CUDA device(s)" in gpu_missing_reason("cuda:4", FOUR_GPUS)


def test_worker_index_and_default_device_sources() -> None:
    assert xdist_worker_index({"PYTEST_XDIST_WORKER": "gw7"}) == 7
    assert xdist_worker_index({}) is None
    assert requested_device(None, {}) == "cpu"
    assert requested_device(None, {"MODELPATCH_DEVICE": "CUDA:1"}) == "cuda:1"
    assert requested_device("auto", {"MODELPATCH_DEVICE": "cuda"}) == "auto"
    with pytest.raises(PatchUsageError, match=r"\$MODELPATCH_DEVICE: unknown device 'gpu0'"):
        requested_device(None, {"MODELPATCH_DEVICE": "gpu0"})


def test_dtype_names_and_bad_values() -> None:
    assert to_torch_dtype("bf16") is torch.bfloat16
    assert to_torch_dtype(torch.float16) is torch.float16
    assert dtype_name("FP32") == "float32"
    with pytest.raises(PatchUsageError, match="unknown dtype 'int8': use one of bfloat16, float16, float32, float64"):
        dtype_name("int8")
    with pytest.raises(PatchUsageError, match="unknown device 'tpu'"):
        parse_device("tpu")


MARKED = """
import pytest


@pytest.mark.gpu
def test_needs_gpu(device):
    assert device.startswith("cuda")


@pytest.mark.cpu
def test_cpu_only(device):
    assert device == "cpu"


@pytest.mark.devices("cpu", "cuda")
@pytest.mark.dtypes("fp32", "bfloat16")
def test_grid(device, dtype):
    print("RAN", device, dtype)
"""


def test_gpu_marker_skips_with_reason_without_a_gpu(pytester: pytest.Pytester, xdist_args: tuple[str, ...]) -> None:
    pytester.makepyfile(MARKED)
    result = pytester.runpytest("-rA", *xdist_args)
    result.assert_outcomes(passed=3, skipped=3)
    result.stdout.fnmatch_lines_random(
        [
            "PASSED *::test_grid?cpu-float32?",
            "PASSED *::test_grid?cpu-bfloat16?",
            "PASSED *::test_cpu_only",
            "SKIPPED ?2? test_gpu_marker_skips_with_reason_without_a_gpu.py:*: needs a CUDA GPU for device 'cuda'*",
        ]
    )


def test_require_gpu_turns_the_skip_into_a_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MARKED)
    result = pytester.runpytest("--modelpatch-require-gpu")
    result.assert_outcomes(passed=3, errors=3)  # failed at setup: the test never ran
    result.stdout.fnmatch_lines(["*needs a CUDA GPU*--modelpatch-require-gpu forbids skipping it*"])


def test_default_device_option_and_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(
        """
def test_device(device):
    print("DEVICE", device)
"""
    )
    pytester.runpytest("-s", "--modelpatch-device", "auto").stdout.fnmatch_lines(["*DEVICE cpu*"])
    monkeypatch.setenv("MODELPATCH_DEVICE", "cuda")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    bad = pytester.runpytest("--modelpatch-device", "tpu")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--modelpatch-device: unknown device 'tpu': use cpu, cuda, cuda:N or auto*"])


def test_devices_marker_without_the_device_fixture_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest


@pytest.mark.devices("cpu")
def test_forgot_fixture():
    pass
"""
    )
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["*@pytest.mark.devices*sets the 'device' fixture, but the test does not use it*"])
    assert result.ret != 0


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp32", torch.float32), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16), ("torch.float16", torch.float16)],
)
def test_to_torch_dtype_accepts_names_and_aliases(name: str, dtype: torch.dtype) -> None:
    assert to_torch_dtype(name) is dtype and to_torch_dtype(dtype) is dtype


def test_to_torch_dtype_lists_valid_names() -> None:
    with pytest.raises(PatchUsageError, match="unknown dtype 'float8'.*bf16"):
        to_torch_dtype("float8")
