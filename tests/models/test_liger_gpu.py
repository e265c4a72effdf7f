"""Liger-Kernel's own Triton kernels, as its users ship them, checked through the plugin on a CUDA GPU.

``apply_liger_kernel_to_{llama,qwen2,mistral}`` rebinds the modeling module's RMSNorm and MLP
classes, its rotary function and the causal LM's ``forward`` (a fused linear-cross-entropy that
computes no logits in training). It is a ``context=`` patch: the patched model is built with it
active, the reference runs with it swapped out, and whatever it rebound is put back after the test.
Forward, backward and 8 training steps run on each family in float32 and bfloat16; a broken twin
(Gemma's ``1 + weight`` norm on a Llama, a kernel configured for the wrong family) must fail.

Beside each verdict the test runs Liger-Kernel's own convergence comparison on the same models
(``test/convergence/{fp32,bf16}/test_mini_models.py``: per-step losses and the parameters after
AdamW at lr 1e-4, its tolerances) and records both verdicts, so docs/kernels.md can say where
they differ; only the plugin's verdict decides the test. With ``MODELPATCH_LIGER_RECORD`` set,
each record is appended to that file as a JSON line (``.ci/gpu`` collects them).

Every test here needs a CUDA GPU and liger-kernel (0.8.5; triton comes with torch's CUDA build):
without either it is collected and skipped with the reason.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pytest_modelpatch import assert_backward_equivalent, assert_equivalent, assert_trains_equivalent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("liger_kernel") is None,
        reason="liger-kernel is not installed (pip install liger-kernel==0.8.5 beside a CUDA build of torch)",
    ),
]

FAMILIES = ("llama", "qwen2", "mistral")
NORMS = {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm", "mistral": "MistralRMSNorm"}

# Liger-Kernel test/convergence/{fp32,bf16}/test_mini_models.py: (atol, rtol) of the per-step losses
# and of every parameter after training, for llama3, qwen2 and mistral (llama3's fp32 loss rtol is 2e-5)
LIGER_TOLERANCES = {
    torch.float32: {"loss": (1e-8, 1e-5), "param": (5e-3, 1e-5)},
    torch.bfloat16: {"loss": (1e-3, 1e-2), "param": (1e-2, 1e-2)},
}
LIGER_LR = 1e-4
STEPS = 8


@contextlib.contextmanager
def liger_kernels(family: str, broken: bool = False) -> Iterator[None]:
    """Liger-Kernel's patch for ``family``, as a user applies it; ``broken`` configures its norm for Gemma."""
    liger = importlib.import_module("liger_kernel.transformers")
    getattr(liger, f"apply_liger_kernel_to_{family}")()
    if broken:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

        class GemmaConfiguredRMSNorm(LigerRMSNorm):  # type: ignore[misc]  # liger ships no type hints
            """Liger's norm with Gemma's settings on a family whose norm multiplies by the weight alone."""

            def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
                super().__init__(hidden_size, eps=eps, offset=1.0, casting_mode="gemma")

        setattr(modeling, NORMS[family], GemmaConfiguredRMSNorm)
    yield  # the plugin puts back what Liger rebound: it has no undo of its own


def _family_params(broken: bool = False) -> list[Any]:
    return [
        pytest.param(family, marks=[pytest.mark.model(family), pytest.mark.patch(context=liger_kernels, family=family, broken=broken)])
        for family in FAMILIES
    ]  # fmt: skip


def _liger_convergence(reference: torch.nn.Module, patched: torch.nn.Module) -> dict[str, Any]:
    """Liger-Kernel's convergence comparison on these two models: AdamW at its lr, its tolerances."""
    dtype = next(reference.parameters()).dtype
    loss_tol, param_tol = LIGER_TOLERANCES[dtype]["loss"], LIGER_TOLERANCES[dtype]["param"]
    generator = torch.Generator().manual_seed(42)
    vocab = reference.config.get_text_config().vocab_size
    batches = [torch.randint(3, vocab, (4, 32), generator=generator) for _ in range(STEPS)]
    losses: dict[str, list[float]] = {}
    trained: dict[str, dict[str, torch.Tensor]] = {}
    for side, model in (("reference", reference), ("patched", patched)):
        saved = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=LIGER_LR)
        model.train()
        try:
            losses[side] = []
            for ids in batches:
                ids = ids.to(model.device)
                optimizer.zero_grad()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                losses[side].append(loss.item())
            trained[side] = {name: p.detach().clone() for name, p in model.named_parameters()}
        finally:
            model.eval()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                model.load_state_dict(saved)
    loss_ok = torch.allclose(
        torch.tensor(losses["patched"], dtype=torch.float64), torch.tensor(losses["reference"], dtype=torch.float64),
        atol=loss_tol[0], rtol=loss_tol[1],
    )  # fmt: skip
    worst_loss = max(abs(a - b) for a, b in zip(losses["reference"], losses["patched"]))
    failing = [
        name for name, value in trained["reference"].items()
        if name in trained["patched"] and not torch.allclose(trained["patched"][name], value, atol=param_tol[0], rtol=param_tol[1])
    ]  # fmt: skip
    return {
        "passed": bool(loss_ok and not failing),
        "worst_loss_difference": worst_loss,
        "parameters_failing": failing[:3],
    }


def _record(entry: dict[str, Any]) -> None:
    print(json.dumps(entry))
    path = os.environ.get("MODELPATCH_LIGER_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(entry) + "\n")


def _checked(
    family: str, dtype: torch.dtype, check: str, kernel: str, reference: torch.nn.Module, patched: torch.nn.Module
) -> None:
    """Run the plugin's check, then Liger's own comparison after training; record both, and let the plugin's decide."""
    __tracebackhide__ = True
    entry: dict[str, Any] = {
        "family": family,
        "dtype": str(dtype).removeprefix("torch."),
        "check": check,
        "kernel": kernel,
    }
    try:
        CHECKS[check](reference, patched)
        entry["plugin"] = "pass"
    except AssertionError as failure:
        entry["plugin"] = "fail: " + str(failure).splitlines()[0]
        raise
    finally:
        if check == "training":
            entry["liger_convergence"] = _liger_convergence(reference, patched)
        _record(entry)


CHECKS = {
    "forward": lambda ref, patched: assert_equivalent(ref, patched),
    "backward": lambda ref, patched: assert_backward_equivalent(ref, patched),
    "training": lambda ref, patched: assert_trains_equivalent(ref, patched, steps=STEPS),
}


@pytest.mark.parametrize("family", _family_params())
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.dtypes("float32", "bfloat16")
def test_liger_kernels_pass_the_plugins_checks(
    reference_model: torch.nn.Module, patched_model: torch.nn.Module, dtype: torch.dtype, family: str, check: str
) -> None:
    assert type(patched_model.model.norm).__module__.startswith("liger_kernel"), "Liger's norm is not in the model"
    _checked(family, dtype, check, "liger", reference_model, patched_model)


@pytest.mark.parametrize("family", _family_params(broken=True)[:1])
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.dtypes("float32", "bfloat16")
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a Llama norm that multiplies by 1 + weight")
def test_liger_norm_configured_for_gemma_fails_them(
    reference_model: torch.nn.Module, patched_model: torch.nn.Module, dtype: torch.dtype, family: str, check: str
) -> None:
    if type(patched_model.model.norm).__name__ != "GemmaConfiguredRMSNorm":  # not an AssertionError: no xfail
        pytest.fail(f"the broken norm is not in the model: {type(patched_model.model.norm)}")
    _checked(family, dtype, check, "liger, norm configured for gemma (broken)", reference_model, patched_model)
