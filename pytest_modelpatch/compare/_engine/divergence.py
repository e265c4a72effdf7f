"""Where a patched model parts from its reference: per-module recording, first divergence, module replay.

``first_divergence`` records every module call of both models (forward hooks, in the
order the calls finish) and names the first module present in both whose inputs
agree but whose output does not: the module that introduced the difference, not
one of the many that merely pass it on. Only computed values count: a field one side
never produces (attention weights under sdpa, a mask left to the kernel, ``None`` on one
side) or holds in another form (a mask of booleans against an additive float one) is
named, but makes no module diverge and no inputs differ.
``assert_module_equivalent`` replays the real arguments an original module received into
its replacement.
"""

from __future__ import annotations

import copy
import difflib
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_modelpatch.compare._engine.blame import Blame, ReplacedCall, blame_replacements, replaced_module_names
from pytest_modelpatch.compare._engine.devices import evaluating, placement, unwrapped
from pytest_modelpatch.compare._engine.hints import class_pair
from pytest_modelpatch.compare._engine.inputs import default_inputs, describe_inputs
from pytest_modelpatch.compare._engine.outputs import (
    TensorComparison,
    compare_flat,
    describe_tolerances,
    flatten_outputs,
)
from pytest_modelpatch.compare._engine.reports import CheckReport
from pytest_modelpatch.compare._engine.running import forward
from pytest_modelpatch.compare._engine.same_model import require_same_model
from pytest_modelpatch.compare._engine.sharded import sharding_line
from pytest_modelpatch.compare._engine.tolerance import TolerancePolicy, ToleranceSpec, resolve_tolerance
from pytest_modelpatch.compare._engine.train_mode import training_state
from pytest_modelpatch.errors import ModelPatchError, PatchUsageError


def _flat_clone(value: Any, path: str = "") -> dict[str, Any]:
    # Clone: a later in-place op (residual adds, cache updates) must not change what was seen.
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in flatten_outputs(value, path, caches=False)
    }


@dataclass
class ModuleCall:
    """One call of a named submodule: what went in and what came out (flattened tensors)."""

    name: str
    index: int  # 0 for the first call of this module in the forward, 1 for the second, ...
    module_class: str
    inputs: dict[str, Any]
    output: dict[str, Any]
    mutated: list[str] = field(default_factory=list)  # inputs the call changed in place
    arguments: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # kept for a replay (args, kwargs)


Hook = Callable[..., None]


def run_with_hooks(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    hooks: list[tuple[torch.nn.Module, Hook, Hook]],
    *,
    train: bool = False,
) -> None:
    """One forward of ``model`` with ``(module, pre_hook, hook)`` installed (both with kwargs); removed after.

    ``train``: run it in train mode with dropout off (``compare.backward.step.training_state``), not eval.
    """
    handles = []
    try:
        for module, before, after in hooks:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
        with training_state(model) if train else evaluating(model):
            forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()


def record_module_calls(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, train: bool = False, keep: Collection[str] = ()
) -> list[ModuleCall]:
    """Run ``model`` on ``inputs`` and return every submodule call in the order the calls finished.

    The calls of the modules named in ``keep`` also keep a copy of their arguments, to replay them.
    """
    calls: list[ModuleCall] = []
    open_calls: dict[str, list[tuple[int, dict[str, Any], Any]]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)

    def hooks(name: str, module: torch.nn.Module) -> tuple[torch.nn.Module, Hook, Hook]:
        def before(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            kept = (_snapshot(args), _snapshot(kwargs)) if name in keep else None
            open_calls[name].append((counts[name], {**_flat_clone(args, "args"), **_flat_clone(kwargs)}, kept))
            counts[name] += 1

        def after(_: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            index, seen, kept = open_calls[name].pop()
            live = {**dict(flatten_outputs(args, "args", caches=False)), **dict(flatten_outputs(kwargs, caches=False))}
            mutated = [
                path for path, value in live.items()
                if isinstance(value, torch.Tensor) and isinstance(seen.get(path), torch.Tensor)
                and value.shape == seen[path].shape and not torch.equal(value, seen[path])
            ]  # fmt: skip
            made = _flat_clone(output, "output")
            calls.append(ModuleCall(name, index, type(module).__name__, seen, made, mutated, kept))

        return module, before, after

    # The root is skipped: its output is the model output, compared already. A wrapper (PEFT) runs,
    # and its modules are named as inside the model it wraps, so they pair with the reference's.
    named = unwrapped(model).named_modules()
    run_with_hooks(model, inputs, [hooks(name, module) for name, module in named if name], train=train)
    return calls


@dataclass
class Divergence:
    """The first module whose output differs, and whether its inputs still agreed."""

    name: str
    index: int
    reference_class: str
    patched_class: str
    inputs_agree: bool
    output_differences: list[TensorComparison]
    input_differences: list[TensorComparison] = field(default_factory=list)
    profile: list[tuple[str, float]] = field(default_factory=list, repr=False)
    mutated_inputs: list[str] = field(default_factory=list)  # changed in place by the patched module only
    sharding: str = ""  # a sharded patched model: how, and the rank that saw it (compare._engine.sharded.sharding_line)
    other_form: list[TensorComparison] = field(
        default_factory=list
    )  # its inputs and outputs one side lacks or holds otherwise
    blame: Blame | None = None  # replaced modules whose own output differs, replayed on the reference's arguments

    @property
    def blamed(self) -> str:
        """The module a reader should look at first: the blamed replacement, else the first diverging module."""
        return self.blame.first if self.blame is not None else self.name

    def __str__(self) -> str:
        return self.text()

    def text(self, where: str = "") -> str:
        """The report, ``where`` (``"at step 1, "``) before the blamed replacement and the first diverging module."""
        call = f" (call {self.index + 1})" if self.index else ""
        classes = class_pair(self.reference_class, self.patched_class)
        seen = f"; {self.sharding}" if self.sharding else ""
        lines = [f"{where}{self.blame}"] if self.blame is not None else []
        lines.append(f"{where}first diverging module: {self.name}{call} ({classes}{seen})")
        if self.mutated_inputs:
            lines.append(
                f"  it changes its input {', '.join(self.mutated_inputs)} in place, which the original does not: "
                "the caller and every later reader of that tensor see other values (clone before an in-place op)"
            )
        if self.inputs_agree:
            lines.append("  its inputs agree; its output differs:")
        else:
            lines.append(
                "  no shared module diverges on agreeing inputs: the difference starts in code outside any "
                "module both models share; this is the first module whose output differs. Its inputs differ:"
            )
            lines += [f"    {c}" for c in self.input_differences[:3]]
            lines.append("  and its output:")
        lines += [f"    {c}" for c in self.output_differences]
        lines += [f"  {line}" for line in describe_tolerances(self.output_differences)]
        if self.other_form:
            lines.append("  held by one side only or in another form, so not compared (not what makes it diverge):")
            lines += [f"    {c}" for c in self.other_form]
        return "\n".join(lines)


def _call_label(call: ModuleCall) -> str:
    return call.name if not call.index else f"{call.name}#{call.index}"


def first_divergence(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
    train: bool = False,
) -> Divergence | None:
    """The first module, in the order calls finish, present in both models whose output differs
    under the tolerance ``atol``/``rtol``/``policy`` give (as for ``assert_equivalent``).

    Prefers a module whose inputs agree (it introduced the difference); falls back to the first
    differing module at all. ``None`` when every shared module agrees. ``train=True`` runs both in
    train mode with dropout off (for ``if self.training`` paths).

    Example::

        first_divergence(reference_model, patched_model, inputs).name  # "model.layers.0.self_attn"
    """
    return find_divergence(reference, patched, inputs, resolve_tolerance(atol, rtol, policy), train=train)


def find_divergence(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any],
    spec: ToleranceSpec,
    *,
    patched_inputs: Mapping[str, Any] | None = None,
    train: bool = False,
) -> Divergence | None:
    """``first_divergence`` under a resolved tolerance, as the checks call it.

    Prefers a module whose inputs agree (it introduced the difference); falls back to the
    first differing module at all. ``None`` when every shared module agrees. The result's
    ``profile`` holds every shared call's max abs output difference, in forward order.
    ``patched_inputs``: the patched model's own inputs when they cannot be shared (a decoding
    step, where each model brings its own KV cache); default ``inputs``.
    ``train=True`` runs both in train mode with dropout off (for ``if self.training`` paths).

    Example::

        find_divergence(reference, patched, inputs, resolve_tolerance()).name  # "model.layers.0.self_attn"
    """
    own = inputs if patched_inputs is None else patched_inputs
    patched_calls = {(c.name, c.index): c for c in record_module_calls(patched, own, train=train)}
    found = fallback = None
    profile: list[tuple[str, float]] = []
    replaced = replaced_module_names(reference, patched)
    reference_calls = record_module_calls(reference, inputs, train=train, keep=replaced)
    for call in reference_calls:
        other = patched_calls.get((call.name, call.index))
        if other is None:
            continue
        comparisons = compare_flat(call.output, other.output, spec)
        profile.append((_call_label(call), max((c.max_abs for c in comparisons if c.problem is None), default=0.0)))
        outputs, other_form = _computed_differences(comparisons)
        mutated = [path for path in other.mutated if path not in call.mutated]
        if mutated and found is None:
            # its own output may agree, yet it changed what its caller holds: it is the culprit, not the caller
            ins, unmade = _computed_differences(compare_flat(call.inputs, other.inputs, spec, common_only=True))
            found = Divergence(call.name, call.index, call.module_class, other.module_class, not ins, outputs, ins,
                               mutated_inputs=mutated, other_form=unmade + other_form)  # fmt: skip
            continue
        if not outputs or found is not None:
            continue
        ins, unmade = _computed_differences(compare_flat(call.inputs, other.inputs, spec, common_only=True))
        candidate = Divergence(call.name, call.index, call.module_class, other.module_class, not ins, outputs, ins,
                               other_form=unmade + other_form)  # fmt: skip
        if candidate.inputs_agree:
            found = candidate
        else:
            fallback = fallback or candidate
    result = found or fallback
    if result is not None:
        result.profile = profile
        result.sharding = sharding_line(patched)
        replays = [ReplacedCall(c.name, c.index, c.module_class, *c.arguments, c.output)
                   for c in reference_calls if c.arguments is not None]  # fmt: skip
        if not result.sharding:  # a sharded replacement holds this rank's slice: the whole arguments do not fit it
            result.blame = blame_replacements(patched, replays, spec, train=train)
    return result


def _computed_differences(comparisons: list[TensorComparison]) -> tuple[list[TensorComparison], list[TensorComparison]]:
    """The failing comparisons split: values both sides computed that differ, and fields one side lacks or holds otherwise."""
    failed = [c for c in comparisons if not c.passed]
    return [c for c in failed if not c.other_form], [c for c in failed if c.other_form]


def divergence_profile(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
) -> list[tuple[str, float]]:
    """``[(module call, max abs output difference), ...]`` for every call both models make, in forward order."""
    found = find_divergence(reference, patched, inputs, resolve_tolerance(atol, rtol, policy))
    if found is not None:
        return found.profile
    patched_calls = {(c.name, c.index): c for c in record_module_calls(patched, inputs)}
    return [
        (_call_label(call), 0.0)
        for call in record_module_calls(reference, inputs)
        if (call.name, call.index) in patched_calls
    ]


# ---------------------------------------------------------------------------
# Module replay
# ---------------------------------------------------------------------------


def _snapshot(value: Any) -> Any:
    # Deep copy so a replay sees the state the original saw (a KV cache keeps growing).
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable argument is replayed as is
        return value


@dataclass
class CapturedCall:
    """The arguments one original-module call received, and what it returned."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: dict[str, Any]


def capture_module_calls(
    model: torch.nn.Module, module: torch.nn.Module, inputs: Mapping[str, Any]
) -> list[CapturedCall]:
    """Run ``model`` and keep the real arguments and output of every call of ``module``."""
    calls: list[CapturedCall] = []
    pending: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def before(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pending.append((_snapshot(args), _snapshot(kwargs)))

    def after(_: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        call_args, call_kwargs = pending.pop()
        calls.append(CapturedCall(call_args, call_kwargs, _flat_clone(output, "output")))

    run_with_hooks(model, inputs, [(module, before, after)])
    return calls


@dataclass
class ModuleEquivalenceReport(CheckReport):
    """Outcome of replaying an original module's real calls into its replacement."""

    check_kind = "module"

    original: str
    patched: str
    calls: int
    comparisons: list[TensorComparison]
    tolerance: ToleranceSpec
    failing_call: int | None = None
    arguments: str = ""
    duration_s: float = 0.0
    device: str = ""  # where the original module's parameters are
    dtype: str = ""

    @property
    def passed(self) -> bool:
        return self.failing_call is None

    @property
    def reference(self) -> str:
        """The row's model: the original module replayed."""
        return self.original

    def worst_output(self) -> str:
        return ""  # a module's outputs are not the model's: the row names none

    def row_fields(self) -> dict[str, Any]:
        return {"replacements": [self.patched], "examples": self.calls}

    def __str__(self) -> str:
        if self.failing_call is None:  # passed
            worst = max((c.max_abs for c in self.comparisons), default=0.0)
            return f"{self.patched} matches {self.original} on {self.calls} replayed call(s), max abs {worst:.3g}"
        lines = [
            f"{self.patched} differs from {self.original} on replayed call {self.failing_call + 1} of {self.calls}",
            f"  arguments: {self.arguments}",
        ]
        failures = [c for c in self.comparisons if not c.passed]
        lines += [f"  {line}" for line in describe_tolerances(failures)]
        lines += [f"  {c}" for c in failures]
        return "\n".join(lines)


def _resolve_module(model: torch.nn.Module, name: str, role: str) -> torch.nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise PatchUsageError(
            f"assert_module_equivalent: {role} {type(model).__name__} has no submodule {name!r}.{hint}"
        ) from None


def _module_pair(
    reference: torch.nn.Module, patched: torch.nn.Module, module: Any
) -> tuple[tuple[str, torch.nn.Module], tuple[str, torch.nn.Module]]:
    """``(name, module)`` of each side: ``module`` is a qualified name in both models, or the two modules."""
    if isinstance(module, str):
        return (module, _resolve_module(reference, module, "reference")), (
            module, _resolve_module(patched, module, "patched"),
        )  # fmt: skip
    if (
        isinstance(module, tuple) and len(module) == 2
        and all(isinstance(m, torch.nn.Module) for m in module)
    ):  # fmt: skip
        return (type(module[0]).__name__, module[0]), (type(module[1]).__name__, module[1])
    raise PatchUsageError(
        f"assert_module_equivalent: module= is a qualified name in both models or a (reference module, patched "
        f"module) pair, not {type(module).__name__}; e.g. assert_module_equivalent(reference_model, patched_model, "
        "'model.layers.0.self_attn')."
    )


def assert_module_equivalent(
    reference: torch.nn.Module,
    patched: torch.nn.Module,
    module: str | tuple[torch.nn.Module, torch.nn.Module],
    *,
    inputs: Mapping[str, Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    policy: str | TolerancePolicy | None = None,
) -> ModuleEquivalenceReport:
    """Replay the arguments ``module`` got in the reference forward into its counterpart in ``patched``.

    ``module`` is a qualified name in both models, or the two modules themselves (the reference's,
    the patched model's). Catches a broken module even when later layers hide the error in the
    final outputs.

    Example::

        assert_module_equivalent(reference_model, patched_model, "model.layers.0.self_attn")
        assert_module_equivalent(ref, pat, (ref.model.layers[0].self_attn, pat.model.layers[0].self_attn))
    """
    __tracebackhide__ = True
    require_same_model(reference, patched, "assert_module_equivalent")
    start = time.perf_counter()
    (reference_name, reference_module), (patched_name, patched_module) = _module_pair(reference, patched, module)
    inputs = default_inputs(reference) if inputs is None else inputs
    spec = resolve_tolerance(atol, rtol, policy)
    calls = capture_module_calls(reference, reference_module, inputs)
    if not calls:
        raise ModelPatchError(
            f"assert_module_equivalent: {reference_name} ({type(reference_module).__name__}) did not run in the "
            f"reference forward on {describe_inputs(inputs)}; pick a module on the forward path."
        )
    report = ModuleEquivalenceReport(
        f"{reference_name} ({type(reference_module).__name__})",
        f"{patched_name} ({type(patched_module).__name__})",
        len(calls), [], spec, **placement(reference_module),
    )  # fmt: skip
    with evaluating(patched_module):
        for index, call in enumerate(calls):
            replayed = _flat_clone(patched_module(*call.args, **call.kwargs), "output")
            report.comparisons = compare_flat(call.output, replayed, spec)
            if not all(c.passed for c in report.comparisons):
                report.failing_call = index
                report.arguments = describe_inputs({"args": call.args, **call.kwargs}, limit=0)
                break
    report.duration_s = time.perf_counter() - start
    return report.conclude()
