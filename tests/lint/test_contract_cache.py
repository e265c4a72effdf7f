"""The contract facts cache: a warm lint reads what transformers' sources and the original model say from
JSON, and a stale or corrupt entry is rebuilt, never trusted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.patches import llama_fused_qkv
from pytest_modelpatch.lint.contract import cache as contract_cache
from pytest_modelpatch.lint.contract import reading as contract_source
from pytest_modelpatch.lint.model_structures import meta_structures
from pytest_modelpatch.lint.patterns import Finding, lint_patterns
from pytest_modelpatch.lint.scan_index import ScanIndex, load_index

MODELING_LLAMA = "transformers.models.llama.modeling_llama"


@pytest.fixture
def index() -> ScanIndex:
    return load_index()  # the session's warm index, loaded before the cache folder moves


@pytest.fixture
def facts_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: ScanIndex) -> Iterator[Path]:
    monkeypatch.setenv("MODELPATCH_CACHE_DIR", str(tmp_path))
    fresh_process()
    yield contract_cache.facts_path()
    fresh_process()


def fresh_process() -> None:
    """Forget what this process read, as a new ``modelpatch lint`` would."""
    contract_cache.forget()
    contract_source.module_facts.cache_clear()


def fused_qkv(index: ScanIndex, structures: Any = meta_structures) -> list[Finding]:
    return lint_patterns(llama_fused_qkv.MAPPING, families=["llama"], index=index, structures=structures)


def no_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(module: str) -> Any:
        raise AssertionError(f"parsed {module}: the warm cache should have answered")

    monkeypatch.setattr(contract_source, "read_module", refuse)


def test_a_warm_lint_reads_the_facts_instead_of_parsing_sources(
    facts_file: Path, index: ScanIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = fused_qkv(index)
    data = json.loads(facts_file.read_text())
    assert MODELING_LLAMA in data["sections"]["modules"] and "llama" in data["sections"]["originals"]
    fresh_process()
    no_parsing(monkeypatch)
    built: list[bool] = []

    def patched_only(model_type: str, swaps: Any, *, original: bool = True) -> Any:
        built.append(original)
        return meta_structures(model_type, swaps, original=original)

    assert fused_qkv(index, patched_only) == cold
    assert built == [False]  # the original came from the cache; only the replacement side was built
    assert {str(f.kind) for f in cold} >= {"WEIGHT_NAMES", "PARALLEL_PLAN"}


def test_a_corrupt_entry_is_rebuilt_not_trusted(facts_file: Path, index: ScanIndex) -> None:
    cold = fused_qkv(index)
    data = json.loads(facts_file.read_text())
    data["sections"]["modules"][MODELING_LLAMA] = {"params": 3}
    data["sections"]["originals"]["llama"]["tensors"] = ["not", "a", "mapping"]
    facts_file.write_text(json.dumps(data))
    fresh_process()
    assert fused_qkv(index) == cold
    rewritten = json.loads(facts_file.read_text())["sections"]
    assert contract_source.ModuleFacts.from_json(rewritten["modules"][MODELING_LLAMA]).calls.constructions
    assert "layers.0.self_attn.q_proj.weight" in rewritten["originals"]["llama"]["tensors"]


def test_a_file_of_another_transformers_or_format_is_ignored_and_replaced(facts_file: Path, index: ScanIndex) -> None:
    cold = fused_qkv(index)
    data = json.loads(facts_file.read_text())
    true_module = data["sections"]["modules"][MODELING_LLAMA]
    stale_module = {**true_module, "no_split": {"LlamaPreTrainedModel": ["StaleLayer"]}}
    for stamp in ({"transformers": "0.0.1"}, {"format": [0, 0]}):
        facts_file.write_text(json.dumps({**data, **stamp, "sections": {"modules": {MODELING_LLAMA: stale_module}}}))
        fresh_process()
        assert fused_qkv(index) == cold
        rewritten = json.loads(facts_file.read_text())
        assert rewritten["transformers"] == data["transformers"] and rewritten["format"] == data["format"]
        assert rewritten["sections"]["modules"][MODELING_LLAMA] == true_module


def test_an_unreadable_file_is_rebuilt(facts_file: Path, index: ScanIndex) -> None:
    cold = fused_qkv(index)
    facts_file.write_text("{ not json")
    fresh_process()
    assert fused_qkv(index) == cold
    assert json.loads(facts_file.read_text())["sections"]["modules"]
