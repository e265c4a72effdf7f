"""How close is close enough: per-dtype tolerance policies and where overrides come from.

An element of a patched output passes when::

    |patched - reference| <= abs_term + rtol * |reference|
    abs_term = max(atol, ulps * ulp(amax))        (policy values)
    abs_term = atol                                (when atol is set explicitly)

``amax`` is the largest finite ``|reference|`` of the whole compared tensor and
``ulp(x) = 2 ** floor(log2(x)) * eps(dtype)`` is the spacing of the dtype's values
at ``x``. The ulp term is the magnitude-aware part: a bf16 logit built from values
around 20 carries a round-off of up to 0.0625 even where it is itself near zero, so
a fixed ``atol`` of 1e-5 fails every harmless reimplementation in low precision.

The ``sqnr`` policy judges a whole tensor instead, as quantization authors do (torchao)::

    SQNR = 10 * log10(sum(reference ** 2) / sum((patched - reference) ** 2)) >= min_sqnr_db

with a per-dtype minimum in dB; ``"sqnr:45"`` names the same policy with 45 dB for every dtype.

The ``oracle`` policy (torch._dynamo's ``same(..., fp64_ref=...)``) also runs the reference in
float64 and passes a tensor when the patched model is no worse against that oracle than the
reference itself is::

    rmse(patched, fp64) <= factor * rmse(reference, fp64) + floor

Every built-in policy lives here: the five a user names (``default``, ``strict``, ``loose``,
``sqnr``, ``oracle``) and the two the checks choose when the user chose none: ``GRADIENT_POLICY``
for gradients and ``TRAINING_POLICY`` for the losses and gradient norms of optimizer steps.

Overrides, highest first: explicit arguments, the ``tolerance`` marker, the
``modelpatch_atol`` / ``modelpatch_rtol`` ini keys, the policy's per-dtype values.
This module imports no torch at import time: the plugin sets a test's overrides
through :func:`set_test_tolerance` for every test that has a marker or ini value.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_modelpatch.errors import PatchUsageError

# Spacing of values in [1, 2): 2 ** -(explicit mantissa bits), torch.finfo(dtype).eps.
_EPS: dict[str, float] = {
    "float64": 2.0**-52,
    "float32": 2.0**-23,
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
}


def dtype_label(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through."""
    return str(dtype).removeprefix("torch.")


def _is_floating(name: str) -> bool:
    return name.startswith(("float", "bfloat", "complex"))


def ulp(magnitude: float, dtype: Any) -> float:
    """Spacing of ``dtype`` values at ``magnitude``: ``ulp(16.0, torch.bfloat16) == 0.125``."""
    eps = _EPS.get(dtype_label(dtype))
    if eps is None or not math.isfinite(magnitude) or magnitude <= 0.0:
        return 0.0
    return 2.0 ** math.floor(math.log2(magnitude)) * eps


@dataclass(frozen=True)
class DtypeTolerance:
    """Tolerance values for one dtype; ``ulps`` scales the magnitude-aware absolute term."""

    atol: float
    rtol: float
    ulps: float = 0.0
    min_sqnr_db: float | None = None  # set: judge the whole tensor by SQNR instead of elementwise
    oracle_factor: float | None = None  # set: judge the whole tensor against a float64 run of the reference
    oracle_floor: float = 0.0


@dataclass(frozen=True)
class TolerancePolicy:
    """Named per-dtype tolerances; dtypes it does not list compare exactly (integers, bools).

    Example::

        TolerancePolicy("tight-bf16", {"bfloat16": DtypeTolerance(atol=1e-5, rtol=8e-3, ulps=2)})
    """

    name: str
    per_dtype: Mapping[str, DtypeTolerance] = field(default_factory=dict)
    # Floating dtypes not listed (float8 variants, ...) use this entry's values.
    fallback: str = "bfloat16"

    def entry(self, dtype: Any) -> DtypeTolerance:
        name = dtype_label(dtype)
        if name in self.per_dtype:
            return self.per_dtype[name]
        if _is_floating(name) and self.fallback in self.per_dtype:
            return self.per_dtype[self.fallback]
        return DtypeTolerance(atol=0.0, rtol=0.0, ulps=0.0)

    def __str__(self) -> str:
        if any(v.oracle_factor is not None for v in self.per_dtype.values()):
            rows = ", ".join(
                f"{k}: factor={v.oracle_factor:g} floor={v.oracle_floor:g}" for k, v in self.per_dtype.items()
            )
            return f"policy {self.name!r} ({rows})"
        if any(v.min_sqnr_db is not None for v in self.per_dtype.values()):
            rows = ", ".join(f"{k}: SQNR >= {v.min_sqnr_db:g} dB" for k, v in self.per_dtype.items())
            return f"policy {self.name!r} ({rows})"
        rows = ", ".join(f"{k}: atol={v.atol:g} rtol={v.rtol:g} ulps={v.ulps:g}" for k, v in self.per_dtype.items())
        return f"policy {self.name!r} ({rows})"


# torch.testing.assert_close defaults, plus 4 ulps of the tensor's magnitude (256 in float32): two correct
# implementations of the same math (sdpa and eager attention) differ by up to 75 ulps of a tensor's max |value|
# over every family of transformers 5.24 in float32, the smallest real bug among the examples by 1100
# (docs/tolerance.md, why float32 allows 256 ulps).
DEFAULT_POLICY = TolerancePolicy(
    "default",
    {
        "float64": DtypeTolerance(atol=1e-7, rtol=1e-7, ulps=4),
        "float32": DtypeTolerance(atol=1e-5, rtol=1.3e-6, ulps=256),
        "float16": DtypeTolerance(atol=1e-5, rtol=1e-3, ulps=4),
        "bfloat16": DtypeTolerance(atol=1e-5, rtol=1.6e-2, ulps=4),
    },
)
# Bitwise identical: for patches that claim to run the very same kernels.
STRICT_POLICY = TolerancePolicy("strict", {k: DtypeTolerance(0.0, 0.0, 0.0) for k in _EPS})
# Ten times the default's atol and rtol, and 16 ulps: for patches that change accumulation order on purpose
# (inductor's fusions). float32 keeps the default's 256 ulps, which already hold reordered round-off: four times
# them would pass the examples' smallest bug (an RMSNorm without epsilon, 1100 ulps).
LOOSE_POLICY = TolerancePolicy(
    "loose",
    {k: DtypeTolerance(v.atol * 10, v.rtol * 10, max(v.ulps, 16)) for k, v in DEFAULT_POLICY.per_dtype.items()},
)
# Quantization noise, judged per tensor: an int8 weight-only Llama MLP scores 38-41 dB at the
# logits of the tiny model with its non-degenerate seeded weights (float32), a wrong scale or a
# transposed weight scores under 10 dB; half-precision round-off alone costs ~45 dB.
SQNR_DEFAULT_DB: dict[str, float] = {"float64": 30.0, "float32": 30.0, "float16": 30.0, "bfloat16": 25.0}


def sqnr_policy(min_db: float | Mapping[str, float] | None = None) -> TolerancePolicy:
    """The ``sqnr`` policy: a minimum SQNR in dB, per dtype (default :data:`SQNR_DEFAULT_DB`) or for all.

    Example: ``assert_equivalent(ref, quantized, policy=sqnr_policy(30))`` (same as ``policy="sqnr:30"``).
    """
    if min_db is None:
        per_dtype, name = dict(SQNR_DEFAULT_DB), "sqnr"
    elif isinstance(min_db, Mapping):
        per_dtype, name = {**SQNR_DEFAULT_DB, **min_db}, "sqnr-custom"
    else:
        per_dtype, name = dict.fromkeys(SQNR_DEFAULT_DB, float(min_db)), f"sqnr:{float(min_db):g}"
    return TolerancePolicy(name, {k: DtypeTolerance(0.0, 0.0, 0.0, min_sqnr_db=v) for k, v in per_dtype.items()})


SQNR_POLICY = sqnr_policy()

# torch._dynamo's same() allows 2x the reference's own RMSE against fp64; the floor keeps an
# exact reference (error 0) from demanding exactness of the patched model.
ORACLE_FACTOR = 2.0
ORACLE_FLOOR: dict[str, float] = {"float64": 1e-12, "float32": 1e-7, "float16": 1e-4, "bfloat16": 1e-3}


def oracle_policy(factor: float = ORACLE_FACTOR, floor: Mapping[str, float] | None = None) -> TolerancePolicy:
    """The ``oracle`` policy: patched error against a float64 reference run <= factor x the reference's + floor.

    Where no float64 run exists (module replay), tensors are judged by the ``default`` numbers.
    Example: ``assert_equivalent(ref, kernel, policy=oracle_policy(3))`` (same as ``policy="oracle:3"``).
    """
    floors = {**ORACLE_FLOOR, **(floor or {})}
    name = "oracle" if factor == ORACLE_FACTOR and floor is None else f"oracle:{factor:g}"
    return TolerancePolicy(name, {
        k: DtypeTolerance(v.atol, v.rtol, v.ulps, oracle_factor=float(factor), oracle_floor=floors[k])
        for k, v in DEFAULT_POLICY.per_dtype.items()
    })  # fmt: skip


ORACLE_POLICY = oracle_policy()

# Gradients sum over every token and pass back through every layer, so they carry more
# round-off than outputs. Measured on the good example patches (swiglu/rmsnorm autograd kernels,
# fused QKV, split-K MLP), tiny Llama, CPU, 3 input sizes: fp32 gradients differ by up to 13 ulps
# of the tensor's max |value| (the outputs: 4), bf16 by up to 4; so 16 and 8 ulps, about 1.2-2x
# headroom, with the output policy's atol/rtol otherwise (fp32 rtol 1e-5: 2.3e-5 needed at 4 ulps). Never fewer
# ulps than the outputs are allowed: float32 outputs get 256 (correct implementations over every family).
GRADIENT_POLICY = TolerancePolicy(
    "gradient",
    {
        "float64": DtypeTolerance(atol=1e-7, rtol=1e-7, ulps=16),
        "float32": DtypeTolerance(atol=1e-5, rtol=1e-5, ulps=max(16, DEFAULT_POLICY.entry("float32").ulps)),
        "float16": DtypeTolerance(atol=1e-5, rtol=1e-3, ulps=8),
        "bfloat16": DtypeTolerance(atol=1e-5, rtol=1.6e-2, ulps=8),
    },
)

# The loss, the gradient norm and the eval log-probabilities of two trainings of one model are
# scalars or small vectors averaged over many tokens: far less round-off than one output element.
# Measured on the good example kernels (SwiGLU and RMSNorm autograd, reordered MLP), tiny Llama,
# 8 AdamW steps at lr 1e-3: fp32 losses within 2.4e-7 (rel 8e-8), gradient norms within rel 1.2e-7;
# bf16 losses within 5.9e-3 (rel 1.9e-3). So rel 1e-5 and 5e-3, 100x and 2.5x their headroom at
# the last step before growth; parameters are judged as gradients are (GRADIENT_POLICY: 16 ulps of
# the tensor's max |value| in fp32, 8 in bf16: a bf16 weight near 1 may differ by one step of 7.8e-3).
TRAINING_POLICY = TolerancePolicy(
    "training",
    {
        "float64": DtypeTolerance(atol=1e-9, rtol=1e-9, ulps=4),
        "float32": DtypeTolerance(atol=1e-6, rtol=1e-5, ulps=4),
        "float16": DtypeTolerance(atol=1e-4, rtol=1e-3, ulps=4),
        "bfloat16": DtypeTolerance(atol=1e-3, rtol=5e-3, ulps=4),
    },
)
POLICIES: dict[str, TolerancePolicy] = {
    p.name: p for p in (DEFAULT_POLICY, STRICT_POLICY, LOOSE_POLICY, SQNR_POLICY, ORACLE_POLICY)
}


def get_policy(policy: str | TolerancePolicy | None, where: str = "policy=") -> TolerancePolicy:
    """Look a policy up by name (``"default"``, ``"strict"``, ``"loose"``) or pass one through."""
    if policy is None:
        return DEFAULT_POLICY
    if isinstance(policy, TolerancePolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]
    kind, _, number = policy.partition(":") if isinstance(policy, str) else ("", "", "")
    value = parse_tolerance_value(number, kind, where) if kind in ("sqnr", "oracle") and number.strip() else None
    if value is not None:
        return sqnr_policy(value) if kind == "sqnr" else oracle_policy(value)
    raise PatchUsageError(
        f"{where}: unknown tolerance policy {policy!r}. Use one of {sorted(POLICIES)}, 'sqnr:DB' (e.g. 'sqnr:30'), "
        "'oracle:FACTOR' (e.g. 'oracle:3') or a TolerancePolicy object."
    )


def parse_tolerance_value(value: Any, name: str, where: str) -> float | None:
    """Validate one atol/rtol value (number or numeric string); ``None``/empty means unset."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise PatchUsageError(f"{where}: {name}={value!r} is not a non-negative number. Write e.g. {name}=1e-4.")
    return number


@dataclass(frozen=True)
class ToleranceOverride:
    """atol/rtol/policy from one source (``"marker"``, ``"ini"``, ...); ``None`` leaves a value unset."""

    atol: float | None = None
    rtol: float | None = None
    policy: str | TolerancePolicy | None = None
    source: str = "argument"

    @classmethod
    def from_marker(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any], where: str = "") -> ToleranceOverride:
        """Validate ``@pytest.mark.tolerance(atol=, rtol=, policy=)``; wrong use is a usage error."""
        where = where or "@pytest.mark.tolerance"
        unknown = sorted(set(kwargs) - {"atol", "rtol", "policy"})
        if args or unknown:
            raise PatchUsageError(
                f"{where}: takes only keyword arguments atol=, rtol=, policy= "
                f"(got positional {list(args)!r}, unknown {unknown!r}). Write e.g. tolerance(atol=1e-4, rtol=1e-3)."
            )
        policy = kwargs.get("policy")
        if policy is not None:
            get_policy(policy, where)
        return cls(
            atol=parse_tolerance_value(kwargs.get("atol"), "atol", where),
            rtol=parse_tolerance_value(kwargs.get("rtol"), "rtol", where),
            policy=policy,
            source="marker",
        )

    @classmethod
    def from_ini(cls, atol: Any, rtol: Any, policy: Any = None) -> ToleranceOverride:
        """Validate the ``modelpatch_atol`` / ``modelpatch_rtol`` / ``modelpatch_tolerance_policy`` ini values."""
        policy = policy or None
        if policy is not None:
            get_policy(policy, "ini modelpatch_tolerance_policy")
        return cls(
            atol=parse_tolerance_value(atol, "atol", "ini modelpatch_atol"),
            rtol=parse_tolerance_value(rtol, "rtol", "ini modelpatch_rtol"),
            policy=policy,
            source="ini",
        )


_TEST_OVERRIDES: contextvars.ContextVar[tuple[ToleranceOverride, ...]] = contextvars.ContextVar(
    "modelpatch_test_tolerance", default=()
)


def set_test_tolerance(*overrides: ToleranceOverride) -> Callable[[], None]:
    """Set the running test's overrides, highest precedence first; returns the function that undoes it.

    Example (plugin, around a test call)::

        reset = set_test_tolerance(ToleranceOverride.from_marker(m.args, m.kwargs), ToleranceOverride.from_ini(a, r))
        try: ...
        finally: reset()
    """
    token = _TEST_OVERRIDES.set(tuple(overrides))
    return lambda: _TEST_OVERRIDES.reset(token)


@dataclass(frozen=True)
class Tolerance:
    """The tolerance applied to one compared tensor, with where each number came from."""

    dtype: str
    atol: float
    rtol: float
    ulps: float
    policy: str
    atol_source: str
    rtol_source: str
    min_sqnr_db: float | None = None
    oracle_factor: float | None = None
    oracle_floor: float = 0.0

    def abs_term(self, amax: float) -> float:
        """The absolute part of the bound for a tensor whose largest ``|reference|`` is ``amax``."""
        return max(self.atol, self.ulps * ulp(amax, self.dtype))

    @property
    def exact(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0 and self.ulps == 0.0

    def __str__(self) -> str:
        if self.min_sqnr_db is not None:
            return f"SQNR >= {self.min_sqnr_db:g} dB at {self.dtype} (policy {self.policy!r})"
        if self.oracle_factor is not None:
            return (
                f"rmse against float64 <= {self.oracle_factor:g} x the reference's + {self.oracle_floor:g} "
                f"at {self.dtype} (policy {self.policy!r})"
            )
        ulps = f" or {self.ulps:g} ulps of max|ref|" if self.ulps else ""
        if self.atol_source == self.rtol_source:
            return f"atol={self.atol:g}{ulps}, rtol={self.rtol:g} at {self.dtype} ({self.atol_source})"
        return f"atol={self.atol:g}{ulps} ({self.atol_source}), rtol={self.rtol:g} ({self.rtol_source}) at {self.dtype}"


@dataclass(frozen=True)
class ToleranceSpec:
    """A resolved request, before the dtype is known: ``spec.for_dtype(torch.bfloat16)``."""

    policy: TolerancePolicy
    policy_source: str
    atol: tuple[float, str] | None = None
    rtol: tuple[float, str] | None = None
    # each dtype's Tolerance, made once: a property check asks for it for every output of every example
    _by_dtype: dict[Any, Tolerance] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def for_dtype(self, dtype: Any) -> Tolerance:
        found = self._by_dtype.get(dtype)
        if found is None:
            found = self._by_dtype[dtype] = self._resolve(dtype)
        return found

    def _resolve(self, dtype: Any) -> Tolerance:
        name = dtype_label(dtype)
        entry = self.policy.entry(name)
        origin = f"policy {self.policy.name!r}" + (
            "" if self.policy_source == "default" else f" ({self.policy_source})"
        )
        if not _is_floating(name):
            return Tolerance(name, 0.0, 0.0, 0.0, self.policy.name, "integer dtype", "integer dtype")
        atol, atol_source = self.atol if self.atol is not None else (entry.atol, origin)
        rtol, rtol_source = self.rtol if self.rtol is not None else (entry.rtol, origin)
        # An explicit atol is the whole absolute term: the ulp floor belongs to the policy.
        ulps = 0.0 if self.atol is not None else entry.ulps
        return Tolerance(
            name, atol, rtol, ulps, self.policy.name, atol_source, rtol_source,
            entry.min_sqnr_db, entry.oracle_factor, entry.oracle_floor,
        )  # fmt: skip

    @property
    def uses_oracle(self) -> bool:
        """Whether comparisons need a float64 run of the reference (the ``oracle`` policy)."""
        return any(v.oracle_factor is not None for v in self.policy.per_dtype.values())

    def __str__(self) -> str:
        source = "" if self.policy_source == "default" else f" ({self.policy_source})"
        parts = [f"policy {self.policy.name!r}{source}"]
        parts += [f"{k}={v[0]:g} ({v[1]})" for k, v in (("atol", self.atol), ("rtol", self.rtol)) if v is not None]
        return ", ".join(parts)


def judged_as(spec: ToleranceSpec, dtype: str) -> ToleranceSpec:
    """``spec`` judging every tensor as ``dtype``: for a value a lower precision computed and float32 holds.

    Example: a bfloat16 model's loss is float32 (transformers upcasts the logits), but its round-off
    is bfloat16's: reductions over the bf16 logits in another order move it by far more than float32
    allows. ``judged_as(spec, "bfloat16").for_dtype(torch.float32).rtol == spec.for_dtype(torch.bfloat16).rtol``
    """
    entry = spec.policy.entry(dtype)
    policy = TolerancePolicy(spec.policy.name, {name: entry for name in (*spec.policy.per_dtype, "float32", dtype)})
    return ToleranceSpec(policy, spec.policy_source, spec.atol, spec.rtol)


def resolve_tolerance(
    atol: float | None = None, rtol: float | None = None, policy: str | TolerancePolicy | None = None
) -> ToleranceSpec:
    """Merge arguments > marker > ini > policy into one spec, each value keeping its source.

    Example::

        resolve_tolerance(atol=1e-4).for_dtype(torch.float32).atol == 1e-4
    """
    layers = [ToleranceOverride(atol=atol, rtol=rtol, policy=policy, source="argument"), *_TEST_OVERRIDES.get()]
    chosen_atol = chosen_rtol = chosen_policy = None
    for layer in layers:
        if chosen_atol is None and layer.atol is not None:
            chosen_atol = (parse_tolerance_value(layer.atol, "atol", layer.source) or 0.0, layer.source)
        if chosen_rtol is None and layer.rtol is not None:
            chosen_rtol = (parse_tolerance_value(layer.rtol, "rtol", layer.source) or 0.0, layer.source)
        if chosen_policy is None and layer.policy is not None:
            chosen_policy = (get_policy(layer.policy, layer.source), layer.source)
    resolved_policy, policy_source = chosen_policy or (DEFAULT_POLICY, "default")
    return ToleranceSpec(resolved_policy, policy_source, chosen_atol, chosen_rtol)
