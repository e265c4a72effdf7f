"""Float32 at full precision while a check runs its models: no TF32, no bf16 matmuls behind a float32 tolerance."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

_IEEE_FLOAT32: ContextVar[bool] = ContextVar("modelpatch_ieee_float32", default=False)


def _per_operation_precisions() -> list[Any]:
    """torch >= 2.9's settings per backend and operation, each an ``fp32_precision``; none before."""
    b = torch.backends
    if not hasattr(b.cuda.matmul, "fp32_precision"):
        return []
    # cudnn and mkldnn replace their modules by PropModule objects at import: the stubs see the modules
    return [b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn, b.mkldnn.matmul, b.mkldnn.conv, b.mkldnn.rnn]  # type: ignore[attr-defined]


def _readable(read: Callable[[], Any]) -> Any:
    """A legacy precision getter's value, or ``None`` where the caller's mix of legacy and per-operation settings makes it raise."""
    try:
        return read()
    except RuntimeError:
        return None


@contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matmuls and convolutions at IEEE precision for the block; the caller's settings put back after.

    cuDNN convolutions run in TF32 by default on Ampere and later, and a user's
    ``set_float32_matmul_precision("high"|"medium")`` turns on TF32 for CUDA matmuls and bf16 for
    oneDNN's on CPU: 10 or 8 mantissa bits where the float32 tolerance allows for 24. The two
    sides of a check rarely take the same kernels (a Conv3d against the Linear that replaces it),
    so a correct patch would differ by 1e-3 (the Qwen3-VL patch embedding on an H200). Nested
    blocks are free.
    """
    if _IEEE_FLOAT32.get():
        yield
        return
    token = _IEEE_FLOAT32.set(True)
    cudnn = torch.backends.cudnn
    per_operation = _per_operation_precisions()
    saved = [setting.fp32_precision for setting in per_operation]
    matmul, cudnn_tf32 = _readable(torch.get_float32_matmul_precision), _readable(lambda: cudnn.allow_tf32)
    try:
        # the legacy setters first: torch keeps their state beside the per-operation settings
        # and checks the two agree when torch.export, inductor or a library reads the legacy
        # getters (a check that set only the new ones made torch.export raise); "ieee" agrees
        # with "highest" and allow_tf32 False, and overrides a generic "tf32" that "none" inherits
        torch.set_float32_matmul_precision("highest")
        cudnn.allow_tf32 = False
        for setting in per_operation:
            setting.fp32_precision = "ieee"
        yield
    finally:
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        if cudnn_tf32 is not None:
            cudnn.allow_tf32 = cudnn_tf32
        for setting, value in zip(per_operation, saved):
            setting.fp32_precision = value
        _IEEE_FLOAT32.reset(token)
