"""Every check runs float32 at IEEE precision, whatever the caller set, and puts the caller's settings back.

Both kinds of setting: torch >= 2.9's per-operation ``fp32_precision`` and the legacy getters
(``get_float32_matmul_precision``, ``cudnn.allow_tf32``), which must stay readable mid-check.

On an H200 a correct patch (Qwen3-VL's patch embedding, a Conv3d fused into a Linear) differed by
1e-3 in float32 because cuDNN convolutions default to TF32 and matmuls do not. The flags are
plain settings on a CPU build too, so what a module sees of them mid-check is observed here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pytest_modelpatch import (
    assert_backward_equivalent,
    assert_decodes_equivalent,
    assert_equivalent,
    assert_exports_equivalent,
    assert_module_equivalent,
    assert_trains_equivalent,
    check_equivalent,
)
from pytest_modelpatch.compare._engine.precision import ieee_float32
from pytest_modelpatch.models import seeded_model, tiny_config

CONFIG = tiny_config("llama", num_hidden_layers=1)
BACKENDS = {
    "cuda.matmul": torch.backends.cuda.matmul,
    "cudnn.conv": torch.backends.cudnn.conv,
    "cudnn.rnn": torch.backends.cudnn.rnn,
    "mkldnn.matmul": torch.backends.mkldnn.matmul,
}
IEEE = {**dict.fromkeys(BACKENDS, "ieee"), "matmul precision": "highest", "cudnn.allow_tf32": False}


def _seen() -> dict[str, Any]:
    """Each per-operation setting, and the legacy getters that torch.export and libraries read (they raise on a mix)."""
    return {
        **{name: flag.fp32_precision for name, flag in BACKENDS.items()},
        "matmul precision": torch.get_float32_matmul_precision(),
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
    }


@contextmanager
def _kept() -> Iterator[None]:
    """Every precision setting, generic and per operation, and the legacy state, put back after the block."""
    b = torch.backends
    levels = [b, b.cudnn, b.mkldnn]  # setting one cascades to the operations below it
    operations = [b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn, b.mkldnn.matmul, b.mkldnn.conv, b.mkldnn.rnn]
    saved = [(setting, setting.fp32_precision) for setting in levels + operations]
    matmul, cudnn = torch.get_float32_matmul_precision(), b.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        b.cudnn.allow_tf32 = cudnn
        for setting, value in saved:
            setting.fp32_precision = value
        _seen()  # the legacy getters read again


@pytest.fixture
def reduced_precision() -> Iterator[dict[str, Any]]:
    """What a training script sets: "medium" (TF32 for CUDA matmuls, bf16 for oneDNN's), cuDNN's TF32 left on."""
    with _kept():
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = True
        seen = _seen()
        assert (seen["cuda.matmul"], seen["cudnn.conv"], seen["mkldnn.matmul"]) == ("tf32", "tf32", "bf16")
        yield seen


def _watched() -> tuple[torch.nn.Module, torch.nn.Module, list[tuple[str, dict[str, Any]]]]:
    """Two copies of one model; the second's MLP notes the precision flags in its forward and its backward."""
    reference, patched = seeded_model(CONFIG), seeded_model(CONFIG)
    seen: list[tuple[str, dict[str, Any]]] = []
    mlp = patched.model.layers[0].mlp
    mlp.register_forward_pre_hook(lambda *_: seen.append(("forward", _seen())))
    mlp.register_full_backward_hook(lambda *_: seen.append(("backward", _seen())))
    return reference, patched, seen


CHECKS: dict[str, Callable[[torch.nn.Module, torch.nn.Module], Any]] = {
    "assert_equivalent": assert_equivalent,
    "check_equivalent": lambda ref, pat: check_equivalent(ref, pat, max_examples=2),
    "assert_backward_equivalent": assert_backward_equivalent,
    "assert_decodes_equivalent": lambda ref, pat: assert_decodes_equivalent(ref, pat, max_new_tokens=2),
    "assert_trains_equivalent": lambda ref, pat: assert_trains_equivalent(ref, pat, steps=2),
    "assert_module_equivalent": lambda ref, pat: assert_module_equivalent(
        ref, pat, (ref.model.layers[0].mlp, pat.model.layers[0].mlp)),
}  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_a_check_runs_its_models_at_ieee_float32_and_restores_the_callers_precision(
    reduced_precision: dict[str, Any], check: str
) -> None:
    reference, patched, seen = _watched()
    CHECKS[check](reference, patched)
    assert seen, "the watched MLP never ran"
    if check in ("assert_backward_equivalent", "assert_trains_equivalent"):
        assert "backward" in {phase for phase, _ in seen}
    assert [flags for _, flags in seen if flags != IEEE] == []
    assert _seen() == reduced_precision  # the caller's TF32 and bf16 are back


def test_nested_blocks_restore_the_outer_setting_once(reduced_precision: dict[str, Any]) -> None:
    with ieee_float32():
        with ieee_float32():
            assert _seen() == IEEE
        assert _seen() == IEEE  # the inner block leaves the outer's setting
    assert _seen() == reduced_precision


def test_a_generic_tf32_is_overridden_too() -> None:
    with _kept():
        torch.backends.fp32_precision = "tf32"  # cascades to every backend and operation
        before = {name: flag.fp32_precision for name, flag in BACKENDS.items()}
        with ieee_float32():
            assert _seen() == IEEE
        assert {name: flag.fp32_precision for name, flag in BACKENDS.items()} == before
        assert torch.backends.fp32_precision == "tf32"


def test_a_check_exports_with_the_legacy_getters_readable(reduced_precision: dict[str, Any]) -> None:
    # torch.export reads torch.backends.cudnn.allow_tf32, which raises if only the per-operation
    # settings had been switched: the export check failed on every model that way
    reference, patched = seeded_model(CONFIG), seeded_model(CONFIG)
    assert_exports_equivalent(reference, patched)
    assert _seen() == reduced_precision


def test_the_settings_come_back_when_the_check_fails(reduced_precision: dict[str, Any]) -> None:
    reference, patched = seeded_model(CONFIG), seeded_model(CONFIG)
    with torch.no_grad():
        patched.model.layers[0].mlp.down_proj.weight.mul_(1.01)
    with pytest.raises(AssertionError, match="differs from reference"):
        assert_equivalent(reference, patched)
    assert _seen() == reduced_precision
