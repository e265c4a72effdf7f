"""``compare_flat`` for many small tensors at once: one vectorised pass per dtype, same results.

A training step yields a few dozen gradients; comparing them one by one with
:func:`~pytest_modelpatch.compare._engine.outputs.compare_tensors` costs a dozen tensor ops each, more
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

from pytest_modelpatch.compare._engine.outputs import TensorComparison, compare_flat, compare_tensors
from pytest_modelpatch.compare._engine.sharded import whole
from pytest_modelpatch.compare._engine.tolerance import Tolerance, ToleranceSpec, dtype_label

_Pair = tuple[str, torch.Tensor, torch.Tensor]
_TINY = 2.0**-100  # bounds below this would be judged near float32 subnormals: leave them to compare_tensors


def compare_flat_batched(
    reference: Mapping[str, Any], patched: Mapping[str, Any], spec: ToleranceSpec
) -> list[TensorComparison]:
    """What ``compare_flat(reference, patched, spec)`` returns, computed in one pass per dtype.

    Example: ``compare_flat_batched(ref.gradients, pat.gradients, spec)[0].max_abs``.
    """
    patched = whole(reference, patched)  # a sharded patched model's DTensors and slices, made whole
    if _nested_under_none(reference, patched):  # compare_flat folds such paths into one problem
        return compare_flat(reference, patched, spec)
    groups: dict[tuple[torch.dtype, torch.device], list[_Pair]] = defaultdict(list)
    tolerances: dict[torch.dtype, Tolerance] = {}
    for path, ref in reference.items():
        pat = patched.get(path)
        if isinstance(pat, torch.Tensor) and _same_layout(ref, pat):
            tolerance = tolerances.get(ref.dtype) or tolerances.setdefault(ref.dtype, spec.for_dtype(ref.dtype))
            if tolerance.min_sqnr_db is None and tolerance.oracle_factor is None:  # judged elementwise
                groups[(ref.dtype, ref.device)].append((path, ref, pat))
    found: dict[str, TensorComparison] = {}
    with torch.no_grad():
        for (dtype, _), pairs in groups.items():
            found.update(_compare_group(pairs, spec, tolerances[dtype]))
    rest = compare_flat(
        {p: v for p, v in reference.items() if p not in found},
        {p: v for p, v in patched.items() if p not in found},
        spec,
    )
    by_path = {c.path: c for c in rest}
    order = [*reference, *(p for p in patched if p not in reference)]
    return [found.get(p) or by_path[p] for p in order if p in found or p in by_path]


def _nested_under_none(reference: Mapping[str, Any], patched: Mapping[str, Any]) -> bool:
    nones = tuple(f"{p}{mark}" for side in (reference, patched) for p, v in side.items() if v is None for mark in "[.")
    return bool(nones) and any(k.startswith(nones) for side in (reference, patched) for k in side)


def _same_layout(ref: Any, pat: Any) -> bool:
    """Two real floating tensors of one dtype, shape and device: what the batched pass covers."""
    if not (isinstance(ref, torch.Tensor) and isinstance(pat, torch.Tensor)):
        return False
    return ref.is_floating_point() and pat.dtype == ref.dtype and pat.shape == ref.shape and pat.device == ref.device


def _compare_group(pairs: list[_Pair], spec: ToleranceSpec, tolerance: Tolerance) -> dict[str, TensorComparison]:
    """Compare tensors of one dtype together, with exactly the figures ``compare_tensors`` gives.

    The tensors are cut into rows of one width, the last row of each padded with zeros, and
    the rows go in float64 blocks, the precision ``compare_tensors`` computes in. Every figure
    is one reduction over a block's rows, and a tensor's figures are the maxima over its rows,
    its worst position in the first row holding its largest difference: its maxima, first
    worst position and the values there are ``compare_tensors``' own. A tiny model's gradients
    make one block of a few dozen rows, so the op count stays small however many tensors there
    are; blocks hold at most ``_BLOCK`` elements and share one scratch buffer, so the float64
    copies stay small on large models. A tensor is cleared when its largest ``diff - rtol * |ref|``
    lies below its absolute term by a margin of 64 rounding units (the bound's own roundings);
    a tensor it cannot clear, or with a non-finite value, gets ``compare_tensors``.
    """
    sizes = [r.numel() for _, r, _ in pairs]
    margin = 64 * torch.finfo(torch.float64).eps
    figures = _figures(pairs, sizes, tolerance.rtol * (1 - margin))
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
_MIN_WIDTH = 1  # the narrowest row (tests widen it, to put ties and pads inside rows)


def _figures(pairs: list[_Pair], sizes: list[int], slack_rtol: float) -> dict[int, list[float]]:
    """Each non-empty tensor's ``[max |diff|, its first position, max rel, max |ref|, max slack, ref and patched there]``."""
    total = sum(sizes)
    if not total:
        return {}
    width = _width(total, sum(1 for n in sizes if n))
    per_block = max(1, _BLOCK // width)
    blocks = list(_blocks(sizes, width, per_block))
    device, dtype = pairs[0][1].device, pairs[0][1].dtype
    stride = max(rows for _, rows in blocks) * width
    # Gathered in the tensors' own dtype, then widened: faster than one widening cat, and a
    # block found equal there (outputs often are) is never widened.
    gathered = [torch.empty(stride, dtype=dtype, device=device) for _ in range(2)]
    padding = torch.zeros(width, dtype=dtype, device=device) if any(n % width for n in sizes) else None
    scratch = None
    # no detach: this runs under no_grad, and reshape(-1) of a contiguous tensor is a view
    flat = [[t.reshape(-1) for t in side] for side in ([p[1] for p in pairs], [p[2] for p in pairs])]
    figures: dict[int, list[float]] = {}
    for runs, rows in blocks:
        sources = []
        for side, target in zip(flat, gathered):
            parts = []
            for i, start, n in runs:
                parts.append(side[i] if n == sizes[i] else side[i][start : start + n])
                if n % width:  # zeros on both sides: no difference, no |ref|, no slack above a real row's
                    assert padding is not None  # made whenever a size is not a multiple of width
                    parts.append(padding[: width - n % width])
            sources.append(parts[0] if len(parts) == 1 else torch.cat(parts, out=target[: rows * width]))
        # all equal says every tensor here is equal, unless one has elements in another block too
        if all(n == sizes[i] for i, _, n in runs) and torch.equal(*sources):
            figures.update((i, [0.0] * 7) for i, _, _ in runs)
            continue
        if scratch is None:
            scratch = torch.empty(4 * stride, dtype=torch.float64, device=device)
        ref, pat, diff, work = (scratch[k * stride : k * stride + rows * width].view(rows, width) for k in range(4))
        ref.view(-1).copy_(sources[0])
        pat.view(-1).copy_(sources[1])
        found = iter(_block_figures(ref, pat, diff, work, slack_rtol))
        for i, start, n in runs:
            for offset in range(start, start + n, width):
                row = next(found)
                row[1] += offset
                _merge(figures, i, row)
    return figures


def _blocks(sizes: list[int], width: int, per_block: int) -> Iterator[tuple[list[tuple[int, int, int]], int]]:
    """``(runs, rows)`` per block: runs are ``(tensor, first element, elements)``, each in whole rows of ``width``.

    A tensor's last row is padded; a tensor longer than a block's free rows continues in the next.
    """
    runs: list[tuple[int, int, int]] = []
    rows = 0
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            if rows == per_block:
                yield runs, rows
                runs, rows = [], 0
            n = min(size - start, (per_block - rows) * width)
            runs.append((i, start, n))
            rows += -(-n // width)
            start += n
    if runs:
        yield runs, rows


def _width(total: int, tensors: int) -> int:
    """Row width: the power of two at or above a quarter of the mean tensor size, at most a block.

    Rows then number at most ``total / width + tensors`` (about five a tensor) and pads at most
    ``tensors * width`` elements (under half the total).
    """
    width = max(_MIN_WIDTH, total // (4 * tensors), 1)
    return min(1 << (width - 1).bit_length(), _BLOCK)


def _block_figures(
    ref: torch.Tensor, pat: torch.Tensor, diff: torch.Tensor, work: torch.Tensor, slack_rtol: float
) -> list[list[float]]:
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
    found = torch.cat(
        [torch.stack([max_diff, worst.to(torch.float64), max_rel, amax, max_slack], dim=1), values], dim=1
    )
    return found.tolist()


def _merge(figures: dict[int, list[float]], i: int, row: list[float]) -> None:
    """Fold one row's figures into tensor ``i``'s: maxima of both, the first worst position.

    A NaN difference sticks, so the tensor goes to ``compare_tensors``; the other figures are
    read only when every difference is finite, and then every value is.
    """
    held = figures.get(i)
    if held is None:
        figures[i] = row
        return
    if row[0] > held[0] or row[0] != row[0]:
        held[0], held[1], held[5], held[6] = row[0], row[1], row[5], row[6]
    for k in (2, 3, 4):
        if row[k] > held[k]:
            held[k] = row[k]


def _equal(path: str, ref: torch.Tensor, tolerance: Tolerance) -> TensorComparison:
    return TensorComparison(path, tuple(ref.shape), dtype_label(ref.dtype), total=ref.numel(), tolerance=tolerance)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    found = []
    for size in reversed(shape):
        index, rest = divmod(index, size)
        found.append(rest)
    return tuple(reversed(found))
