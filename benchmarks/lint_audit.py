"""The contract lint against what runs: identity patches, and classes swapped across families.

1. Identity: every transformers module class each family's modules bind, replacing itself
   (``{"^LlamaAttention$": LlamaAttention, ...}``), linted in that family with the
   ``signature``, ``weights`` and ``plan`` checks. Nothing changed, so any ``SIGNATURE``,
   ``UNUSED_ARGUMENT``, ``WEIGHT_NAMES`` or ``PARALLEL_PLAN`` finding is a false one. Over every
   family the scan index knows; a family whose modules cannot be imported here is counted apart,
   and so is one whose tiny model cannot be built here (the lint compares no weights for it).
2. Pairs: for each role that many families share (``*RMSNorm``, ``*MLP``, ``*RotaryEmbedding``,
   ``*Attention``, ``*DecoderLayer``), family A's class registered as the replacement of family
   B's under a key spanning both (``^(LlamaRMSNorm|GemmaRMSNorm)$``), for every ordered pair of
   ``COMMON`` families that have the role. The lint's ``SIGNATURE`` findings in B are judged by a
   forward and a backward of B's tiny model built with the patch swapped in where transformers'
   ``apply_patches`` swaps it: a finding is right (TP) when the run raises a ``TypeError`` binding
   a call of the replacement's ``forward``/``__init__``, wrong (FP) when the run passes; a
   binding ``TypeError`` with no finding is a miss (FN). B's config lends A's class the fields
   only A's config has (``mlp_bias``), so that more runs get as far as the calls; a run that
   still fails otherwise (a rope layout, a shape) decides nothing and is counted apart.

Prints precision and recall of ``SIGNATURE`` over the decided pairs, each wrong or missed pair
with its reason, and the time each part took. Goal: no false finding, no miss, and 0 identity
findings.

Run: OMP_NUM_THREADS=1 python benchmarks/lint_audit.py [--identity] [--pairs] [--families llama gemma ...]
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: measure this checkout's package, not whichever one is installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROLES = ("RMSNorm", "MLP", "RotaryEmbedding", "Attention", "DecoderLayer")
# common decoder families, chosen for the different ways they name and call these roles
# (x or hidden_states, a layer_type for the rotary embedding, MoE blocks, layer norms)
COMMON = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
    "olmo2", "granite", "glm4", "deepseek_v3", "cohere2", "starcoder2", "falcon", "stablelm", "exaone4", "nanochat",
)  # fmt: skip
CONTRACT_KINDS = ("SIGNATURE", "UNUSED_ARGUMENT", "WEIGHT_NAMES", "PARALLEL_PLAN")
# CPython's messages when a call does not bind: "Attn.forward() missing 1 required positional argument: 'x'"
_BINDING = re.compile(
    r"^(?P<function>[\w.<>]+)\(\) (missing \d+ required|got an unexpected keyword|takes \d+ "
    r"positional|takes from \d+ to \d+ positional|got multiple values|got some positional-only)"
)


# ---------------------------------------------------------------------------
# identity patches
# ---------------------------------------------------------------------------


@dataclass
class IdentityOutcome:
    """One family's identity patch: its contract findings, or why it was not (fully) linted."""

    family: str
    classes: int = 0
    findings: list[Any] = field(default_factory=list)
    skipped: str = ""  # its modules cannot be imported here
    sources_only: str = ""  # its tiny model cannot be built here: the lint compares no weights or plans


def identity_mapping(family: str, index: Any) -> dict[str, type]:
    """``{"^Name$": Name}`` for every transformers module class that ``family``'s modules bind."""
    mapping: dict[str, type] = {}
    for module, (folder, names) in index.modules.items():
        if folder != family:
            continue
        loaded = importlib.import_module(module)
        for name, cls in names.items():
            entry = index.classes[cls]
            if (
                entry.is_module
                and entry.module.startswith("transformers")
                and isinstance(getattr(loaded, name, None), type)
            ):
                mapping[f"^{re.escape(name)}$"] = getattr(loaded, name)
    return mapping


def identity_outcome(family: str, index: Any) -> IdentityOutcome:
    """Lint ``family``'s classes replacing themselves; only the contract kinds count."""
    from pytest_modelpatch.lint.model_structures import meta_structures
    from pytest_modelpatch.lint.patterns import lint_patterns

    outcome = IdentityOutcome(family)
    try:
        mapping = identity_mapping(family, index)
    except Exception as error:  # noqa: BLE001 - an optional dependency this machine lacks
        outcome.skipped = f"{type(error).__name__}: {_first_line(error)}"
        return outcome
    outcome.classes = len(mapping)
    if not mapping:
        return outcome
    try:
        meta_structures(_model_type(family, index), {})
    except Exception as error:  # noqa: BLE001 - the audit records why a family builds no structure
        outcome.sources_only = f"{type(error).__name__}: {_first_line(error)}"
    found = lint_patterns(
        mapping, families=[family], checks=("signature", "weights", "plan"), structures=meta_structures, index=index
    )
    outcome.findings = [f for f in found if str(f.kind) in CONTRACT_KINDS]
    return outcome


def _model_type(family: str, index: Any) -> str:
    types = [t for t, folder in index.model_types.items() if folder == family]
    return family if family in types else (types[0] if types else family)


# ---------------------------------------------------------------------------
# cross-family pairs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """Family ``source``'s class of a role registered as the replacement of ``target``'s."""

    role: str
    source: str  # model types
    target: str
    replacement: type
    replaced: str  # the target's class name

    @property
    def key(self) -> str:
        return f"^({self.replacement.__name__}|{self.replaced})$"

    def __str__(self) -> str:
        return f"{self.replacement.__name__} -> {self.replaced} ({self.source} -> {self.target})"


@dataclass
class PairOutcome:
    """The lint's SIGNATURE findings on a pair and what a forward and backward did."""

    pair: Pair
    findings: list[str]
    run: str  # "ok", "binding" (a TypeError binding a call of the replacement) or "other"
    error: str = ""

    @property
    def verdict(self) -> str:
        """TP, FP, FN, TN, or "undecided" (the run failed for another reason)."""
        if self.run == "other":
            return "undecided"
        return {(True, "binding"): "TP", (True, "ok"): "FP", (False, "binding"): "FN"}.get(
            (bool(self.findings), self.run), "TN"
        )


def role_classes(model_types: Iterable[str], roles: Iterable[str] = ROLES) -> dict[str, dict[str, type]]:
    """``{role: {model type: class}}``: the class its modeling module defines as ``<Prefix><Role>``.

    The prefix is the one the family's base model class starts with (``Gemma3`` for
    ``Gemma3TextModel``), so ``Gemma3RMSNorm`` is gemma3_text's and ``Qwen2MoeMLP`` qwen2_moe's.
    """
    from pytest_modelpatch.families.catalog import model_class_for, tiny_config

    found: dict[str, dict[str, type]] = {role: {} for role in roles}
    for model_type in model_types:
        base = model_class_for(tiny_config(model_type), "base")
        module = sys.modules[base.__module__]
        for role in found:
            named = [
                n
                for n, v in vars(module).items()
                if isinstance(v, type)
                and v.__module__ == module.__name__
                and n.endswith(role)
                and base.__name__.startswith(n[: -len(role)])
                and n != role
            ]
            if named:
                found[role][model_type] = getattr(module, max(named, key=len))
    return found


def role_pairs(model_types: Iterable[str], roles: Iterable[str] = ROLES) -> list[Pair]:
    """Every ordered pair of distinct families that both have a role's class."""
    pairs = []
    for role, classes in role_classes(list(model_types), roles).items():
        for source, replacement in classes.items():
            for target, replaced in classes.items():
                if source != target:
                    pairs.append(Pair(role, source, target, replacement, replaced.__name__))
    return pairs


def lint_pair(pair: Pair, index: Any = None) -> list[str]:
    """The SIGNATURE findings the patch marker's lint gives the pair's mapping in the target's families."""
    from pytest_modelpatch.families.catalog import tiny_config
    from pytest_modelpatch.lint.patterns import lint_patterns  # with the tiny models, as the marker lints
    from pytest_modelpatch.models.specs import config_families

    families = config_families(tiny_config(pair.target))  # as the patch marker lints a model's families
    found = lint_patterns({pair.key: pair.replacement}, families=families, checks=("signature",), index=index)
    return [str(f) for f in found if str(f.kind) == "SIGNATURE"]


def run_pair(pair: Pair) -> tuple[str, str]:
    """("ok" | "binding" | "other", the error): the target's tiny model built with the patch, forward and backward."""
    from pytest_modelpatch.families.catalog import model_class_for, tiny_config
    from pytest_modelpatch.families.inputs import example_inputs
    from pytest_modelpatch.models.checkpoints import seeded_model

    config = tiny_config(pair.target)
    cls = model_class_for(config, "base")
    lend_missing(config, tiny_config(pair.source))
    try:
        with swapped_as_apply_patches({pair.key: pair.replacement}):
            model = seeded_model(config, model_class=cls)
        outputs = model(**example_inputs(config, model_class=cls))
        outputs[0].float().sum().backward()
    except Exception as error:  # noqa: BLE001 - the audit sorts every failure of a pair
        kind = "binding" if binds_not(error, pair.replacement) else "other"
        return kind, f"{type(error).__name__}: {_first_line(error)}"
    return "ok", ""


def lend_missing(config: Any, other: Any) -> None:
    """Give ``config`` the attributes only ``other`` has (``mlp_bias`` for a Llama MLP in Gemma).

    A class of family A reads A's config fields in its ``__init__``; without them the target's
    model fails before any call is bound, and the pair decides nothing about SIGNATURE. The
    target's own fields stay as they are.
    """
    text, lent = config.get_text_config(), other.get_text_config()
    for name, value in vars(lent).items():
        if not name.startswith("_") and not hasattr(text, name):
            setattr(text, name, value)


def binds_not(error: BaseException, replacement: type) -> bool:
    """Whether ``error`` is CPython refusing a call of ``replacement``'s ``forward`` or ``__init__``."""
    match = _BINDING.match(str(error)) if isinstance(error, TypeError) else None
    own = {f"{k.__qualname__}.{m}" for k in replacement.__mro__ for m in ("forward", "__init__") if m in vars(k)}
    return match is not None and match["function"] in own


@contextmanager
def swapped_as_apply_patches(mapping: dict[str, type]) -> Iterator[None]:
    """transformers' ``register_patch_mapping`` and ``apply_patches``, for the block only.

    The ground truth does not come from the lint: transformers itself swaps the classes.
    ``apply_patches`` (5.24) restores nothing when its block raises: the plugin's isolation does.
    """
    from transformers import monkey_patching

    from pytest_modelpatch.isolation.guard import isolated_patch_state

    with isolated_patch_state():
        monkey_patching.register_patch_mapping(mapping)
        with monkey_patching.apply_patches():
            yield


def audit_pairs(pairs: list[Pair], index: Any = None) -> list[PairOutcome]:
    """Lint and run every pair."""
    return [PairOutcome(pair, lint_pair(pair, index), *run_pair(pair)) for pair in pairs]


def precision_recall(outcomes: list[PairOutcome]) -> tuple[float, float]:
    """SIGNATURE's precision and recall over the decided pairs (1.0 where nothing was found or missed)."""
    verdicts = [o.verdict for o in outcomes]
    tp, fp, fn = (verdicts.count(v) for v in ("TP", "FP", "FN"))
    return (tp / (tp + fp) if tp + fp else 1.0), (tp / (tp + fn) if tp + fn else 1.0)


# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else ""


def _took(start: tuple[float, float]) -> str:
    return f"{time.perf_counter() - start[0]:.1f} s wall, {time.process_time() - start[1]:.1f} s CPU"


def report_identity(families: list[str], index: Any, verbose: bool) -> int:
    start = time.perf_counter(), time.process_time()
    outcomes = [identity_outcome(family, index) for family in families]
    took = _took(start)
    linted = [o for o in outcomes if not o.skipped]
    findings = [f for o in linted for f in o.findings]
    print(
        f"identity: {len(findings)} contract findings over {len(linted)} families "
        f"({sum(o.classes for o in linted)} classes replacing themselves), {took}; "
        f"{sum(bool(o.sources_only) for o in linted)} of them with no tiny model here (no weights compared), "
        f"{len(outcomes) - len(linted)} not importable here"
    )
    for finding in findings:
        print(f"  {finding.family}: {finding}")
    if verbose:
        for o in outcomes:
            if o.skipped or o.sources_only:
                print(
                    f"  {o.family}: {'not importable' if o.skipped else 'no tiny model'}: {o.skipped or o.sources_only}"
                )
    return len(findings)


def report_pairs(model_types: list[str], index: Any, verbose: bool) -> int:
    start = time.perf_counter(), time.process_time()
    pairs = role_pairs(model_types)
    outcomes = audit_pairs(pairs, index)
    took = _took(start)
    precision, recall = precision_recall(outcomes)
    verdicts = [o.verdict for o in outcomes]
    counts = ", ".join(f"{v} {verdicts.count(v)}" for v in ("TP", "FP", "FN", "TN", "undecided"))
    print(f"pairs: {len(pairs)} over {len(model_types)} families and {len(ROLES)} roles, {took}")
    for role in ROLES:
        mine = [o for o in outcomes if o.pair.role == role]
        p, r = precision_recall(mine)
        mine_verdicts = [o.verdict for o in mine]
        print(
            f"  {role:16} {len(mine):4} pairs  precision {p:.3f}  recall {r:.3f}  "
            + ", ".join(f"{v} {mine_verdicts.count(v)}" for v in ("TP", "FP", "FN", "undecided"))
        )
    print(f"SIGNATURE: precision {precision:.3f}, recall {recall:.3f} ({counts})")
    for outcome in outcomes:
        if outcome.verdict in ("FP", "FN") or (verbose and outcome.verdict != "TN"):
            found = f"; lint: {outcome.findings[0][:300]}" if outcome.findings else "; lint: no finding"
            print(f"  {outcome.verdict:9} {outcome.pair}: run: {outcome.error or 'ok'}{found}")
    return verdicts.count("FP") + verdicts.count("FN")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identity", action="store_true", help="only the identity audit")
    parser.add_argument("--pairs", action="store_true", help="only the cross-family pairs")
    parser.add_argument(
        "--families",
        nargs="*",
        help="identity: these folders (default every one); pairs: these model types (default COMMON)",
    )
    parser.add_argument("--verbose", action="store_true", help="every decided finding and every undecided pair")
    args = parser.parse_args(argv)
    import torch
    from transformers.utils import logging as transformers_logging

    from pytest_modelpatch.lint.scan_index import load_index

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers_logging.set_verbosity_error()
    index = load_index()
    wrong = 0
    if not args.pairs:
        wrong += report_identity(sorted(args.families or index.families - {""}), index, args.verbose)
    if not args.identity:
        wrong += report_pairs(list(args.families or COMMON), index, args.verbose)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
