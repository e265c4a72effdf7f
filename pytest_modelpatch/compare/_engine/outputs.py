"""One tensor-tree comparison for every check: walk outputs, compare leaves.

``flatten_outputs`` turns any model output (``ModelOutput`` fields, tuples, dicts, cache
layers) into ``path -> leaf``; ``compare_flat`` judges two such trees under a tolerance and
returns one :class:`TensorComparison` per leaf. Pure comparison: running the models is
:mod:`.running`'s. Forward equivalence, divergence recording, property checks and module
replay all build on this module and nothing here builds on them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pytest_modelpatch.compare._engine.sharded import whole
from pytest_modelpatch.compare._engine.tolerance import Tolerance, ToleranceSpec, dtype_label

_MISSING: Any = object()


# ---------------------------------------------------------------------------
# Walking outputs
# ---------------------------------------------------------------------------


NO_FINITE_VALUE = (
    "the reference holds no finite value (all NaN or infinite), so any patched values would pass: nothing was "
    "compared. Check the inputs, the weights and the dtype (float16 overflows to inf)"
)


NOTHING_COMPARED = (
    "neither model returned a tensor with an element, so nothing was compared: pass inputs that produce "
    "outputs, or compare the outputs you care about yourself"
)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_cache(value: Any) -> bool:
    return isinstance(getattr(value, "layers", None), list) and type(value).__name__.endswith("Cache")


def flatten_outputs(value: Any, path: str = "", *, caches: bool = True) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every tensor, ``None`` and scalar in an output, in order.

    Example::

        dict(flatten_outputs(model(**inputs)))["logits"]  # also "cache.layers[0].keys" (past_key_values before 5.24)
    """
    # Walked into a list, not through nested generators: every check flattens both outputs of
    # every example, and a chain of ``yield from`` costs more than the walk itself.
    found: list[tuple[str, Any]] = []
    _flatten_into(found, value, path, caches)
    return iter(found)


_LEAF, _FIELDS, _MAPPING, _SEQUENCE, _OTHER = range(5)


@functools.lru_cache(maxsize=512)
def _kind(cls: type) -> tuple[int, tuple[str, ...]]:
    """How ``flatten_outputs`` walks an instance of ``cls``, with a ``ModelOutput``'s field names."""
    if issubclass(cls, (torch.Tensor, bool, int, float, str, type(None))):
        return _LEAF, ()
    if dataclasses.is_dataclass(cls) and issubclass(cls, Mapping):
        # ModelOutput: fields() keeps the None ones, which keys() drops.
        return _FIELDS, tuple(f.name for f in dataclasses.fields(cls))
    if issubclass(cls, Mapping):
        return _MAPPING, ()
    if issubclass(cls, (list, tuple)):
        return _SEQUENCE, ()
    return _OTHER, ()


def _flatten_into(found: list[tuple[str, Any]], value: Any, path: str, caches: bool) -> None:
    cls: type = type(value)  # mypy takes type[Any] for no Hashable, which the lru_cache wants
    kind, names = _kind(cls)
    if kind == _LEAF:
        found.append((path, value))
    elif kind == _FIELDS:
        for name in names:
            _flatten_into(found, getattr(value, name), _join(path, name), caches)
    elif kind == _MAPPING:
        for key, item in value.items():
            sub = _join(path, key) if isinstance(key, str) and key.isidentifier() else f"{path}[{key!r}]"
            _flatten_into(found, item, sub, caches)
    elif kind == _SEQUENCE:
        for index, item in enumerate(value):
            _flatten_into(found, item, f"{path}[{index}]", caches)
    elif _is_cache(value):
        if caches:
            for index, layer in enumerate(value.layers):
                for name, item in vars(layer).items():
                    if not name.startswith("_") and isinstance(item, (torch.Tensor, Mapping, list, tuple)):
                        _flatten_into(found, item, f"{path}.layers[{index}].{name}", True)
    else:
        found.append((path, _Opaque(type(value).__qualname__)))


@dataclass(frozen=True)
class _Opaque:
    """A leaf we do not look inside; compared by type only."""

    type_name: str


# ---------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------


def vacuous_outputs(outputs: Any) -> list[str]:
    """Paths of floating outputs a comparison could pass vacuously: any NaN, or no finite value at all.

    Infinities beside finite values are kept: masked logits are -inf by design (Grounding DINO).
    """
    return [
        path for path, leaf in flatten_outputs(outputs)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel()
        and (bool(leaf.isnan().any()) or not bool(leaf.isfinite().any()))
    ]  # fmt: skip


def _describe_leaf(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {dtype_label(value.dtype)}"
    if value is _MISSING:
        return "absent"
    if isinstance(value, _Opaque):
        return value.type_name
    return repr(value)


@dataclass
class TensorComparison:
    """One output leaf compared: either a structural problem or error statistics against the tolerance."""

    path: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    problem: str | None = None
    max_abs: float = 0.0
    max_rel: float = 0.0
    over: int = 0
    total: int = 0
    worst_index: tuple[int, ...] = ()
    worst_reference: float | None = None
    worst_patched: float | None = None
    bound_at_worst: float = 0.0
    tolerance: Tolerance | None = None
    sqnr_db: float | None = None  # set when the tolerance judges by SQNR
    oracle_rmse: tuple[float, float, float] | None = None  # (patched, reference, allowed) against float64
    # held by one side only (None or absent on the other: attention weights eager returns and sdpa never does, a
    # mask one implementation builds and another leaves to the kernel), or in another form (a mask of booleans
    # against an additive float one): first_divergence does not count it as a computed difference
    other_form: bool = False
    one_sided: bool = False  # of those, held by one side only: None or absent on the other

    @property
    def passed(self) -> bool:
        if self.problem is None and self.sqnr_db is not None and self.tolerance is not None:
            return self.sqnr_db >= (self.tolerance.min_sqnr_db or 0.0)
        return self.problem is None and self.over == 0

    def __str__(self) -> str:
        name = self.path or "<output>"
        if self.problem is not None:
            return f"{name}: {self.problem}"
        head = f"{name}: shape {self.shape} {self.dtype}"
        sqnr = "" if self.sqnr_db is None else f"SQNR {self.sqnr_db:.1f} dB, "
        if self.passed:
            return f"{head}: ok ({sqnr}max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g})"
        if self.oracle_rmse is not None and self.tolerance is not None:
            patched, reference, allowed = self.oracle_rmse
            return (
                f"{head}: rmse against float64 {patched:.4g}, more than allowed {allowed:.4g} "
                f"({self.tolerance.oracle_factor:g} x the reference's {reference:.4g} + {self.tolerance.oracle_floor:g}); "
                f"max abs {self.max_abs:.4g}, max rel {self.max_rel:.4g}"
            )
        if self.sqnr_db is not None and self.tolerance is not None:
            return (
                f"{head}: SQNR {self.sqnr_db:.1f} dB, below the minimum {self.tolerance.min_sqnr_db:g} dB; "
                f"max abs {self.max_abs:.4g}, max rel {self.max_rel:.4g}"
            )
        index = ", ".join(map(str, self.worst_index))
        return (
            f"{head}: {self.over}/{self.total} elements over tolerance; max abs {self.max_abs:.4g}, "
            f"max rel {self.max_rel:.4g}; worst at [{index}]: reference {self.worst_reference:.6g}, "
            f"patched {self.worst_patched:.6g} (allowed {self.bound_at_worst:.3g})"
        )


class ComparedTensors:
    """The figures every check report derives from its ``comparisons``: failures and worst errors.

    Mixed into the forward, backward and export reports; each keeps its own ``passed``, since
    each fails for reasons beyond its tensors (an unused replacement, graph breaks).
    """

    # a dataclass field or a property in each report; a read-only property to the type checker, and
    # only to it: a property here would be taken by a subclass's dataclass field as its default
    if TYPE_CHECKING:

        @property
        def comparisons(self) -> list[TensorComparison]: ...

    @property
    def failures(self) -> list[TensorComparison]:
        return [c for c in self.comparisons if not c.passed]

    @property
    def max_abs_error(self) -> float:
        return max((c.max_abs for c in self.comparisons), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max((c.max_rel for c in self.comparisons), default=0.0)


def describe_tolerances(comparisons: list[TensorComparison]) -> list[str]:
    """One ``tolerance: ...`` line per distinct tolerance the comparisons were judged by."""
    seen = dict.fromkeys(str(c.tolerance) for c in comparisons if c.tolerance is not None)
    return [f"tolerance: {text}" for text in seen]


def compare_tensors(
    path: str, reference: torch.Tensor, patched: torch.Tensor, spec: ToleranceSpec, oracle: torch.Tensor | None = None
) -> TensorComparison:
    """Compare two tensors under ``spec`` at the reference's dtype (``oracle``: the float64 run's tensor)."""
    shape, dtype = tuple(reference.shape), dtype_label(reference.dtype)
    if tuple(patched.shape) != shape or patched.dtype != reference.dtype:
        mask_forms = {reference.dtype == torch.bool, patched.dtype == torch.bool} == {True, False}
        return TensorComparison(
            path,
            shape,
            dtype,
            problem=f"reference is {_describe_leaf(reference)}, patched is {_describe_leaf(patched)}",
            other_form=mask_forms and (reference.is_floating_point() or patched.is_floating_point()),
        )
    tolerance = spec.for_dtype(reference.dtype)
    if tolerance.oracle_factor is not None and (oracle is None or tuple(oracle.shape) != shape):
        # no float64 run of this tensor (module replay, a cache of another shape): elementwise numbers
        tolerance = dataclasses.replace(tolerance, oracle_factor=None)
    total = reference.numel()
    judge_sqnr = tolerance.min_sqnr_db is not None
    if total == 0 or torch.equal(reference, patched):
        return TensorComparison(
            path, shape, dtype, total=total, tolerance=tolerance, sqnr_db=math.inf if judge_sqnr else None
        )
    if (reference.is_floating_point() or reference.is_complex()) and not bool(reference.isfinite().any()):
        # NaN in both agrees (below): with nothing finite, any patched NaN would pass
        return TensorComparison(path, shape, dtype, total=total, tolerance=tolerance, problem=NO_FINITE_VALUE)
    wide = torch.complex128 if reference.is_complex() else torch.float64
    ref, pat = reference.detach().to(wide), patched.detach().to(wide)
    diff = (pat - ref).abs()
    # Equal values (infinities included) and NaN in both count as agreeing; NaN in one does not.
    # posinf=inf: nan_to_num's default turns inf into the dtype's max, which reports read as 1.8e+308.
    diff = torch.where(
        (ref == pat) | (ref.isnan() & pat.isnan()), 0.0, diff.nan_to_num(nan=torch.inf, posinf=torch.inf)
    )
    magnitude = ref.abs()
    finite = magnitude[magnitude.isfinite()]
    amax = float(finite.max()) if finite.numel() else 0.0
    bound = tolerance.abs_term(amax) + tolerance.rtol * magnitude.nan_to_num(nan=0.0, posinf=0.0)
    over_mask = diff > bound
    over = int(over_mask.sum())
    sqnr = sqnr_db(ref, pat) if judge_sqnr else None
    if sqnr is not None:  # judged as a whole: every element is over, or none
        over = 0 if sqnr >= (tolerance.min_sqnr_db or 0.0) else total
    oracle_rmse = None
    if tolerance.oracle_factor is not None and oracle is not None:
        truth = oracle.detach().to(wide)
        patched_error, reference_error = _rmse(pat, truth), _rmse(ref, truth)
        allowed = tolerance.oracle_factor * reference_error + tolerance.oracle_floor
        oracle_rmse = (patched_error, reference_error, allowed)
        over = 0 if patched_error <= allowed else total  # a NaN error is over
    rel = torch.where(diff == 0, 0.0, diff / magnitude)
    flat = int(torch.argmax(diff - bound)) if over else int(torch.argmax(diff))
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), reference.shape))
    return TensorComparison(
        path, shape, dtype,
        max_abs=float(diff.max()), max_rel=float(rel.nan_to_num(nan=torch.inf, posinf=torch.inf).max()),
        over=over, total=total, worst_index=worst,
        worst_reference=complex(ref[worst]).real if ref.is_complex() else float(ref[worst]),
        worst_patched=complex(pat[worst]).real if pat.is_complex() else float(pat[worst]),
        bound_at_worst=float(bound[worst]), tolerance=tolerance,
        sqnr_db=sqnr, oracle_rmse=oracle_rmse,
    )  # fmt: skip


def _rmse(value: torch.Tensor, truth: torch.Tensor) -> float:
    return float((value - truth).abs().pow(2).mean().sqrt())


def sqnr_db(reference: torch.Tensor, patched: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum ref^2 / sum (pat - ref)^2)`` (torchao's ``compute_error``)."""
    noise = float((patched - reference).abs().pow(2).sum())
    signal = float(reference.abs().pow(2).sum())
    if noise == 0.0:
        return math.inf
    if not math.isfinite(noise) or signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def compare_leaves(
    path: str, reference: Any, patched: Any, spec: ToleranceSpec, oracle: Any = None
) -> TensorComparison | None:
    """Compare two leaves from :func:`flatten_outputs`; ``None`` when there is nothing to compare."""
    if isinstance(reference, torch.Tensor) and isinstance(patched, torch.Tensor):
        return compare_tensors(path, reference, patched, spec, oracle if isinstance(oracle, torch.Tensor) else None)
    if reference is None and patched is None:
        return None
    same = (
        not isinstance(reference, torch.Tensor)
        and not isinstance(patched, torch.Tensor)
        and reference is not _MISSING
        and patched is not _MISSING
        and reference == patched
    )
    if same:
        return None
    one_sided = any(side is None or side is _MISSING for side in (reference, patched))
    return TensorComparison(path, problem=f"reference is {_describe_leaf(reference)}, patched is {_describe_leaf(patched)}",
                            other_form=one_sided, one_sided=one_sided)  # fmt: skip


def compare_flat(
    reference: Mapping[str, Any],
    patched: Mapping[str, Any],
    spec: ToleranceSpec,
    *,
    common_only: bool = False,
    oracle: Mapping[str, Any] | None = None,
) -> list[TensorComparison]:
    """Compare two ``path -> leaf`` dicts; a path on one side only is a problem unless ``common_only``.

    ``oracle``: the same paths from a float64 run of the reference, for the ``oracle`` policy.
    A sharded patched model's leaves are made whole first (:func:`~pytest_modelpatch.compare._engine.sharded.whole`).
    """
    patched = whole(reference, patched)
    paths = [*reference, *(p for p in patched if p not in reference)]
    if common_only:
        paths = [p for p in paths if p in reference and p in patched]
    results, covered = [], set()
    for path in paths:
        if path in covered:
            continue
        ref, pat = reference.get(path, _MISSING), patched.get(path, _MISSING)
        if ref is None and pat is _MISSING or pat is None and ref is _MISSING:
            # None on one side, a tuple or dict of tensors on the other: one problem, not one per tensor.
            other = patched if ref is None else reference
            inside = [p for p in other if p.startswith((f"{path}[", f"{path}."))]
            if inside:
                covered.update(inside)
                text = _describe_leaf(other[inside[0]]) if len(inside) == 1 else f"{len(inside)} tensors"
                side = (
                    f"reference is None, patched is {text}" if ref is None else f"reference is {text}, patched is None"
                )
                problem = f"{side} (at {inside[0]})"
                results.append(TensorComparison(path, problem=problem, other_form=True, one_sided=True))
                continue
        result = compare_leaves(path, ref, pat, spec, (oracle or {}).get(path))
        if result is not None:
            results.append(result)
    return results


def compare_outputs(reference: Any, patched: Any, spec: ToleranceSpec, oracle: Any = None) -> list[TensorComparison]:
    """Compare two (nested) outputs leaf by leaf; structure differences are reported as problems.

    ``oracle``: the output of a float64 run of the reference (:func:`oracle_outputs`), or ``None``.
    """
    truth = dict(flatten_outputs(oracle)) if oracle is not None else None
    found = compare_flat(dict(flatten_outputs(reference)), dict(flatten_outputs(patched)), spec, oracle=truth)
    if not any(c.total or c.problem for c in found):
        # no output tensor with an element: a model that returns None (or empty tensors) matches anything
        found.append(TensorComparison("<outputs>", problem=NOTHING_COMPARED))
    return found
