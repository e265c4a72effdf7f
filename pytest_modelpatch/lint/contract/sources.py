"""Lint what a replacement class is, not just which classes its key hits.

- ``SIGNATURE``: every call of the original read from the family's source (the parent building
  it, running it) must bind the replacement's ``__init__``/``forward``; names count only where a
  call passes them by keyword (``RENAMED_PARAMETER`` notes a positional one named differently).
- ``UNUSED_ARGUMENT`` (a warning): a parameter the original names and reads that the replacement
  takes only through ``**kwargs`` and never reads (ignoring the cache breaks generation, not a
  full-sequence forward).
- ``PARALLEL_PLAN`` (a warning), its source part: ``_no_split_modules`` entries that no longer
  cover the replaced class.

These read sources only. The findings that compare the two :class:`Structure` objects
``pytest_modelpatch.lint.model_structures`` builds on the meta device (``WEIGHT_NAMES``, the TP/PP
plans) are in :mod:`.structures`. This module also holds the types both share.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pytest_modelpatch.lint.contract import reading as source
from pytest_modelpatch.lint.findings import Finding, Kind

CallSite = source.CallSite


class Structure(Protocol):
    """A built model's names: ``tensors`` (name -> shape), ``modules`` (name -> class name), plans.

    Read-only, so that a frozen dataclass is one.
    """

    @property
    def tensors(self) -> Mapping[str, tuple[int, ...]]: ...
    @property
    def modules(self) -> Mapping[str, str]: ...
    @property
    def tp_plan(self) -> Mapping[str, str]: ...
    @property
    def pp_plan(self) -> Mapping[str, Any]: ...


class BuiltStructure(Structure, Protocol):
    """A :class:`Structure` built from a model class: also the class's name and ``base_model_prefix``."""

    @property
    def model_class(self) -> str: ...
    @property
    def base_model_prefix(self) -> str: ...


class StructureBuilder(Protocol):
    """(model type, {class name: (replacement, modules binding it)}) -> (original, patched).

    With ``original=False`` the original is not built (the lint has it cached) and comes back None.
    """

    def __call__(
        self, model_type: str, replacements: Mapping[str, tuple[type, tuple[str, ...]]], *, original: bool = True
    ) -> tuple[BuiltStructure | None, BuiltStructure]: ...


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


def signature_findings(
    replaced: Replaced, scope_modules: Iterable[str], models: Sequence[Mapping[str, str]] = ()
) -> list[Finding]:
    """The calls of the original in the scope that the replacement's ``__init__``/``forward`` would not bind.

    ``models``: the module classes (path -> class name) of the scope's tiny models, when built. A
    run that a built parent makes through an attribute holding no such class there is never made
    (BertLayer's ``self.crossattention(...)`` in a BERT encoder) and is not judged.
    """
    if _forward_owner(replaced.replacement).__module__.startswith("torch"):
        return []  # no forward of its own (a stand-in class): nothing to compare, it cannot run
    calls = [source.module_calls(m) for m in scope_modules]
    sites = [s for c in calls for s in c.constructions.get(replaced.name, [])]
    runs = [s for c in calls for s in c.forwards.get(replaced.name, []) if made(s, replaced.name, models)]
    findings = _call_findings(replaced, "__init__", sites) + _call_findings(replaced, "forward", runs)
    original = source.method_params(replaced.module, replaced.name, "forward")
    if original is not None:
        findings += _unused_findings(replaced, original, runs)
    return findings


def made(run: CallSite, name: str, models: Sequence[Mapping[str, str]]) -> bool:
    """Whether the built ``models`` make ``run``: not where its parent is built and its attribute never holds ``name``."""
    parents = [(modules, path) for modules in models for path, cls in modules.items() if cls == run.parent]
    if not run.attribute or not parents:
        return True  # nothing built says otherwise (a head class, a parent that only another config builds)
    for modules, path in parents:
        held = f"{path}.{run.attribute}" if path else run.attribute
        # the attribute itself, or the items of a ModuleList in it (a loop over self.layers)
        if any(
            cls == name and (p == held or (p.startswith(f"{held}.") and p[len(held) + 1 :].isdigit()))
            for p, cls in modules.items()
        ):
            return True
    return False


def finding(kind: Kind, replaced: Replaced, message: str, suggestion: str = "") -> Finding:
    """A finding of ``kind`` about the class ``replaced`` replaces."""
    return Finding(kind, replaced.key, replaced.name, replaced.family, replaced.module, message, suggestion)


def who(replaced: Replaced) -> str:
    """The replacement named for a message: its qualified name, what it replaces, under which key."""
    return f"{_qualname(replaced.replacement)} (replacing {replaced.name} for key {replaced.key!r})"


def _call_findings(replaced: Replaced, method: str, sites: list[CallSite]) -> list[Finding]:
    """SIGNATURE when a call site of the original would not bind the replacement's ``method``.

    Only what the sites pass counts, not the original's parameter names: transformers names
    the same argument ``x`` in one family and ``hidden_states`` in another, and passes it by
    position. With no site to read (built or run through a lookup table), the original's
    required parameters are passed by position. A renamed positional parameter that no site
    passes by keyword is a ``RENAMED_PARAMETER`` note.
    """
    signature = _method_signature(replaced.replacement, method)
    if signature is None:
        return []
    original = source.method_params(replaced.module, replaced.name, method)
    expected = original.signature() if original is not None else None
    # a site the original itself would not bind was read wrong (an attribute holding another class)
    readable = [s for s in _unique(sites) if expected is None or not _bind_error(expected, s)]
    problems = [f"{site}: {error}" for site in readable if (error := _bind_error(signature, site, expected))]
    if not readable and original is not None:
        error = _bind_error(signature, original.required_call(replaced.name, replaced.module))
        if error:
            problems.append(
                f"no call of {replaced.name} can be read in the family's modules (from_pretrained, "
                f"a registry), and passing what {replaced.name}.{method} requires "
                f"({', '.join(original.required)}) by position fails: {error}"
            )
    if not problems:
        return _renamed_notes(replaced, method, signature, original, readable)
    names = ", ".join(original.names) if original is not None else ""
    if method == "__init__":
        wanted = f"{replaced.name}.__init__({names})" if original else f"{replaced.name}.__init__"
        message = (
            f"__init__{signature} cannot be built the way transformers builds {replaced.name}: "
            f"{'; '.join(problems)}. Give it the signature of {wanted} (extra parameters need defaults)."
        )
    else:
        wanted = f"{replaced.name}.forward({names}, **kwargs)" if original else "**kwargs"
        message = (
            f"forward{signature} would raise TypeError: {'; '.join(problems)}. Accept the same parameters ({wanted})."
        )
    return [finding(Kind.SIGNATURE, replaced, f"{who(replaced)}: {message}", suggestion=wanted)]


def _renamed_notes(
    replaced: Replaced, method: str, signature: inspect.Signature, original: source.Params | None, sites: list[CallSite]
) -> list[Finding]:
    """A note for positional parameters named differently from the original's that no site passes by keyword."""
    if original is None:
        return []
    ours = [n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_keyword = {k for site in sites for k in site.keywords}
    renamed = [
        (theirs, mine)
        for theirs, mine in zip(original.names[: original.positional], ours)
        if theirs != mine and theirs not in by_keyword
    ]
    if not renamed:
        return []
    pairs = ", ".join(f"{mine!r} where {replaced.name}.{method} has {theirs!r}" for theirs, mine in renamed)
    how = "every call the lint reads passes it by position" if sites else "no call can be read; by position it lines up"
    return [
        finding(
            Kind.RENAMED_PARAMETER,
            replaced,
            f"{who(replaced)}: {method} names {pairs}: {how}, so it binds. "
            f"Code that passes {renamed[0][0]}=... by keyword would raise TypeError.",
            suggestion=renamed[0][0],
        )
    ]


def _unused_findings(replaced: Replaced, original: source.Params, runs: list[CallSite]) -> list[Finding]:
    signature = _method_signature(replaced.replacement, "forward")
    if signature is None or not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return []
    mentioned = _mentioned(replaced.replacement)
    if mentioned is None:
        return []  # forward is transformers' own, or its source cannot be read
    by_position = _passed_by_position(original, signature, runs)
    swallowed = [
        n
        for n in original.names
        if n in original.read and n not in signature.parameters and n not in mentioned and n not in by_position
    ]
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
    head = f"{who(replaced)}: forward accepts {name!r} through **kwargs but never reads it"
    effect = "A forward over the whole sequence still matches; generation with a cache may not."
    both = (
        f"`def forward(self, ..., {name}=None, {old}=None, **kwargs)` and "
        f"`{name} = {name} if {name} is not None else {old}`"
    )
    if old is None:
        message = (
            f"{head}, while {replaced.name}.forward uses it ({replaced.module}). {effect} Take {name} as "
            f"a parameter and use it as {replaced.name} does."
        )
    elif renamed:
        message = (
            f"{who(replaced)}: forward names {old!r}, which transformers renamed to {name!r}: "
            f"{replaced.name}.forward ({replaced.module}) takes {name!r} and its callers pass {name}=..., "
            f"which this forward accepts through **kwargs and never reads, while its {old!r} stays None. "
            f"{effect} Accept {name!r}, or both spellings to support older transformers: {both}."
        )
    else:
        message = (
            f"{head}, while {replaced.name}.forward uses it ({replaced.module}); its own {old!r} is a "
            f"parameter {replaced.name}.forward does not take and no caller passes. {effect} If {old!r} is "
            f"what {name!r} was called before, accept {name!r}, or both spellings: {both}."
        )
    return finding(Kind.UNUSED_ARGUMENT, replaced, message, suggestion=name)


def _mentioned(cls: type) -> set[str] | None:
    """Names and string constants in the replacement's own ``forward`` source."""
    owner = _forward_owner(cls)
    if owner.__module__.startswith(("transformers", "torch")):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(vars(owner)["forward"])))
    except (OSError, TypeError, SyntaxError):
        return None
    body = [
        n
        for f in tree.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for s in f.body
        for n in ast.walk(s)
    ]
    if any(_passes_on_to_super(n) for n in body):
        return None  # super().forward(..., **kwargs) hands the original everything it was given
    return {n.id for n in body if isinstance(n, ast.Name)} | {
        n.value for n in body if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _passes_on_to_super(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "forward"
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "super"
        and any(k.arg is None for k in node.keywords)
    )


def _forward_owner(cls: type) -> type:
    return next((k for k in cls.__mro__ if "forward" in vars(k)), object)


def _method_signature(cls: type, method: str) -> inspect.Signature | None:
    """The replacement's ``__init__`` (as the class is called) or ``forward`` signature, ``self`` left out."""
    if method == "__init__":
        return _signature(cls)
    function = getattr(cls, method, None)
    return _signature(function, drop_self=True) if function is not None else None


def _signature(obj: Any, *, drop_self: bool = False) -> inspect.Signature | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if drop_self and inspect.isfunction(obj):
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def _passed_by_position(original: source.Params, signature: inspect.Signature, sites: list[CallSite]) -> set[str]:
    """The original's parameters that every call passes by position: they bind whatever the replacement names them."""
    params = signature.parameters.values()
    slots = (
        len(params)
        if any(p.kind is p.VAR_POSITIONAL for p in params)
        else sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    )
    reach = min(s.positional for s in sites) if sites else sum(n in original.required for n in original.names)
    return set(original.names[: min(reach, slots, original.positional)])


def _accepts(signature: inspect.Signature) -> Callable[[str], bool]:
    params = signature.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return lambda name: var_kw or (name in params and params[name].kind is not inspect.Parameter.POSITIONAL_ONLY)


def _required(signature: inspect.Signature) -> list[str]:
    return [
        n
        for n, p in signature.parameters.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _bind_error(signature: inspect.Signature, site: CallSite, original: inspect.Signature | None = None) -> str:
    """Why ``site`` would not bind ``signature`` ("" when it would).

    What a ``*args``/``**kwargs`` at the site passes cannot be read. The keywords and positional
    arguments written out must still bind, and a required parameter left unbound is missing
    when the original (``original``) needs nothing from the unpacked arguments: they are the
    caller's extras (``**kwargs: Unpack[TransformersKwargs]``), not the tensor the replacement
    wants under another name.
    """
    if not site.unpacks:
        try:
            signature.bind(*range(site.positional), **dict.fromkeys(site.keywords))
        except TypeError as error:
            return str(error)
        return ""
    rejected = [k for k in site.keywords if not _accepts(signature)(k)]
    if rejected:
        return f"no parameter {', '.join(rejected)}"
    try:
        missing = _unbound(signature, site)
    except TypeError as error:
        return str(error)
    if not missing or original is None:
        return ""
    try:
        if _unbound(original, site):
            return ""  # the original needs something from the unpacked arguments too: they may supply it
    except TypeError:
        return ""  # the original does not bind what is written out: nothing to compare with
    return (
        f"missing a required argument: {missing[0]!r} (the arguments it writes out do not pass it, and the "
        f"original takes all it requires from them)"
    )


def _unbound(signature: inspect.Signature, site: CallSite) -> list[str]:
    """The required parameters the arguments ``site`` writes out leave unbound; TypeError if they do not bind."""
    bound = signature.bind_partial(*range(site.positional), **dict.fromkeys(site.keywords))
    return [n for n in _required(signature) if n not in bound.arguments]


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
                findings.append(
                    finding(
                        Kind.PARALLEL_PLAN,
                        replaced,
                        f"{owner}._no_split_modules names "
                        f"{replaced.name}, which {who(replaced)} replaces: accelerate matches class names, so "
                        f"device_map='auto' may split {new} across devices. Name the replacement class "
                        f"{replaced.name}, or add {new!r} to {owner}._no_split_modules.",
                        suggestion=new,
                    )
                )
    return findings
