"""Lint what a replacement class is, not just which classes its key hits.

- ``SIGNATURE``: its ``__init__`` must take what the parent passes when it builds the original
  (read from the parent's source), its ``forward`` every parameter of the original's ``forward``
  and every keyword the parent passes when it runs it.
- ``UNUSED_ARGUMENT`` (a warning): a parameter the original names and reads that the replacement
  takes only through ``**kwargs`` and never reads (ignoring the cache breaks generation, not a
  full-sequence forward).
- ``WEIGHT_NAMES``: parameter and buffer names and shapes of the family's tiny model with and
  without the replacement, after the registered conversions rename the original's names.
- ``PARALLEL_PLAN`` (a warning): TP/PP plan entries that no longer resolve, and
  ``_no_split_modules`` entries that no longer cover the replaced class.

The first two and the ``_no_split_modules`` part read sources only. The others compare the two
:class:`Structure` objects that ``pytest_modelpatch.models.structure`` builds on the meta device.
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pytest_modelpatch.lint import contract_source as source
from pytest_modelpatch.lint.findings import Finding, Kind


CallSite = source.CallSite


class Structure(Protocol):
    """A built model's names: ``tensors`` (name -> shape), ``modules`` (name -> class name), plans."""

    tensors: Mapping[str, tuple[int, ...]]
    modules: Mapping[str, str]
    tp_plan: Mapping[str, str]
    pp_plan: Mapping[str, Any]


class BuiltStructure(Structure, Protocol):
    """A :class:`Structure` built from a model class: also the class's name and ``base_model_prefix``."""

    model_class: str
    base_model_prefix: str


class StructureBuilder(Protocol):
    """(model type, {class name: (replacement, modules binding it)}) -> (original, patched).

    With ``original=False`` the original is not built (the lint has it cached) and comes back None.
    """

    def __call__(self, model_type: str, replacements: Mapping[str, tuple[type, tuple[str, ...]]], *,
                 original: bool = True) -> tuple[BuiltStructure | None, BuiltStructure]: ...


@dataclass(frozen=True)
class Replaced:
    """One class a key replaces in the scope: where transformers defines it and with what."""

    key: str
    name: str
    module: str  # where it is defined
    family: str
    replacement: type
    bound_in: tuple[str, ...]  # modules whose attribute apply_patches swaps


# ---------------------------------------------------------------------------
# SIGNATURE and UNUSED_ARGUMENT
# ---------------------------------------------------------------------------


def signature_findings(replaced: Replaced, scope_modules: Iterable[str]) -> list[Finding]:
    """What the parent passes to the replacement's ``__init__``/``forward`` that it cannot take."""
    if _forward_owner(replaced.replacement).__module__.startswith("torch"):
        return []  # no forward of its own (a stand-in class): nothing to compare, it cannot run
    sites = [s for m in scope_modules for s in source.module_calls(m).constructions.get(replaced.name, [])]
    findings = _init_findings(replaced, sites)
    runs = [s for m in scope_modules for s in source.module_calls(m).forwards.get(replaced.name, [])]
    original = source.method_params(replaced.module, replaced.name, "forward")
    findings += _forward_findings(replaced, original, runs)
    if original is not None:
        findings += _unused_findings(replaced, original, runs)
    return findings


def _finding(kind: Kind, replaced: Replaced, message: str, suggestion: str = "") -> Finding:
    return Finding(kind, replaced.key, replaced.name, replaced.family, replaced.module, message, suggestion)


def _who(replaced: Replaced) -> str:
    return f"{_qualname(replaced.replacement)} (replacing {replaced.name} for key {replaced.key!r})"


def _init_findings(replaced: Replaced, sites: list[CallSite]) -> list[Finding]:
    signature = _signature(replaced.replacement)
    if signature is None:
        return []
    original = source.method_params(replaced.module, replaced.name, "__init__")
    wanted = f"{replaced.name}.__init__({', '.join(original.names)})" if original else f"{replaced.name}.__init__"
    problems = [f"{site}: {error}" for site in _unique(sites) if (error := _bind_error(signature, site))]
    if not sites and original is not None:
        # no call to read (built through a lookup table): compare with the original's __init__
        fake = source.CallSite(replaced.name, replaced.module, 0, 0, original.required, False)
        if error := _bind_error(signature, fake):
            problems.append(f"{wanted} requires ({', '.join(original.required)}): {error}")
        extra = [n for n in _required(signature) if original and n not in original.names]
        if extra:
            problems.append(f"it requires {', '.join(extra)}, which {wanted} does not take")
    if not problems:
        return []
    return [_finding(Kind.SIGNATURE, replaced, f"{_who(replaced)}: __init__{signature} cannot be built the way "
                     f"transformers builds {replaced.name}: {'; '.join(problems)}. Give it the signature of "
                     f"{wanted} (extra parameters need defaults).", suggestion=wanted)]


def _forward_findings(replaced: Replaced, original: source.Params | None, runs: list[CallSite]) -> list[Finding]:
    forward = getattr(replaced.replacement, "forward", None)
    signature = _signature(forward, drop_self=True) if forward is not None else None
    if signature is None:
        return []
    accepts = _accepts(signature)
    missing = [n for n in (original.names if original else ()) if not accepts(n)]
    problems = [f"{replaced.name}.forward takes {', '.join(missing)}"] if missing else []
    for site in _unique(runs):
        if error := _bind_error(signature, site):
            problems.append(f"{site}: {error}")
    if not problems:
        return []
    wanted = f"{replaced.name}.forward({', '.join(original.names)}, **kwargs)" if original else "**kwargs"
    return [_finding(Kind.SIGNATURE, replaced, f"{_who(replaced)}: forward{signature} would raise TypeError: "
                     f"{'; '.join(problems)}. Accept the same parameters ({wanted}).", suggestion=wanted)]


def _unused_findings(replaced: Replaced, original: source.Params, runs: list[CallSite]) -> list[Finding]:
    forward = getattr(replaced.replacement, "forward", None)
    signature = _signature(forward, drop_self=True) if forward is not None else None
    if signature is None or not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return []
    mentioned = _mentioned(replaced.replacement)
    if mentioned is None:
        return []  # forward is transformers' own, or its source cannot be read
    swallowed = [n for n in original.names if n in original.read and n not in signature.parameters
                 and n not in mentioned]
    return [_unused_finding(replaced, name, *_old_name(name, signature, original, runs)) for name in swallowed]


def _old_name(
    name: str, signature: inspect.Signature, original: source.Params, runs: list[CallSite]
) -> tuple[str | None, bool]:
    """The replacement's parameter that stands for ``name``, and whether transformers says it was renamed.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (``deprecate_kwarg``): a forward
    written before names the old spelling, and its callers now pass the new one, which ``**kwargs``
    swallows. Without such a decorator, the one parameter the original does not take and no
    caller names is the likely old spelling.
    """
    ours = [p for p, v in signature.parameters.items() if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]
    renamed = [old for old, new in original.renamed if new == name and old in ours]
    if renamed:
        return renamed[0], True
    if not runs:
        return None, False
    passed = {k for site in runs for k in site.keywords}
    reached = max(site.positional for site in runs)  # parameters before this are passed by position
    stale = [p for i, p in enumerate(ours) if i >= reached and p not in original.names and p not in passed]
    return (stale[0], False) if len(stale) == 1 else (None, False)


def _unused_finding(replaced: Replaced, name: str, old: str | None, renamed: bool) -> Finding:
    head = f"{_who(replaced)}: forward accepts {name!r} through **kwargs but never reads it"
    effect = "A forward over the whole sequence still matches; generation with a cache may not."
    both = (f"`def forward(self, ..., {name}=None, {old}=None, **kwargs)` and "
            f"`{name} = {name} if {name} is not None else {old}`")
    if old is None:
        message = (f"{head}, while {replaced.name}.forward uses it ({replaced.module}). {effect} Take {name} as "
                   f"a parameter and use it as {replaced.name} does.")
    elif renamed:
        message = (f"{_who(replaced)}: forward names {old!r}, which transformers renamed to {name!r}: "
                   f"{replaced.name}.forward ({replaced.module}) takes {name!r} and its callers pass {name}=..., "
                   f"which this forward accepts through **kwargs and never reads, while its {old!r} stays None. "
                   f"{effect} Accept {name!r}, or both spellings to support older transformers: {both}.")
    else:
        message = (f"{head}, while {replaced.name}.forward uses it ({replaced.module}); its own {old!r} is a "
                   f"parameter {replaced.name}.forward does not take and no caller passes. {effect} If {old!r} is "
                   f"what {name!r} was called before, accept {name!r}, or both spellings: {both}.")
    return _finding(Kind.UNUSED_ARGUMENT, replaced, message, suggestion=name)


def _mentioned(cls: type) -> set[str] | None:
    """Names and string constants in the replacement's own ``forward`` source."""
    owner = _forward_owner(cls)
    if owner.__module__.startswith(("transformers", "torch")):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(vars(owner)["forward"])))
    except (OSError, TypeError, SyntaxError):
        return None
    body = [n for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for s in f.body
            for n in ast.walk(s)]
    if any(_passes_on_to_super(n) for n in body):
        return None  # super().forward(..., **kwargs) hands the original everything it was given
    return {n.id for n in body if isinstance(n, ast.Name)} | {
        n.value for n in body if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _passes_on_to_super(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "forward"
            and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super" and any(k.arg is None for k in node.keywords))


def _forward_owner(cls: type) -> type:
    return next((k for k in cls.__mro__ if "forward" in vars(k)), object)


def _signature(obj: Any, *, drop_self: bool = False) -> inspect.Signature | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if drop_self and inspect.isfunction(obj):
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def _accepts(signature: inspect.Signature) -> Callable[[str], bool]:
    params = signature.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return lambda name: var_kw or (name in params and params[name].kind is not inspect.Parameter.POSITIONAL_ONLY)


def _required(signature: inspect.Signature) -> list[str]:
    return [n for n, p in signature.parameters.items() if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _bind_error(signature: inspect.Signature, site: CallSite) -> str:
    if site.unpacks:
        # what a **kwargs passes cannot be read: check only the keywords that are written out
        rejected = [k for k in site.keywords if not _accepts(signature)(k)]
        return f"no parameter {', '.join(rejected)}" if rejected else ""
    try:
        signature.bind(*range(site.positional), **dict.fromkeys(site.keywords))
    except TypeError as error:
        return str(error)
    return ""


def _unique(sites: Iterable[CallSite]) -> list[CallSite]:
    seen: dict[tuple[int, tuple[str, ...], bool], CallSite] = {}
    for site in sites:
        seen.setdefault((site.positional, tuple(sorted(site.keywords)), site.unpacks), site)
    return list(seen.values())


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------
# PARALLEL_PLAN: _no_split_modules, from the source
# ---------------------------------------------------------------------------


def no_split_findings(replaced: Replaced, scope_modules: Iterable[str]) -> list[Finding]:
    """A ``_no_split_modules`` entry that names the replaced class and not the replacement."""
    findings = []
    for module in scope_modules:
        for owner, names in source.no_split_modules(module).items():
            new = replaced.replacement.__name__
            if replaced.name in names and new not in names:
                findings.append(_finding(Kind.PARALLEL_PLAN, replaced, f"{owner}._no_split_modules names "
                                f"{replaced.name}, which {_who(replaced)} replaces: accelerate matches class names, so "
                                f"device_map='auto' may split {new} across devices. Name the replacement class "
                                f"{replaced.name}, or add {new!r} to {owner}._no_split_modules.", suggestion=new))
    return findings


# ---------------------------------------------------------------------------
# WEIGHT_NAMES and the TP/PP plans, from built structures
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OriginalModel:
    """The original tiny model's :class:`Structure`, and the names its checkpoint holds before and after loading.

    The checkpoint is what ``save_pretrained`` writes: the model's names with the family's
    built-in conversions reversed (per-expert MoE weights); ``loaded`` is what the built-in
    conversions alone make of them (kept in the facts file; :func:`weight_findings` fits the names
    to the patched model instead, as loading does). All of it depends only on transformers: it is cached.
    """

    tensors: Mapping[str, tuple[int, ...]]
    modules: Mapping[str, str]
    tp_plan: Mapping[str, str]
    pp_plan: Mapping[str, Any]
    checkpoint: tuple[str, ...]
    loaded: tuple[str, ...]

    @classmethod
    def of(cls, model_type: str, structure: BuiltStructure) -> OriginalModel:
        builtin = _builtin_conversions(model_type, structure.model_class)
        checkpoint = _renamed_all(structure.tensors, [t.reverse_transform() for t in builtin])
        return cls({n: tuple(s) for n, s in structure.tensors.items()}, dict(structure.modules),
                   dict(structure.tp_plan), dict(structure.pp_plan), tuple(checkpoint),
                   tuple(_renamed_all(checkpoint, builtin)))

    def to_json(self) -> dict[str, Any]:
        return {"tensors": {n: list(s) for n, s in self.tensors.items()}, "modules": dict(self.modules),
                "tp_plan": dict(self.tp_plan), "pp_plan": dict(self.pp_plan), "checkpoint": list(self.checkpoint),
                "loaded": list(self.loaded)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OriginalModel:
        tensors = {str(n): tuple(int(d) for d in s) for n, s in data["tensors"].items()}
        modules = {str(n): str(c) for n, c in data["modules"].items()}
        return cls(tensors, modules, dict(data["tp_plan"]), dict(data["pp_plan"]),
                   tuple(map(str, data["checkpoint"])), tuple(map(str, data["loaded"])))


def weight_findings(replaced: list[Replaced], model_type: str, original: OriginalModel, patched: BuiltStructure,
                    conversions: list[Any] | None) -> list[Finding]:
    """Names the checkpoint holds (renamed as loading renames them) that the patched model lacks, and back.

    Loading applies ``conversions`` when the patch registers some for the family (they replace
    the built-in ones), else the built-in ones, then fits each name to the patched model as
    transformers does (see :func:`_loaded_names`).
    """
    transforms = _builtin_conversions(model_type, patched.model_class) if conversions is None else conversions
    expected = _loaded_names(original.checkpoint, transforms, patched)
    exact = {n for n in expected if "*" not in n}
    wild = {n: _pattern(n) for n in expected if "*" in n}
    unexpected = sorted(n for n in exact if n not in patched.tensors) + sorted(
        n for n, p in wild.items() if not any(p.fullmatch(t) for t in patched.tensors))
    missing = sorted(n for n in patched.tensors if n not in exact and not any(p.fullmatch(n) for p in wild.values()))
    reshaped = sorted(n for n, shape in patched.tensors.items()
                      if n in exact and n in original.tensors and tuple(original.tensors[n]) != tuple(shape))
    if not (unexpected or missing or reshaped):
        return []
    owners = _owners(replaced, original, [*unexpected, *reshaped]) or _owners(replaced, patched, missing) or replaced[:1]
    registered = ", ".join(_describe(t) for t in conversions or [])
    covered = (f"The registered conversions for {model_type!r} ({registered}) do not produce these names."
               if conversions else f"No conversion is registered for {model_type!r}.")
    parts = []
    if missing:
        parts.append(f"missing keys (initialised randomly at load): {_short(missing)}")
    if unexpected:
        parts.append(f"unexpected keys (in the checkpoint, ignored): {_short(unexpected)}")
    if reshaped:
        parts.append("different shapes: " + _short(
            [f"{n} {tuple(original.tensors[n])} -> {tuple(patched.tensors[n])}" for n in reshaped]))
    fix = suggest_conversion(unexpected, missing)
    advice = (f" Register one with the patch, e.g. conversions={{{model_type!r}: [{fix}]}}." if fix
              else " Keep the original's parameter names and shapes, or register a conversion for them.")
    return [Finding(Kind.WEIGHT_NAMES, r.key, r.name, r.family, r.module,
                    f"{_who(r)}: loading a {model_type} checkpoint would report {'; '.join(parts)}. {covered}{advice}",
                    fix) for r in owners]


def _builtin_conversions(model_type: str, model_class: str) -> list[Any]:
    """The conversions loading applies to ``model_class``: its own mapping first, else the family's.

    As transformers' ``get_model_conversion_mapping`` does: the family's mapping is written for
    its ForXxx class (vibevoice_asr, llava and qwen2_audio move ``language_model`` under
    ``model.``), and a base model class such as ``LlavaModel`` has a mapping of its own.
    """
    # imported here: only a lint that built models (so imported transformers) gets this far
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping(model_class) or get_checkpoint_conversion_mapping(model_type) or [])


def _loaded_names(checkpoint: Iterable[str], transforms: list[Any], model: BuiltStructure) -> list[str]:
    """The names loading gives ``checkpoint``'s tensors in ``model``: renamed, then fitted to the model.

    Mirrors transformers' loader (``core_model_loading.rename_source_key`` and its caller): a
    renamed name that the model has only with one ``base_model_prefix`` level stripped or
    added gets that level stripped or added, and a name the renaming took somewhere the model
    lacks, while the model has the checkpoint's own name, keeps its own name. Without this a
    family whose conversions add ``model.`` for its ForXxx class (llava, qwen2_audio,
    vibevoice_asr, ...) looked as if its base model lost every weight.
    """
    present = _presence(model.tensors)
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    loaded: dict[str, None] = {}
    for name in checkpoint:
        targets = [_fitted(t, prefix, present) for t in _renamed(name, transforms)]
        if targets != [name] and not any(present(t) for t in targets) and present(name):
            targets = [_fitted(name, prefix, present)]
        loaded.update(dict.fromkeys(targets))
    return list(loaded)


def _fitted(name: str, prefix: str, present: Callable[[str], bool]) -> str:
    # strip first, as transformers does: a ForXxx checkpoint loaded into its base model
    if not prefix:
        return name
    if name.startswith(prefix) and present(name[len(prefix):]):
        return name[len(prefix):]
    if present(prefix + name):
        return prefix + name
    return name


def _presence(tensors: Mapping[str, Any]) -> Callable[[str], bool]:
    """Whether a name (``*`` standing for any layer index) is among ``tensors``."""
    names = set(tensors)

    def present(name: str) -> bool:
        if "*" not in name:
            return name in names
        pattern = _pattern(name)
        return any(pattern.fullmatch(n) for n in names)

    return present


def _renamed_all(names: Iterable[str], transforms: list[Any]) -> list[str]:
    return list(dict.fromkeys(new for name in names for new in _renamed(name, transforms)))


def _renamed(name: str, transforms: list[Any]) -> list[str]:
    for transform in transforms:
        # rename_source_key marks a transform as used: ask a copy, not the user's object
        renamed, pattern = copy.copy(transform).rename_source_key(name)
        if pattern is None:
            continue
        targets = list(transform.target_patterns)
        if len(targets) > 1 and len(transform.source_patterns) == 1:  # one to many: every target
            return [renamed.replace(targets[0], t, 1) for t in targets]
        return [renamed]
    return [name]


def suggest_conversion(unexpected: list[str], missing: list[str]) -> str:
    """A ``WeightConverter``/``WeightRenaming`` that turns the unexpected leaf names into the missing ones."""
    old = sorted({_leaf(n) for n in unexpected} - {None})  # type: ignore[arg-type]
    new = sorted({_leaf(n) for n in missing} - {None})  # type: ignore[arg-type]
    if not old or not new:
        return ""
    if len(old) == len(new) == 1:
        return f"WeightRenaming({old[0]!r}, {new[0]!r})"
    op = "Concatenate(dim=0)" if len(new) == 1 else "Chunk(dim=0)"
    return f"WeightConverter(source_patterns={old!r}, target_patterns={new!r}, operations=[{op}])"


def _leaf(name: str) -> str | None:
    # "layers.0.self_attn.q_proj.weight" -> "q_proj": the module the tensor belongs to
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else None


def plan_findings(replaced: list[Replaced], original: Structure, patched: Structure) -> list[Finding]:
    """TP and PP plan entries that resolve in the original model and not in the patched one."""
    findings = []
    for plan_name, plan in (("base_model_tp_plan", original.tp_plan), ("base_model_pp_plan", original.pp_plan)):
        for entry in plan:
            if _resolves(entry, original) and not _resolves(entry, patched):
                owner = _owners(replaced, original, [_example(entry, original)]) or replaced[:1]
                for r in owner:
                    news = _new_names(entry, original, patched)
                    hint = f" (it has {', '.join(news)} instead)" if news else ""
                    findings.append(_finding(
                        Kind.PARALLEL_PLAN, r,
                        f"{_who(r)}: the config's {plan_name} entry {entry!r}: {plan[entry]!r} no longer resolves in "
                        f"the patched model{hint}, so tensor/pipeline-parallel loading will not shard it. Give the "
                        f"replacement a _tp_plan for its own submodules (or a matching {plan_name} entry), or keep "
                        f"the original names through a conversion back.", suggestion=entry))
    return findings


def _pattern(entry: str) -> re.Pattern[str]:
    return re.compile(re.escape(entry).replace(r"\*", r"\d+"))


def _resolves(entry: str, structure: Structure) -> bool:
    pattern = _pattern(entry)
    return any(pattern.fullmatch(n) for n in [*structure.modules, *structure.tensors])


def _example(entry: str, structure: Structure) -> str:
    pattern = _pattern(entry)
    return next(n for n in [*structure.modules, *structure.tensors] if pattern.fullmatch(n))


def _new_names(entry: str, original: Structure, patched: Structure) -> list[str]:
    parent = entry.rpartition(".")[0]
    pattern = re.compile(re.escape(parent).replace(r"\*", r"\d+") + r"\.[^.]+") if parent else None
    if pattern is None:
        return []
    new = {n.rpartition(".")[2] for n in patched.modules if pattern.fullmatch(n) and n not in original.modules}
    return sorted(new)


def _owners(replaced: list[Replaced], structure: Structure, names: list[str]) -> list[Replaced]:
    """The replaced classes whose instances hold ``names`` in ``structure``."""
    found: dict[int, Replaced] = {}
    for name in names:
        path = name
        while path:
            cls = structure.modules.get(path)
            for i, r in enumerate(replaced):
                if cls in (r.name, r.replacement.__name__):
                    found.setdefault(i, r)
            path = path.rpartition(".")[0]
    return list(found.values())


def _describe(transform: Any) -> str:
    return f"{type(transform).__name__}({list(transform.source_patterns)} -> {list(transform.target_patterns)})"


def _short(items: list[str], limit: int = 6) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
