"""Lint what a replacement class does to the built model: its weights and its parallel plans.

- ``WEIGHT_NAMES``: parameter and buffer names and shapes of the family's tiny model with and
  without the replacement, after the registered conversions rename the original's names.
- ``PARALLEL_PLAN`` (a warning): TP/PP plan entries that no longer resolve in the patched model.

Both compare the two :class:`~.contract.Structure` objects that ``pytest_modelpatch.lint.model_structures``
builds on the meta device; the source-level findings are in :mod:`.contract`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_modelpatch.lint.contract.cache import facts_cache
from pytest_modelpatch.lint.contract.sources import BuiltStructure, Replaced, Structure, StructureBuilder, finding, who
from pytest_modelpatch.lint.findings import Finding, Kind


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
        return cls(
            {n: tuple(s) for n, s in structure.tensors.items()},
            dict(structure.modules),
            dict(structure.tp_plan),
            dict(structure.pp_plan),
            tuple(checkpoint),
            tuple(_renamed_all(checkpoint, builtin)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "tensors": {n: list(s) for n, s in self.tensors.items()},
            "modules": dict(self.modules),
            "tp_plan": dict(self.tp_plan),
            "pp_plan": dict(self.pp_plan),
            "checkpoint": list(self.checkpoint),
            "loaded": list(self.loaded),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OriginalModel:
        tensors = {str(n): tuple(int(d) for d in s) for n, s in data["tensors"].items()}
        modules = {str(n): str(c) for n, c in data["modules"].items()}
        return cls(
            tensors,
            modules,
            dict(data["tp_plan"]),
            dict(data["pp_plan"]),
            tuple(map(str, data["checkpoint"])),
            tuple(map(str, data["loaded"])),
        )


def original_model(model_type: str, structures: StructureBuilder) -> OriginalModel | None:
    """The family's original tiny model: from the facts cache, else built and cached; None if it cannot be built here."""
    facts = facts_cache()
    original = facts.lookup("originals", model_type, OriginalModel.from_json)
    if original is None:
        try:
            built, _ = structures(model_type, {}, original=True)
        except Exception:  # noqa: BLE001 - a family without a tiny config or a base class here (docs/families.md)
            return None
        assert built is not None
        original = OriginalModel.of(model_type, built)
        facts.put("originals", model_type, original.to_json())
    return original


def weight_findings(
    replaced: list[Replaced],
    model_type: str,
    original: OriginalModel,
    patched: BuiltStructure,
    conversions: list[Any] | None,
) -> list[Finding]:
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
        n for n, p in wild.items() if not any(p.fullmatch(t) for t in patched.tensors)
    )
    missing = sorted(n for n in patched.tensors if n not in exact and not any(p.fullmatch(n) for p in wild.values()))
    reshaped = sorted(
        n
        for n, shape in patched.tensors.items()
        if n in exact and n in original.tensors and tuple(original.tensors[n]) != tuple(shape)
    )
    if not (unexpected or missing or reshaped):
        return []
    owners = (
        _owners(replaced, original, [*unexpected, *reshaped]) or _owners(replaced, patched, missing) or replaced[:1]
    )
    registered = ", ".join(_describe(t) for t in conversions or [])
    covered = (
        f"The registered conversions for {model_type!r} ({registered}) do not produce these names."
        if conversions
        else f"No conversion is registered for {model_type!r}."
    )
    parts = []
    if missing:
        parts.append(f"missing keys (initialised randomly at load): {_short(missing)}")
    if unexpected:
        parts.append(f"unexpected keys (in the checkpoint, ignored): {_short(unexpected)}")
    if reshaped:
        parts.append(
            "different shapes: "
            + _short([f"{n} {tuple(original.tensors[n])} -> {tuple(patched.tensors[n])}" for n in reshaped])
        )
    fix = suggest_conversion(unexpected, missing)
    advice = (
        f" Register one with the patch, e.g. conversions={{{model_type!r}: [{fix}]}}."
        if fix
        else " Keep the original's parameter names and shapes, or register a conversion for them."
    )
    return [
        Finding(
            Kind.WEIGHT_NAMES,
            r.key,
            r.name,
            r.family,
            r.module,
            f"{who(r)}: loading a {model_type} checkpoint would report {'; '.join(parts)}. {covered}{advice}",
            fix,
        )
        for r in owners
    ]


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
    if name.startswith(prefix) and present(name[len(prefix) :]):
        return name[len(prefix) :]
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
    old = sorted({leaf for n in unexpected if (leaf := _leaf(n)) is not None})
    new = sorted({leaf for n in missing if (leaf := _leaf(n)) is not None})
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
                    findings.append(
                        finding(
                            Kind.PARALLEL_PLAN,
                            r,
                            f"{who(r)}: the config's {plan_name} entry {entry!r}: {plan[entry]!r} no longer resolves in "
                            f"the patched model{hint}, so tensor/pipeline-parallel loading will not shard it. Give the "
                            f"replacement a _tp_plan for its own submodules (or a matching {plan_name} entry), or keep "
                            f"the original names through a conversion back; plan its modules with "
                            f"@pytest.mark.patch(tp_plan={{{entry!r}: None, ...}}) and prove it sharded with "
                            f"@pytest.mark.parallel('tp')",
                            suggestion=entry,
                        )
                    )
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
