"""compare_flat_batched gives exactly what compare_flat gives: the fast path of the backward check loses nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Pair

from pytest_modelpatch.compare._engine import batched
from pytest_modelpatch.compare._engine.batched import compare_flat_batched
from pytest_modelpatch.compare._engine.inputs import default_inputs
from pytest_modelpatch.compare._engine.outputs import TensorComparison, compare_flat
from pytest_modelpatch.compare._engine.tolerance import GRADIENT_POLICY, resolve_tolerance
from pytest_modelpatch.compare.backward.equivalence import gradient_tolerance
from pytest_modelpatch.compare.backward.step import training_run, with_labels
from pytest_modelpatch.isolation.pristine import pristine


def same(found: list[TensorComparison], expected: list[TensorComparison]) -> bool:
    """Field for field, NaN equal to NaN (repr round-trips floats exactly)."""
    return [repr(c) for c in found] == [repr(c) for c in expected]


def _tensors(dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pairs covering every branch: equal, ulp-close, over tolerance, near it, zeros, NaN, inf, empty, 0-dim."""
    g = torch.Generator().manual_seed(0)
    base = {f"close{i}": torch.randn(4, 3 + i, generator=g).to(dtype) for i in range(4)}
    reference: dict[str, Any] = {
        **base, "equal": torch.randn(5, generator=g).to(dtype), "signed_zero": torch.tensor([0.0, 1.0]).to(dtype),
        "far": torch.randn(3, 3, generator=g).to(dtype), "zero_ref": torch.tensor([0.0, 2.0, 0.0]).to(dtype),
        "nan_both": torch.tensor([float("nan"), 1.0]).to(dtype), "nan_one": torch.tensor([1.0, 1.0]).to(dtype),
        "nan_late": torch.ones(6).to(dtype),  # a NaN in a later row than a finite difference
        "inf": torch.tensor([float("inf"), 1.0]).to(dtype), "empty": torch.zeros(0, 2).to(dtype),
        "scalar": torch.tensor(3.0).to(dtype), "ties": torch.ones(6).to(dtype), "none": None, "only_ref": torch.ones(2).to(dtype),
        "shape": torch.ones(2, 2).to(dtype), "ints": torch.arange(4),
        "largest_first": torch.tensor([1000.0, 1.0, 1.0, 1.0]).to(dtype),  # its largest |ref| in a piece that is equal
    }  # fmt: skip
    patched = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in reference.items() if k != "only_ref"}
    for i in range(4):  # a few ulps: passing, figures from the candidates
        patched[f"close{i}"] = torch.nextafter(base[f"close{i}"].float(), torch.tensor(float("inf"))).to(dtype)
        patched[f"close{i}"] = patched[f"close{i}"] * (1 + torch.finfo(dtype).eps * (i + 1) / 2)
    patched["close0"] = patched["close0"].to(dtype)
    patched["signed_zero"] = torch.tensor([-0.0, 1.0]).to(dtype)
    patched["far"] = reference["far"] * 1.5
    patched["zero_ref"] = torch.tensor([1e-7, 2.0, 0.0]).to(dtype)  # rel inf, within atol
    patched["nan_both"] = torch.tensor([float("nan"), 1.0 + 1e-6]).to(dtype)
    patched["nan_one"] = torch.tensor([float("nan"), 1.0]).to(dtype)
    patched["nan_late"] = torch.tensor([1.0 + 1e-6, 1.0, 1.0, 1.0, 1.0, float("nan")]).to(dtype)
    patched["inf"] = torch.tensor([float("inf"), 1.0 + 1e-6]).to(dtype)
    patched["scalar"] = reference["scalar"] + 1e-6
    patched["ties"] = reference["ties"] + torch.tensor([0.0, 1e-6, 0.0, 1e-6, 1e-6, 0.0]).to(
        dtype
    )  # the first tie is the worst
    patched["largest_first"] = reference["largest_first"] + torch.tensor([0.0, 0.0, 0.0, torch.finfo(dtype).eps]).to(
        dtype
    )
    patched["shape"] = torch.ones(3)
    patched["only_patched"] = torch.ones(1)
    return reference, patched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("policy", [None, "strict", "sqnr"])
@pytest.mark.parametrize(
    ("block", "width"),
    [(None, None), (None, 4), (16, 4), (7, 4), (2, None)],
    ids=["one-block", "rows-of-4", "blocks-of-4-rows-of-4", "blocks-of-1-row-of-4", "blocks-of-2-rows-of-1"],
)
def test_batched_comparison_equals_the_detailed_one_on_every_kind_of_pair(
    dtype: torch.dtype, policy: str | None, block: int | None, width: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows of 4 put ties, NaN and the zero padding inside rows; small blocks make tensors continue
    # from one block into the next.
    if block is not None:
        monkeypatch.setattr(batched, "_BLOCK", block)
    if width is not None:
        monkeypatch.setattr(batched, "_MIN_WIDTH", width)
    spec = gradient_tolerance(resolve_tolerance(None, None, policy))
    reference, patched = _tensors(dtype)
    expected = compare_flat(reference, patched, spec)
    assert same(compare_flat_batched(reference, patched, spec), expected)
    assert any(not c.passed for c in expected)
    if policy is None:  # strict judges exactly: nothing passes with a difference
        assert any(c.passed and c.max_abs > 0 for c in expected)  # the candidates' figures were exercised


def test_batched_comparison_equals_the_detailed_one_with_an_explicit_tolerance() -> None:
    spec = resolve_tolerance(1e-3, 1e-2, None)
    reference, patched = _tensors(torch.float32)
    assert same(compare_flat_batched(reference, patched, spec), compare_flat(reference, patched, spec))


def test_a_path_nested_under_none_is_folded_as_compare_flat_folds_it() -> None:
    spec = resolve_tolerance(None, None, None)
    reference = {"a": None, "b": torch.ones(2)}
    patched = {"a.x": torch.ones(2), "a.y": torch.ones(2), "b": torch.ones(2)}
    assert same(compare_flat_batched(reference, patched, spec), compare_flat(reference, patched, spec))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "name",
    [
        "llama_swiglu_autograd",
        "llama_swiglu_autograd_broken",
        "llama_rmsnorm_autograd",
        "llama_rmsnorm_autograd_broken",
    ],
)
def test_batched_comparison_equals_the_detailed_one_on_the_example_patches(
    pair: Callable[..., Pair], name: str, dtype: str
) -> None:
    reference, patched = pair(name, dtype=dtype)
    inputs = with_labels(reference, default_inputs(reference))
    ref = training_run(reference, inputs, around_backward=pristine)
    pat = training_run(patched, inputs)
    spec = gradient_tolerance(resolve_tolerance(None, None, None))
    assert spec.policy is GRADIENT_POLICY
    expected = compare_flat(ref.gradients, pat.gradients, spec)
    assert same(compare_flat_batched(ref.gradients, pat.gradients, spec), expected)
    assert all(c.passed for c in expected) == (not name.endswith("broken"))
