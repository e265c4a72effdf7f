"""``compare_flat`` for many small tensors at once: one vectorised pass per dtype, same results.

A training step yields a few dozen gradients; comparing them one by one with
:func:`~pytest_modelpatch.compare.outputs.compare_tensors` costs a dozen tensor ops each, more
than the step itself on a tiny model. Here the tensors of one dtype are judged together, those
of one size as the rows of one float64 block: the same float64 arithmetic, reduced per row, so
every figure is the one ``compare_tensors`` gives. Tensors over tolerance, and anything this
pass does not cover (SQNR and oracle tolerances, complex or integer tensors, structural
problems), go through the detailed comparison itself.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
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

    The tensors are taken by size, so tensors of one size form a ``(k, size)`` block and every
    figure of a block is one reduction over its rows: a model's gradients come in a handful of
    sizes however deep it is, so the op count stays small. Each block is widened to float64, the
    precision ``compare_tensors`` computes in, so its maxima, first worst position and the values
    there are that function's own. A tensor is cleared when its largest ``diff - rtol * |ref|``
    lies below its absolute term by a margin of 64 rounding units (the bound's own roundings); a
    tensor it cannot clear, or with a non-finite value, gets ``compare_tensors``. Blocks hold at
    most ``_BLOCK`` elements, a larger tensor is taken in pieces, and every block is worked in one
    scratch buffer: the float64 copies stay small on large models.
    """
    sizes = [r.numel() for _, r, _ in pairs]
    blocks = list(_blocks(sorted(range(len(pairs)), key=sizes.__getitem__), sizes))
    margin = 64 * torch.finfo(torch.float64).eps
    figures: dict[int, list[float]] = {}
    if blocks:
        stride = max(len(members) * n for members, _, n in blocks)
        device, dtype = pairs[0][1].device, pairs[0][1].dtype
        scratch = torch.empty(4 * stride, dtype=torch.float64, device=device)
        # concatenating in the tensors' own dtype, then widening, is ~40% faster than one widening cat
        gathered = torch.empty(stride, dtype=dtype, device=device) if dtype != torch.float64 else None
    for members, start, n in blocks:
        ref, pat, diff, work = (scratch[k * stride : k * stride + len(members) * n].view(len(members), n) for k in range(4))
        whole = n == sizes[members[0]]
        for side, out in ((1, ref), (2, pat)):
            flat = out.view(-1)
            if not whole:  # a piece of one large tensor
                flat.copy_(pairs[members[0]][side].detach().reshape(-1)[start : start + n])
            elif len(members) == 1:
                flat.copy_(pairs[members[0]][side].detach().reshape(-1))
            elif gathered is None:
                torch.cat([pairs[i][side].detach().reshape(-1) for i in members], out=flat)
            else:
                flat.copy_(torch.cat([pairs[i][side].detach().reshape(-1) for i in members], out=gathered[: flat.numel()]))
        if whole and torch.equal(ref, pat):
            rows = [[0.0] * 7 for _ in members]  # all equal (a piece still counts for its tensor's max |ref|)
        else:
            rows = _block_figures(ref, pat, diff, work, tolerance.rtol * (1 - margin))
        for i, row in zip(members, rows):
            row[1] += start
            figures[i] = row if i not in figures else _merge(figures[i], row)
    found = {}
    for i, (path, r, p) in enumerate(pairs):
        if sizes[i] == 0 or figures[i][0] == 0.0:  # equal values, signs of zero aside: what torch.equal sees
            found[path] = _equal(path, r, tolerance)
            continue
        max_diff, worst, max_rel, amax, max_slack, worst_ref, worst_pat = figures[i]
        abs_term = tolerance.abs_term(amax)
        limit = abs_term * (1 - margin)
        cleared = math.isfinite(max_diff) and math.isfinite(limit) and limit > _TINY and max_slack < limit
        if not cleared:  # over tolerance, near it, or not finite: the detailed comparison decides
            found[path] = compare_tensors(path, r, p, spec)
            continue
        found[path] = TensorComparison(
            path, tuple(r.shape), dtype_label(r.dtype), max_abs=max_diff, max_rel=max_rel, over=0, total=sizes[i],
            worst_index=_unravel(int(worst), tuple(r.shape)), worst_reference=worst_ref, worst_patched=worst_pat,
            bound_at_worst=abs_term + tolerance.rtol * abs(worst_ref), tolerance=tolerance,
        )  # fmt: skip
    return found


_BLOCK = 1 << 20  # elements a float64 pass takes at once: the scratch is at most 32 MB


def _blocks(order: list[int], sizes: list[int]) -> Iterator[tuple[list[int], int, int]]:
    """``(tensor indices, first element, elements per row)``: whole tensors of one size, or a piece of one.

    ``order`` lists the tensors by size; a tensor larger than ``_BLOCK`` is taken in pieces.
    """
    i = 0
    while i < len(order):
        size, j = sizes[order[i]], i
        while j < len(order) and sizes[order[j]] == size:
            j += 1
        if size == 0:  # empty tensors: nothing to reduce
            pass
        elif size <= _BLOCK:
            per = _BLOCK // size
            for a in range(i, j, per):
                yield order[a : min(a + per, j)], 0, size
        else:
            for m in order[i:j]:
                for start in range(0, size, _BLOCK):
                    yield [m], start, min(_BLOCK, size - start)
        i = j


def _block_figures(ref: torch.Tensor, pat: torch.Tensor, diff: torch.Tensor, work: torch.Tensor, slack_rtol: float) -> list[list[float]]:
    """Per row, in float64: max |diff|, its first position, max rel, max |ref|, max ``diff - slack_rtol |ref|``, ref and patched there.

    ``diff`` and ``work`` are scratch of the rows' shape; ``ref`` and ``pat`` are overwritten too.
    """
    torch.sub(pat, ref, out=diff).abs_()
    max_diff, worst = diff.max(dim=1)  # the first of equal maxima, as argmax picks
    at = worst.unsqueeze(1)
    values = torch.cat([ref.gather(1, at), pat.gather(1, at)], dim=1)
    magnitude = torch.abs(ref, out=work)
    amax = magnitude.amax(dim=1)
    max_slack = torch.add(diff, magnitude, alpha=-slack_rtol, out=pat).amax(dim=1)
    # 0 where equal (0/0 is NaN), inf where only the reference is 0: what compare_tensors reports
    max_rel = torch.div(diff, magnitude, out=ref).nan_to_num_(nan=0.0, posinf=math.inf).amax(dim=1)
    found = torch.cat([torch.stack([max_diff, worst.to(torch.float64), max_rel, amax, max_slack], dim=1), values], dim=1)
    return found.tolist()


def _merge(earlier: list[float], later: list[float]) -> list[float]:
    """The figures of two pieces of one tensor: maxima of both, the first worst position; NaN wins."""
    if any(math.isnan(v) for v in (*earlier, *later)):
        return [math.nan] * 7
    worst = later if later[0] > earlier[0] else earlier
    return [worst[0], worst[1], max(earlier[2], later[2]), max(earlier[3], later[3]), max(earlier[4], later[4]), worst[5], worst[6]]


def _equal(path: str, ref: torch.Tensor, tolerance: Tolerance) -> TensorComparison:
    return TensorComparison(path, tuple(ref.shape), dtype_label(ref.dtype), total=ref.numel(), tolerance=tolerance)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    found = []
    for size in reversed(shape):
        index, rest = divmod(index, size)
        found.append(rest)
    return tuple(reversed(found))
