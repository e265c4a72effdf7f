"""The pattern lint against the installed transformers: findings, and their agreement
with what ``apply_patches`` swaps and with real module trees."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.families.catalog import model_class_for, tiny_config
from pytest_modelpatch.lint.patterns import (
    FAILING_KINDS,
    Kind,
    failing_findings,
    lint_for_registration,
    lint_patterns,
    matched_classes,
    suggest,
)
from pytest_modelpatch.lint.scan_index import INDEX_FORMAT, ScanIndex, _read, changed_packages, index_path, load_index

FAMILIES = ["bert", "llama", "t5", "gpt2", "qwen2_moe", "mixtral", "vit", "clip"]


class Replacement(nn.Module):
    pass


@pytest.fixture(scope="module")
def index() -> ScanIndex:
    return load_index()


def kinds(findings: list) -> Counter:
    return Counter(str(f.kind) for f in findings)


# -- what the pattern lint finds ---------------------------------------------
def test_broad_attention_key_on_bert_flags_the_container_and_model_outputs(index: ScanIndex) -> None:
    findings = lint_patterns({".*Attention": Replacement}, families=["bert"], index=index, structures=None)
    container = [f for f in findings if f.kind is Kind.CONTAINER]
    assert [f.class_name for f in container] == ["BertAttention"]
    assert set(container[0].contains) == {"BertSelfAttention", "BertCrossAttention"}
    assert container[0].loses == ("BertSelfOutput",)
    assert container[0].family == "bert" and container[0].module == "transformers.models.bert.modeling_bert"
    outputs = {f.class_name for f in findings if f.kind is Kind.NOT_A_MODULE}
    assert "BaseModelOutputWithPastAndCrossAttentions" in outputs
    assert all(f.suggestion == ".*SelfAttention$" for f in container)
    assert str(container[0]).startswith(
        "[CONTAINER] pattern '.*Attention' replaces BertAttention (bert, transformers.models.bert.modeling_bert), "
        "which contains BertCrossAttention (also replaced), BertSelfAttention (also replaced): "
        "the model will lose BertSelfOutput. Anchor the pattern, e.g. '.*SelfAttention$'."
    )


def test_anchored_self_attention_has_no_failing_finding_for_bert(index: ScanIndex) -> None:
    findings = lint_patterns([".*SelfAttention$"], families=["bert"], index=index)
    assert failing_findings(findings) == []
    assert kinds(findings) == Counter({"BROAD": 1})  # other families have SelfAttention classes too


def test_exact_llama_attention_is_clean(index: ScanIndex) -> None:
    assert lint_patterns(["LlamaAttention"], index=index) == []
    (broad,) = lint_patterns(["LlamaAttention"], families=["llama"], index=index)
    # transformers also re.search-es exact keys: "LlamaAttention" swaps DiffLlamaAttention too.
    assert broad.kind is Kind.BROAD and "DiffLlamaAttention in diffllama" in broad.message


def test_key_for_a_missing_class_is_no_match_with_near_names(index: ScanIndex) -> None:
    (finding,) = lint_patterns(["LlamaAtention"], index=index)
    assert finding.kind is Kind.NO_MATCH
    assert "'LlamaAttention'" in str(finding)


def test_key_matching_only_outside_the_families_is_no_match_there(index: ScanIndex) -> None:
    (finding,) = lint_patterns(["LlamaAttention"], families=["bert"], index=index)
    assert finding.kind is Kind.NO_MATCH
    assert "it matches 2 elsewhere, e.g. DiffLlamaAttention, LlamaAttention" in finding.message


def test_unparsable_key_is_invalid_regex(index: ScanIndex) -> None:
    (finding,) = lint_patterns(["("], index=index)
    assert finding.kind is Kind.INVALID_REGEX
    assert finding.kind in FAILING_KINDS


def test_later_pattern_whose_matches_are_all_taken_is_shadowed(index: ScanIndex) -> None:
    findings = lint_patterns([".*SelfAttention$", "BertSelfAttention"], families=["bert"], index=index)
    # Exact names win over patterns, whatever the order.
    assert kinds(findings) == Counter({"SHADOWED": 1})
    shadowed = [f for f in findings if f.kind is Kind.SHADOWED]
    assert shadowed[0].key == ".*SelfAttention$"


def test_container_replaced_by_another_key_is_named(index: ScanIndex) -> None:
    findings = lint_patterns(["LlamaDecoderLayer", "LlamaMLP"], families=["llama"], index=index)
    (finding,) = [f for f in findings if f.kind is Kind.CONTAINER]
    assert finding.class_name == "LlamaDecoderLayer"
    assert "LlamaMLP (also replaced by 'LlamaMLP')" in str(finding)
    assert "LlamaAttention" in finding.loses


def test_unknown_family_is_a_usage_error_with_suggestions(index: ScanIndex) -> None:
    with pytest.raises(PatchUsageError, match="did you mean 'bert'"):
        lint_patterns(["X"], families=["bret"], index=index)


def test_model_type_spelling_of_a_family_is_accepted(index: ScanIndex) -> None:
    assert matched_classes(["XLMRobertaSelfAttention"], families=["xlm-roberta"], index=index)[
        "XLMRobertaSelfAttention"
    ]


def test_suggest_picks_the_tail_that_matches_only_clean_classes() -> None:
    names = ["BertAttention", "BertSelfAttention", "BertCrossAttention", "BertSelfOutput"]
    assert suggest({"BertSelfAttention", "BertCrossAttention"}, names) == ".*SelfAttention$"
    assert suggest(set(), names) == ""


# -- registration ----------------------------------------------------------------
def test_registration_lint_raises_with_the_opt_out_spelling() -> None:
    with pytest.raises(PatchUsageError) as raised:
        lint_for_registration({".*Attention": Replacement}, families=["bert"])
    message = str(raised.value)
    assert "BertAttention" in message and "allow={'.*Attention': ['" in message


def test_registration_lint_passes_when_every_failing_kind_is_allowed() -> None:
    lint_for_registration(
        {".*Attention": Replacement}, families=["bert"], allow={".*Attention": ["CONTAINER", "NOT_A_MODULE"]}
    )


def test_registration_lint_rejects_allow_for_a_key_not_in_the_mapping() -> None:
    with pytest.raises(PatchUsageError, match="not in the mapping"):
        lint_for_registration({"LlamaAttention": Replacement}, allow={".*Attention": ["CONTAINER"]})


# -- agreement with transformers ---------------------------------------------------
_SWAPPED_BY_APPLY_PATCHES = """
import importlib, json, sys
from torch import nn
from transformers import monkey_patching
from transformers.utils.import_utils import _LazyModule

keys = json.loads(sys.argv[1])
for family in ("bert", "llama", "t5", "qwen2_moe"):
    importlib.import_module(f"transformers.models.{family}.modeling_{family}")
mapping = {key: type(f"Replacement{i}", (nn.Module,), {}) for i, key in enumerate(keys)}
replacements = set(mapping.values())
monkey_patching.register_patch_mapping(mapping)
# apply_patches walks the modules loaded when it starts; getattr on lazy
# packages during the walk may import more, which it does not swap.
loaded = set(sys.modules)
found = {}
with monkey_patching.apply_patches():
    for name, module in list(sys.modules.items()):
        if name in loaded and module is not None and not isinstance(module, _LazyModule) and name.startswith("transformers"):
            found[name] = sorted(a for a, v in vars(module).items() if any(v is r for r in replacements))
print(json.dumps(found))
"""


def _swapped_by_apply_patches(keys: list[str]) -> dict[str, set[str]]:
    """Module -> attributes transformers' own apply_patches swaps, in a fresh interpreter.

    A fresh process fixes which modules are loaded, so the comparison does not depend on
    what earlier tests in this worker happened to import.
    """
    result = subprocess.run(
        [sys.executable, "-c", _SWAPPED_BY_APPLY_PATCHES, json.dumps(keys)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {module: set(attrs) for module, attrs in json.loads(result.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("keys", [[".*Attention", ".*MLP"], [".*Layer"], ["LlamaAttention", ".*Experts$"]])
def test_matches_agree_with_what_apply_patches_swaps(index: ScanIndex, keys: list[str]) -> None:
    swapped = _swapped_by_apply_patches(keys)
    matched = matched_classes(keys, index=index)
    compared = 0
    for module, attrs in swapped.items():
        if module not in index.modules:
            continue
        expected = {name for names in matched.values() for name, modules in names.items() if module in modules}
        assert attrs == expected, module
        compared += bool(expected)
    assert compared >= 4


@pytest.mark.parametrize("family", FAMILIES)
def test_index_binds_the_classes_the_imported_module_binds(index: ScanIndex, family: str) -> None:
    name = f"transformers.models.{family}.modeling_{family}"
    module = importlib.import_module(name)
    runtime = {a: f"{v.__module__}.{v.__qualname__}" for a, v in vars(module).items() if isinstance(v, type)}
    scanned = {a: f"{index.classes[i].module}.{index.classes[i].name}" for a, i in index.modules[name][1].items()}
    assert scanned == runtime


_IMPORTED_CLASSES = """
import importlib, json, sys
from torch import nn
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import ModelOutput
from transformers.utils.import_utils import _LazyModule
import transformers.generation, transformers.modeling_utils

for family in json.loads(sys.argv[1]):
    importlib.import_module(f"transformers.models.{family}.modeling_{family}")
found = {}
for name, module in list(sys.modules.items()):
    if name.startswith("transformers") and module is not None and not isinstance(module, _LazyModule):
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and (value.__module__.startswith("transformers") or issubclass(value, nn.Module)):
                kind = next((k for k, base in (("module", nn.Module), ("output", ModelOutput), ("config", PreTrainedConfig))
                             if issubclass(value, base)), "class")
                found.setdefault(name, {})[attr] = [value.__module__, value.__qualname__, kind]
print(json.dumps(found))
"""


def test_index_agrees_with_every_class_the_imported_library_binds(index: ScanIndex) -> None:
    """The index is read from source; importing the core and some families must bind the
    same transformers classes and module classes, with the same natures."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTED_CLASSES, json.dumps(FAMILIES)], capture_output=True, text=True, check=True
    )
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    wrong, checked = [], 0
    for module, names in imported.items():
        if module not in index.modules:
            # Loaded by run-time machinery (a lazy package's __getattr__, a call), not
            # by an import at module level: allowed, as long as no module class hides there.
            assert all(kind != "module" for _, _, kind in names.values()), module
            continue
        scanned = index.modules[module][1]
        for attr, (defined_in, qualname, kind) in names.items():
            entry = index.classes[scanned[attr]] if attr in scanned else None
            if entry is None or (entry.module, entry.name, entry.kind) != (defined_in, qualname, kind):
                wrong.append((module, attr, defined_in, qualname, kind, entry))
            checked += 1
    assert checked > 1000
    assert not wrong, wrong[:20]


def _reachable(index: ScanIndex, cls: int) -> set[str]:
    seen: set[int] = set()
    stack = [cls]
    while stack:
        for _, child in index.children.get(stack.pop(), []):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return {index.classes[i].name for i in seen}


def _named_in_transformers(cls: type) -> bool:
    # Activations come from ACT2FN[...], a dict of classes: no module attribute is looked
    # up, so apply_patches cannot redirect them and the index has no edge for them.
    return cls.__module__.startswith("transformers") and cls.__module__ != "transformers.activations"


def _meta_model(family: str) -> nn.Module:
    config = tiny_config(family)
    with torch.device("meta"):
        return model_class_for(config)(config)


def _class_index(index: ScanIndex, cls: type) -> int | None:
    names = index.modules.get(cls.__module__, ("", {}))[1]
    return names.get(cls.__name__)


@pytest.mark.parametrize("family", FAMILIES)
def test_containment_covers_the_real_module_tree(index: ScanIndex, family: str) -> None:
    model = _meta_model(family)
    checked = 0
    for module in model.modules():
        cls = _class_index(index, type(module))
        if cls is None:
            continue
        real = {type(m).__name__ for m in module.modules() if m is not module and _named_in_transformers(type(m))}
        assert real - {index.classes[cls].name} <= _reachable(index, cls), type(module).__name__
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize(
    ("family", "key"),
    [
        ("bert", ".*Attention"),
        ("llama", ".*Layer|.*MLP"),
        ("t5", ".*Layer"),
        ("qwen2_moe", ".*MoeSparseMoeBlock|.*Experts"),
        ("clip", ".*Layer|.*MLP"),
    ],
)
def test_container_findings_hold_in_real_trees(index: ScanIndex, family: str, key: str) -> None:
    model = _meta_model(family)
    seen = {type(m).__name__: m for m in model.modules()}
    containers = [f for f in lint_patterns([key], families=[family], index=index) if f.kind is Kind.CONTAINER]
    in_tree = [f for f in containers if f.class_name in seen]
    assert in_tree, [f.class_name for f in containers]
    for finding in in_tree:
        inside = {type(m).__name__ for m in seen[finding.class_name].modules()}
        assert inside & set(finding.contains), finding


def test_broad_keys_across_all_families_are_counted(index: ScanIndex) -> None:
    counts = {key: kinds(lint_patterns([key], index=index)) for key in (".*Attention", ".*MLP", ".*Experts", ".*Layer")}
    for key, count in counts.items():
        print(f"{key:14} {dict(count)}")
    assert counts[".*Attention"]["CONTAINER"] > 50 and counts[".*Attention"]["NOT_A_MODULE"] > 0
    assert counts[".*Layer"]["CONTAINER"] > 50


# -- the cache ---------------------------------------------------------------------
def test_cache_location_follows_the_environment_and_the_installed_versions(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MODELPATCH_CACHE_DIR", str(tmp_path))
    path = index_path()
    assert path.parent == tmp_path
    assert "transformers-5." in path.name or "transformers-" in path.name


def test_index_of_another_format_is_not_read(tmp_path: Path) -> None:
    stale = tmp_path / "index.json"
    stale.write_text(f'{{"format": {INDEX_FORMAT + 1}}}')
    assert _read(stale) is None
    stale.write_text("{not json")
    assert _read(stale) is None


def test_the_index_records_the_packages_it_read_and_names_those_installed_differently_now(index: ScanIndex) -> None:
    from importlib import metadata

    # accelerate's classes are in the index (transformers imports them when it is installed)
    assert index.packages["accelerate"] == ["accelerate", metadata.version("accelerate")]
    assert index.packages["torch"] == ["torch", metadata.version("torch")]
    absent = [top for top, recorded in index.packages.items() if recorded is None]
    assert absent and "json" not in index.packages  # optional packages probed; the standard library is not listed
    assert changed_packages(index.packages) == []
    upgraded = {**index.packages, "accelerate": ["accelerate", "0.0.1"]}
    installed_since = {**index.packages, "accelerate": None}
    removed_since = {**index.packages, "not_a_package_here": ["not-a-package-here", "1.0"]}
    assert changed_packages(upgraded) == ["accelerate"]
    assert changed_packages(installed_since) == ["accelerate"]
    assert changed_packages(removed_since) == ["not_a_package_here"]


def test_an_index_built_beside_other_packages_is_rebuilt(index: ScanIndex, monkeypatch, tmp_path: Path) -> None:
    import json

    data = _read(index_path())
    assert data is not None
    monkeypatch.setenv("MODELPATCH_CACHE_DIR", str(tmp_path))
    path = index_path()
    path.write_text(json.dumps(data))
    assert load_index().packages == data["packages"]  # current: read as it is, not rebuilt
    assert json.loads(path.read_text()) == data
    # as if built before accelerate was installed: its classes missing, its arm not taken
    data["packages"]["accelerate"] = None
    data["classes"] = [row for row in data["classes"] if not row[1].startswith("accelerate")]
    path.write_text(json.dumps(data))
    monkeypatch.setattr("pytest_modelpatch.lint.scan_index._LOADED", {})
    rebuilt = load_index()
    assert rebuilt.packages["accelerate"] is not None
    assert any(c.module.startswith("accelerate") for c in rebuilt.classes)
    assert json.loads(path.read_text())["packages"]["accelerate"] is not None
