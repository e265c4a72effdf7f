"""Lint patch-mapping keys the way transformers will match them.

transformers (``monkey_patching._find_replacement_class``) looks a class name up as an
exact key first, then tries every key in mapping order with ``re.search``;
``apply_patches`` does that for every attribute of every loaded ``transformers*``
module and swaps each class it finds. A broad key such as ``".*Attention"`` therefore
also swaps containers (``BertAttention`` holds ``BertSelfAttention``) and ModelOutput
dataclasses. ``lint_patterns`` reports those against the installed transformers,
using the cached scan index (:mod:`pytest_modelpatch.lint.scan_index`).
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any

from pytest_modelpatch.lint.contract import sources as contract
from pytest_modelpatch.lint.contract import structures as contract_structures
from pytest_modelpatch.lint.contract.cache import facts_cache
from pytest_modelpatch.lint.contract.sources import Replaced, StructureBuilder
from pytest_modelpatch.lint.findings import _EXAMPLES, FAILING_KINDS, WARNING_KINDS, Finding, Kind
from pytest_modelpatch.lint.model_structures import meta_structures
from pytest_modelpatch.lint.scan_index import CORE, ClassEntry, ScanIndex, load_index

CHECKS = ("names", "signature", "weights", "plan")


def lint_patterns(
    mapping_or_keys: Mapping[str, object] | Iterable[str] | str,
    *,
    families: Iterable[str] | None = None,
    conversions: Mapping[str, list[Any]] | None = None,
    checks: Iterable[str] | None = None,
    structures: StructureBuilder | None = meta_structures,
    index: ScanIndex | None = None,
) -> list[Finding]:
    """Findings for each key, matched exactly as transformers matches them, with every check by default.

    The patch marker, ``modelpatch lint`` and this function give the same findings for the same input.
    ``families`` (model types or folder names such as ``"bert"``) limits the classes
    considered to those the families' modules bind; matches elsewhere become ``BROAD``.
    When the mapping's values are classes and a family is in scope, the contract checks run
    too (``checks``, default all of ``CHECKS``): ``SIGNATURE``/``UNUSED_ARGUMENT`` and the
    ``_no_split_modules`` part of ``PARALLEL_PLAN`` from the sources; ``WEIGHT_NAMES`` and the
    TP/PP plans from the family's tiny model that ``structures`` builds (on the meta device, once
    per family and replacement, cached as the patch marker's are; ``None``: no model is built).
    ``conversions`` takes the patch marker's form, ``{model_type: [WeightConverter, ...]}``.

    Example::

        for finding in lint_patterns({".*Attention": MyAttention}, families=["bert"]):
            print(finding)  # [CONTAINER] pattern '.*Attention' replaces BertAttention ...

        lint_patterns({"LlamaAttention": LlamaFusedQKVAttention}, families=["llama"])
        # [WEIGHT_NAMES] ... missing keys ... qkv_proj ...; [PARALLEL_PLAN] layers.*.self_attn.q_proj ...
    """
    keys = [mapping_or_keys] if isinstance(mapping_or_keys, str) else list(mapping_or_keys)
    wanted = _checks(checks)
    index = index or load_index()
    scope = resolve_families(index, families)
    lint = _Lint(index, keys, scope)
    findings = lint.run() if "names" in wanted else []
    if scope is not None and isinstance(mapping_or_keys, Mapping):
        classes = {k: v for k, v in mapping_or_keys.items() if isinstance(v, type)}
        try:
            findings += lint.contract(classes, dict(conversions or {}), wanted, structures)
        finally:
            facts_cache().flush()  # what this lint read from sources or built, for the next run
    return findings


def _checks(checks: Iterable[str] | str | None) -> set[str]:
    if checks is None:
        return set(CHECKS)
    wanted = {c.strip().lower() for c in ([checks] if isinstance(checks, str) else checks)}
    if wanted - set(CHECKS):
        raise _usage_error(f"unknown lint checks {sorted(wanted - set(CHECKS))}; choose from {', '.join(CHECKS)}")
    return wanted


def matched_classes(
    mapping_or_keys: Mapping[str, object] | Iterable[str] | str,
    *,
    families: Iterable[str] | None = None,
    index: ScanIndex | None = None,
) -> dict[str, dict[str, list[str]]]:
    """For each key, the class names it would replace and the modules binding each.

    Example: ``matched_classes([".*SelfAttention$"], families=["bert"])`` gives
    ``{".*SelfAttention$": {"BertSelfAttention": ["transformers.models.bert.modeling_bert"]}}``.
    """
    keys = [mapping_or_keys] if isinstance(mapping_or_keys, str) else list(mapping_or_keys)
    index = index or load_index()
    lint = _Lint(index, keys, resolve_families(index, families))
    return {
        key: {
            n: sorted(m for ms in lint.inside[n].values() for m in ms)
            for n in lint.candidates(key, lint.inside)
            if lint.winner(n) == key
        }
        for key in keys
    }


def failing_findings(findings: Iterable[Finding], allow: Mapping[str, Iterable[str]] | None = None) -> list[Finding]:
    """The findings of a failing kind that ``allow`` (``{key: ["CONTAINER", ...]}``) does not excuse.

    Example: ``failing_findings(findings, allow={".*Attention": ["CONTAINER"]})``.
    """
    allowed = {key: {str(k).upper() for k in kinds} for key, kinds in (allow or {}).items()}
    return [f for f in findings if f.kind in FAILING_KINDS and str(f.kind) not in allowed.get(f.key, set())]


REGISTRATION_CHECKS = ("names", "signature", "weights")


def lint_for_registration(
    mapping: Mapping[str, object],
    *,
    families: Iterable[str] | None = None,
    allow: Mapping[str, Iterable[str]] | None = None,
    conversions: Mapping[str, list[Any]] | None = None,
    structures: StructureBuilder | None = None,
    checks: Iterable[str] = REGISTRATION_CHECKS,
) -> None:
    """Raise PatchUsageError listing the failing findings of a mapping about to be registered.

    Warning kinds (``UNUSED_ARGUMENT``) not excused by ``allow`` are warned as ModelPatchWarning.
    ``PARALLEL_PLAN`` is not in the default ``checks``: a single-device suite cannot act on it,
    and a good patch (fused QKV) may break the plan on purpose; ``modelpatch lint`` reports it.

    Example: ``lint_for_registration({"LlamaAttention": MyAttention}, families=["llama"])``.
    """
    _check_allow(mapping, allow)
    findings = lint_patterns(mapping, families=families, conversions=conversions, checks=checks, structures=structures)
    bad = failing_findings(findings, allow)
    if not bad:
        _warn(findings, allow)
        return
    lines = "\n".join(f"  {finding}" for finding in bad)
    example = f"{bad[0].key!r}: [{str(bad[0].kind)!r}]"
    raise _usage_error(
        f"the patch mapping would break the model:\n{lines}\n"
        f"Fix the keys, or accept a finding per key: "
        f"@pytest.mark.patch(..., allow={{{example}}}) or patch_registry.register(..., allow={{{example}}})."
    )


def _warn(findings: list[Finding], allow: Mapping[str, Iterable[str]] | None) -> None:
    allowed = {key: {str(k).upper() for k in kinds} for key, kinds in (allow or {}).items()}
    from pytest_modelpatch.errors import ModelPatchWarning

    for finding in findings:
        if finding.kind in WARNING_KINDS and str(finding.kind) not in allowed.get(finding.key, set()):
            warnings.warn(
                f"{finding} Accept it with allow={{{finding.key!r}: [{str(finding.kind)!r}]}}.",
                ModelPatchWarning,
                stacklevel=3,
            )


def _check_allow(mapping: Mapping[str, object], allow: Mapping[str, Iterable[str]] | None) -> None:
    known = {str(k) for k in Kind}
    for key, kinds in (allow or {}).items():
        if key not in mapping:
            raise _usage_error(f"allow names key {key!r}, which is not in the mapping {sorted(mapping)}")
        wrong = sorted({str(k).upper() for k in kinds} - known)
        if isinstance(kinds, str) or wrong:
            raise _usage_error(f"allow[{key!r}] must be a list of finding kinds from {sorted(known)}, got {kinds!r}")


def resolve_families(index: ScanIndex, families: Iterable[str] | None) -> set[str] | None:
    """Family folder names for model types or folder names; PatchUsageError for unknown ones."""
    if families is None:
        return None
    if isinstance(families, str):
        families = [families]
    resolved: set[str] = set()
    known = index.families
    for family in families:
        folder = index.model_types.get(family) or family.replace("-", "_")
        if folder not in known:
            close = difflib.get_close_matches(family, sorted(known | set(index.model_types)), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise _usage_error(f"unknown model family {family!r} in the installed transformers{hint}")
        resolved.add(folder)
    return resolved


class _Lint:
    """One lint run: the winner of every class name, then findings key by key."""

    def __init__(self, index: ScanIndex, keys: list[str], scope: set[str] | None) -> None:
        self.index = index
        self.keys = keys
        self.scope = scope
        self.compiled: dict[str, re.Pattern[str] | None] = {}
        for key in keys:
            try:
                self.compiled[key] = re.compile(key)
            except re.error:
                self.compiled[key] = None  # transformers treats it as an exact name only
        self.exact = set(keys)
        # attribute name -> {class index: modules binding it}, inside and outside the scope
        self.inside: dict[str, dict[int, list[str]]] = {}
        self.outside: dict[str, dict[int, list[str]]] = {}
        for module, (family, names) in index.modules.items():
            target = self.inside if scope is None or family in scope else self.outside
            for attr, cls in names.items():
                target.setdefault(attr, {}).setdefault(cls, []).append(module)
        self._winners: dict[str, str | None] = {}

    @cached_property
    def tails(self) -> dict[str, set[str]]:
        return tail_table(self.inside)

    def winner(self, name: str) -> str | None:
        """The key transformers' ``_find_replacement_class`` picks for ``name``."""
        if name not in self._winners:
            found = name if name in self.exact else None
            if found is None:
                found = next((k for k in self.keys if (p := self.compiled[k]) is not None and p.search(name)), None)
            self._winners[name] = found
        return self._winners[name]

    def candidates(self, key: str, names: Iterable[str]) -> list[str]:
        pattern = self.compiled[key]
        return sorted(n for n in names if n == key or (pattern is not None and pattern.search(n)))

    def run(self) -> list[Finding]:
        findings: list[Finding] = []
        for key in dict.fromkeys(self.keys):
            findings += self.lint_key(key)
        return findings

    def contract(
        self,
        classes: dict[str, type],
        conversions: dict[str, list[Any]],
        checks: set[str],
        structures: StructureBuilder | None,
    ) -> list[Finding]:
        """The contract findings of the classes each key replaces in the scope."""
        scope = self.scope or set()
        modules = sorted(m for m, (family, _) in self.index.modules.items() if family in scope)
        replaced = [
            contract.Replaced(key, name, entry.module, entry.family, classes[key], tuple(bound))
            for key in classes
            for name in self.candidates(key, self.inside)
            if self.winner(name) == key
            for cls, bound in self.inside[name].items()
            if (entry := self.index.classes[cls]).is_module and entry.module.startswith("transformers")
        ]
        # the scope's original tiny models say which runs their parents make (BERT's crossattention: none)
        originals = (
            {
                family: contract_structures.original_model(self.model_type(family), structures)
                for family in sorted(scope)
            }
            if structures is not None and replaced
            else {}
        )
        models = [original.modules for original in originals.values() if original is not None]
        findings: list[Finding] = []
        for item in replaced:
            if "signature" in checks:
                findings += contract.signature_findings(item, modules, models)
            if "plan" in checks:
                findings += contract.no_split_findings(item, modules)
        if structures is None or not replaced or not checks & {"weights", "plan"}:
            return findings
        for family, original in originals.items():
            if original is not None:  # else the family's own tiny model cannot be built here: nothing to compare
                findings += self.built(family, original, replaced, conversions, checks, structures)
        return findings

    def model_type(self, family: str) -> str:
        """The model type the family's tiny model is built for: the one named like its folder, else the first."""
        return next((t for t, f in self.index.model_types.items() if f == family and t == family), None) or next(
            (t for t, f in self.index.model_types.items() if f == family), family
        )

    def built(
        self,
        family: str,
        original: contract_structures.OriginalModel,
        replaced: list[Replaced],
        conversions: dict[str, list[Any]],
        checks: set[str],
        structures: StructureBuilder,
    ) -> list[Finding]:
        model_type = self.model_type(family)
        swaps = {r.name: (r.replacement, r.bound_in) for r in replaced}
        try:
            _, patched = structures(model_type, swaps, original=False)  # built each run: the original is cached
        except Exception as error:  # noqa: BLE001 - the replacement cannot even be built: say so, with the cause
            first = replaced[0]
            return [
                Finding(
                    Kind.WEIGHT_NAMES,
                    first.key,
                    first.name,
                    first.family,
                    first.module,
                    f"building the tiny {model_type} model with {', '.join(sorted(swaps))} replaced failed: "
                    f"{type(error).__name__}: {error}. Fix the replacement's __init__ (see SIGNATURE).",
                )
            ]
        findings: list[Finding] = []
        if "weights" in checks:
            own = conversions.get(model_type)
            findings += contract_structures.weight_findings(
                replaced, model_type, original, patched, None if own is None else list(own)
            )
        if "plan" in checks:
            findings += contract_structures.plan_findings(replaced, original, patched)
        return findings

    def lint_key(self, key: str) -> list[Finding]:
        if self.compiled[key] is None:
            try:
                re.compile(key)
            except re.error as error:
                return [
                    Finding(
                        Kind.INVALID_REGEX,
                        key,
                        message=f"pattern {key!r} is not a valid regular expression "
                        f"({error}): transformers only matches it as an exact class name, and none has it.",
                    )
                ]
        matched = self.candidates(key, self.inside)
        won = [n for n in matched if self.winner(n) == key]
        if not matched:
            return [self.no_match(key)]
        if not won:
            takers = sorted({str(self.winner(n)) for n in matched})
            return [
                Finding(
                    Kind.SHADOWED,
                    key,
                    message=f"pattern {key!r} replaces nothing: every class it matches "
                    f"({_names(matched)}) is taken by {_names(takers, quote=True)}, which come first.",
                )
            ]
        findings = self.class_findings(key, won)
        if self.scope is not None:
            findings += self.broad(key)
        return findings

    def class_findings(self, key: str, won: list[str]) -> list[Finding]:
        problems: list[tuple[Kind, str, ClassEntry, int, list[str], tuple[str, ...], tuple[str, ...]]] = []
        clean: set[str] = set()
        for name in won:
            for cls, modules in self.inside[name].items():
                entry = self.index.classes[cls]
                if not entry.is_module:
                    problems.append((Kind.NOT_A_MODULE, name, entry, cls, modules, (), ()))
                    continue
                contains, loses = self.containment(cls)
                if contains:
                    problems.append((Kind.CONTAINER, name, entry, cls, modules, contains, loses))
                else:
                    clean.add(name)
        avoid = {name for _, name, *_ in problems}
        suggestion = suggest(clean - avoid, self.tails) if problems else ""
        return [self.describe(key, *problem, suggestion) for problem in problems]

    def containment(self, cls: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(replaced classes inside an instance, unreplaced transformers classes it would lose)."""
        replaced: dict[str, None] = {}
        lost: dict[str, None] = {}
        seen = {cls}
        stack = list(self.index.children.get(cls, []))
        while stack:
            attr, child = stack.pop(0)
            if child in seen:
                continue
            seen.add(child)
            if self.winner(attr) is not None:
                replaced[attr] = None
                continue
            if self.index.classes[child].module.startswith("transformers"):
                lost[attr] = None
            stack += self.index.children.get(child, [])
        return tuple(replaced), tuple(lost)

    def describe(
        self,
        key: str,
        kind: Kind,
        name: str,
        entry: ClassEntry,
        cls: int,
        modules: list[str],
        contains: tuple[str, ...],
        loses: tuple[str, ...],
        suggestion: str,
    ) -> Finding:
        where = f"{entry.family}, {entry.module}" if entry.family != CORE else entry.module
        head = f"pattern {key!r} replaces {name} ({where})"
        if kind is Kind.CONTAINER:
            others = [f"{c} (also replaced{self._by(c, key)})" for c in contains[:_EXAMPLES]]
            body = f", which contains {', '.join(others)}"
            if loses:
                body += f": the model will lose {_names(loses)}"
        else:
            what = {"output": "a ModelOutput", "config": "a configuration"}.get(entry.kind, "a class")
            body = (
                f", which is {what}, not an nn.Module: apply_patches swaps it for the patch class in {_names(modules)}"
            )
        advice = f" Anchor the pattern, e.g. {suggestion!r}." if suggestion else " Use exact class names."
        return Finding(
            kind,
            key,
            name,
            entry.family,
            entry.module,
            head + body + "." + advice,
            suggestion,
            contains,
            loses,
            tuple(modules),
        )

    def _by(self, name: str, key: str) -> str:
        taker = self.winner(name)
        return "" if taker == key else f" by {taker!r}"

    def no_match(self, key: str) -> Finding:
        elsewhere = self.candidates(key, self.outside)
        message = f"pattern {key!r} matches no class"
        if self.scope is not None:
            message += f" in {', '.join(sorted(self.scope))}"
            if elsewhere:
                message += f" (it matches {len(elsewhere)} elsewhere, e.g. {_names(elsewhere)})"
        close = difflib.get_close_matches(key, list(self.inside), n=3)
        hint = f" Did you mean {_names(close, quote=True)}?" if close else " Was the class renamed upstream?"
        return Finding(
            Kind.NO_MATCH,
            key,
            message=f"{message}: the patch would do nothing.{hint}",
            suggestion=close[0] if close else "",
        )

    def broad(self, key: str) -> list[Finding]:
        found = [n for n in self.candidates(key, self.outside) if self.winner(n) == key]
        families = sorted(
            {self.index.modules[m][0] for n in found for ms in self.outside[n].values() for m in ms} - {CORE}
        )
        if not families:
            return []
        return [
            Finding(
                Kind.BROAD,
                key,
                message=f"pattern {key!r} also replaces {len(found)} classes in "
                f"{len(families)} other families (e.g. {_names(found)} in {_names(families)}).",
            )
        ]


def suggest(targets: set[str], names: Iterable[str] | Mapping[str, set[str]]) -> str:
    """A ``.*Tail$`` key matching as many ``targets`` as possible and nothing else in ``names``.

    ``names`` may be given as a tail table (``tail_table(names)``) to reuse it.
    Example: ``suggest({"BertSelfAttention"}, ["BertAttention", "BertSelfAttention"])``
    gives ``".*SelfAttention$"``.
    """
    by_tail = names if isinstance(names, Mapping) else tail_table(names)
    best: tuple[int, int, str] | None = None
    for target in targets:
        for tail in _TAILS.findall(target):
            if not by_tail[tail] <= targets:
                continue
            score = (len(by_tail[tail]), -len(tail), tail)
            if best is None or score > best:
                best = score
    return f".*{best[2]}$" if best else ""


# Every suffix of a name that starts at a capital letter: what `.*Tail$` can match.
_TAILS = re.compile(r"(?=([A-Z][A-Za-z0-9_]*)\Z)")


def tail_table(names: Iterable[str]) -> dict[str, set[str]]:
    """Names by each capitalised suffix (``"BertSelfAttention"`` under ``"Attention"``, ...)."""
    table: dict[str, set[str]] = {}
    for name in names:
        for tail in _TAILS.findall(name):
            table.setdefault(tail, set()).add(name)
    return table


def _names(items: Iterable[str], *, quote: bool = False) -> str:
    listed = list(items)
    shown = [repr(i) if quote else i for i in listed[:_EXAMPLES]]
    more = f" and {len(listed) - _EXAMPLES} more" if len(listed) > _EXAMPLES else ""
    return ", ".join(shown) + more


def _usage_error(message: str) -> Exception:
    # Imported here: PatchUsageError is a pytest.UsageError, and the CLI's warm lint
    # should not pay for importing pytest.
    from pytest_modelpatch.errors import PatchUsageError

    return PatchUsageError(message)
