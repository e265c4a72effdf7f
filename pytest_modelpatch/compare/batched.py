"""``compare_flat`` for many small tensors at once: one vectorised pass per dtype, same results.

A training step yields a few dozen gradients; comparing them one by one with
:func:`~pytest_modelpatch.compare.outputs.compare_tensors` costs a dozen tensor ops each, more
than the step itself on a tiny model. Here the tensors of one dtype are concatenated and judged
together: the same float64 arithmetic, reduced per tensor with ``scatter_reduce``, so every figure
is the one ``compare_tensors`` gives. Tensors over tolerance, and anything this pass does not
cover (SQNR and oracle tolerances, complex or integer tensors, structural problems), go through
the detailed comparison itself.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from pytest_modelpatch.compare.outputs import TensorComparison, compare_flat, compare_tensors
from pytest_modelpatch.compare.tolerance import Tolerance, ToleranceSpec, dtype_label

_Pair = tuple[str, torch.Tensor, torch.Tensor]
_TINY = 2.0**-100  # bounds below this would be judged near float32 subnormals: leave them to compare_tensors


def compare_flat_batched(reference: Mapping[str, Any], patched: Mapping[str, Any], spec: ToleranceSpec) -> list[TensorComparison]:
    """What ``compare_flat(reference, patched, spec)`` returns, computed in one pass per dtype.

    Example: ``compare_flat_batched(ref.gradients, pat.gradients, spec)[0].max_abs``.
    """
    if _nested_under_none(reference, patched):  # compare_flat folds such paths into one problem
        return compare_flat(reference, patched, spec)
    groups: dict[tuple[torch.dtype, torch.device], list[_Pair]] = defaultdict(list)
    tolerances: dict[torch.dtype, Tolerance] = {}
    for path, ref in reference.items():
        pat = patched.get(path)
        if _same_layout(ref, pat):
            tolerance = tolerances.get(ref.dtype) or tolerances.setdefault(ref.dtype, spec.for_dtype(ref.dtype))
            if tolerance.min_sqnr_db is None and tolerance.oracle_factor is None:  # judged elementwise
                groups[(ref.dtype, ref.device)].append((path, ref, pat))
    found: dict[str, TensorComparison] = {}
    with torch.no_grad():
        for (dtype, _), pairs in groups.items():
            found.update(_compare_group(pairs, spec, tolerances[dtype]))
    rest = compare_flat(
        {p: v for p, v in reference.items() if p not in found}, {p: v for p, v in patched.items() if p not in found}, spec
    )
    by_path = {c.path: c for c in rest}
    order = [*reference, *(p for p in patched if p not in reference)]
    return [found.get(p) or by_path[p] for p in order if p in found or p in by_path]


def _nested_under_none(reference: Mapping[str, Any], patched: Mapping[str, Any]) -> bool:
    nones = [p for side in (reference, patched) for p, v in side.items() if v is None]
    return any(k.startswith((f"{p}[", f"{p}.")) for p in nones for side in (reference, patched) for k in side)


def _same_layout(ref: Any, pat: Any) -> bool:
    """Two real floating tensors of one dtype, shape and device: what the batched pass covers."""
    if not (isinstance(ref, torch.Tensor) and isinstance(pat, torch.Tensor)):
        return False
    return ref.is_floating_point() and pat.dtype == ref.dtype and pat.shape == ref.shape and pat.device == ref.device


def _compare_group(pairs: list[_Pair], spec: ToleranceSpec, tolerance: Tolerance) -> dict[str, TensorComparison]:
    """Compare tensors of one dtype together, with exactly the figures ``compare_tensors`` gives.

    A screen in the working precision (float32, or float64 for float64 tensors) proves each
    tensor within tolerance with a margin of 64 rounding units, far more than its few roundings
    can err; a tensor it cannot clear, or with a non-finite value, gets ``compare_tensors``. The
    figures of a cleared tensor are computed in float64 on the few elements that can hold its
    largest absolute and relative differences: rounding is monotonic, so the float64 maxima lie
    among the elements within the margin of the working-precision maxima.

    On CPU an elementwise comparison (a bool result) costs 4-8x a subtraction, so the screen
    uses arithmetic and reductions only, all maxima in one ``_foreach_max``.
    """
    flat_ref = torch.cat([r.detach().reshape(-1) for _, r, _ in pairs])
    flat_pat = torch.cat([p.detach().reshape(-1) for _, _, p in pairs])
    if torch.equal(flat_ref, flat_pat):  # the exact path: every tensor is equal (no NaN anywhere)
        return {path: _equal(path, ref, tolerance) for path, ref, _ in pairs}
    work = torch.float64 if flat_ref.dtype == torch.float64 else torch.float32
    margin = 64 * torch.finfo(work).eps
    sizes = [r.numel() for _, r, _ in pairs]
    ref, pat = flat_ref.to(work), flat_pat.to(work)
    # Few full-size buffers, each reused once spent: a training step's gradients are a few MB on a
    # tiny model, and every fresh buffer of that size costs page faults (the allocator hands big
    # freed blocks back to the system), as much as the comparison itself.
    diff = torch.sub(pat, ref).abs_()
    magnitude = ref.abs()
    # 0 where equal (0/0 is NaN), inf where only the reference is 0; a NaN difference is never cleared anyway
    rel = torch.div(diff, magnitude).nan_to_num_(nan=0.0, posinf=math.inf)
    # diff - rtol * (1 - margin) * |ref| >= abs_term * (1 - margin) anywhere: not cleared (rounding keeps the sign)
    slack = torch.add(diff, magnitude, alpha=-tolerance.rtol * (1 - margin))
    amax, max_diff, max_slack, max_rel = _maxima([magnitude, diff, slack, rel], sizes)  # one pass for all four
    abs_terms = [tolerance.abs_term(a) for a in amax]
    cleared = [
        size > 0 and math.isfinite(d) and math.isfinite(a) and s < a * (1 - margin) and a * (1 - margin) > _TINY
        for size, d, a, s in zip(sizes, max_diff, abs_terms, max_slack)
    ]  # fmt: skip
    figures = _exact_figures(flat_ref, flat_pat, diff, rel, slack, sizes, max_diff, max_rel, margin)
    found, offset = {}, 0
    for i, ((path, r, p), size) in enumerate(zip(pairs, sizes)):
        if size == 0 or max_diff[i] == 0.0:  # equal values, signs of zero aside: what torch.equal sees
            found[path] = _equal(path, r, tolerance)
        elif not cleared[i]:  # over tolerance, near it, or not finite: the detailed comparison decides
            found[path] = compare_tensors(path, r, p, spec)
        else:
            max_abs, max_rel_i, worst, worst_ref, worst_pat = figures[i]
            found[path] = TensorComparison(
                path, tuple(r.shape), dtype_label(r.dtype), max_abs=max_abs, max_rel=max_rel_i, over=0, total=size,
                worst_index=_unravel(worst - offset, tuple(r.shape)), worst_reference=worst_ref, worst_patched=worst_pat,
                bound_at_worst=abs_terms[i] + tolerance.rtol * abs(worst_ref), tolerance=tolerance,
            )  # fmt: skip
        offset += size
    return found


def _maxima(values: list[torch.Tensor], sizes: list[int]) -> list[list[float]]:
    """For each of ``values``, the largest element of each consecutive slice (NaN when the slice has one).

    One ``_foreach_max`` and one copy to Python for all of them.
    """
    parts = [part for v in values for part in v.split(sizes) if part.numel()]
    flat = iter(torch.stack(torch._foreach_max(parts)).tolist() if parts else [])
    return [[next(flat) if size else 0.0 for size in sizes] for _ in values]


def _exact_figures(
    flat_ref: torch.Tensor, flat_pat: torch.Tensor, diff: torch.Tensor, rel: torch.Tensor, scratch: torch.Tensor,
    sizes: list[int], max_diff: list[float], max_rel: list[float], margin: float,
) -> list[tuple[float, float, int, float, float]]:  # fmt: skip
    """Per tensor, in float64: max abs, max rel, the first position of the max abs and the values there.

    ``rel`` and ``scratch`` (a buffer of ``diff``'s size) are overwritten.
    """
    counts = torch.tensor(sizes, device=diff.device)
    # Per tensor, how far below its maxima an element may lie and still hold one. A maximum of 0
    # (or NaN: a tensor not cleared) asks for no element, so equal elements never qualify; an
    # infinite relative maximum (a reference 0 where the patch is not) asks for the infinite
    # elements, which alone reach the largest finite value.
    largest = torch.finfo(rel.dtype).max
    abs_cuts = [m * (1 - margin) if m > 0 else math.inf for m in max_diff]
    rel_cuts = [(m * (1 - margin) if m < math.inf else largest) if m > 0 else math.inf for m in max_rel]
    near_abs, near_rel = scratch.copy_(diff), rel
    torch._foreach_sub_(list(near_abs.split(sizes)), abs_cuts)
    torch._foreach_sub_(list(near_rel.split(sizes)), rel_cuts)
    # one comparison for both (a bool-valued op costs 4-8x a subtraction on CPU)
    positions = (torch.maximum(near_abs, near_rel, out=near_abs) >= 0).nonzero().reshape(-1)
    ref, pat = flat_ref[positions].to(torch.float64), flat_pat[positions].to(torch.float64)
    d = torch.where(ref == pat, 0.0, (pat - ref).abs())
    r = torch.where(d == 0, 0.0, d / ref.abs()).nan_to_num(nan=torch.inf, posinf=torch.inf)
    segment = torch.searchsorted(counts.cumsum(0), positions, right=True)  # which tensor each candidate is in

    def per_tensor(values: torch.Tensor, reduce: str) -> torch.Tensor:
        start = torch.zeros(len(sizes), dtype=values.dtype, device=values.device)
        return start.scatter_reduce(0, segment, values, reduce=reduce, include_self=False)

    max_abs = per_tensor(d, "amax")
    first = per_tensor(torch.where(d == max_abs[segment], positions, diff.numel()), "amin")  # argmax's choice: the first
    at = torch.searchsorted(positions, first).clamp(max=max(positions.numel() - 1, 0))
    worst_ref, worst_pat = (ref[at].tolist(), pat[at].tolist()) if positions.numel() else ([], [])
    return list(zip(max_abs.tolist(), per_tensor(r, "amax").tolist(), first.tolist(), worst_ref, worst_pat))


def _equal(path: str, ref: torch.Tensor, tolerance: Tolerance) -> TensorComparison:
    return TensorComparison(path, tuple(ref.shape), dtype_label(ref.dtype), total=ref.numel(), tolerance=tolerance)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    found = []
    for size in reversed(shape):
        index, rest = divmod(index, size)
        found.append(rest)
    return tuple(reversed(found))
