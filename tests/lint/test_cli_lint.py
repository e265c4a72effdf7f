"""``modelpatch lint`` through a real subprocess: exit codes, text and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pytest_modelpatch.lint.scan_index import load_index


@pytest.fixture(scope="module", autouse=True)
def built_index() -> None:
    load_index()  # build once here, so each subprocess only reads the cache


def modelpatch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_modelpatch", *args], capture_output=True, text=True)


def test_broad_key_on_bert_fails_with_readable_findings() -> None:
    result = modelpatch("lint", ".*Attention", "--family", "bert")
    assert result.returncode == 1, result.stderr
    assert "FAIL [CONTAINER] pattern '.*Attention' replaces BertAttention" in result.stdout
    assert (
        "FAIL [NOT_A_MODULE] pattern '.*Attention' replaces BaseModelOutputWithPastAndCrossAttentions" in result.stdout
    )
    assert result.stdout.rstrip().splitlines()[-1].startswith("5 findings, 4 failing, for 1 keys in bert")


def test_anchored_key_passes_and_json_lists_matches() -> None:
    result = modelpatch("lint", ".*SelfAttention$", "--family", "bert", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["failing"] == 0
    assert report["matches"] == {".*SelfAttention$": ["BertSelfAttention"]}
    assert [f["kind"] for f in report["findings"]] == ["BROAD"]


def test_json_marks_failing_findings_for_ci() -> None:
    result = modelpatch("lint", "NoSuchClass", "(", "--json")
    assert result.returncode == 1
    findings = json.loads(result.stdout)["findings"]
    assert [(f["kind"], f["key"], f["failing"]) for f in findings] == [
        ("NO_MATCH", "NoSuchClass", True),
        ("INVALID_REGEX", "(", True),
    ]


def test_allowed_kinds_do_not_fail() -> None:
    result = modelpatch("lint", ".*Attention", "--family", "bert", "--allow", ".*Attention=CONTAINER,NOT_A_MODULE")
    assert result.returncode == 0, result.stdout
    assert "note [CONTAINER]" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["lint", "X", "--family", "bret"], "unknown model family 'bret'"),
        (["lint", "X", "--allow", "X"], "expected PATTERN=KIND"),
        (["lint", "X", "--allow", "Y=CONTAINER"], "not in the mapping"),
        (["lint", "X", "--allow", "X=CONTAINR"], "finding kinds"),
        (["lint"], "give PATTERN arguments or --mapping MODULE:NAME"),
        (["lint", "--mapping", "fixtures.patches.llama_fused_qkv"], "expected MODULE:NAME"),
        (["lint", "--mapping", "fixtures.patches.llama_fused_qkv:MAPING"], "has no 'MAPING'"),
        (["lint", "X", "--check", "weight"], "unknown lint checks ['weight']"),
        ([], "the following arguments are required"),
    ],
)
def test_wrong_use_exits_2_with_the_reason(args: list[str], message: str) -> None:
    result = modelpatch(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_importing_the_cli_imports_neither_torch_nor_transformers() -> None:
    code = "import sys, pytest_modelpatch.cli; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_lint_with_a_warm_cache_imports_neither_torch_nor_transformers_nor_pytest() -> None:
    # pytest alone is a third of a warm lint's time; only a usage error needs it.
    code = (
        "import sys; from pytest_modelpatch.cli import main; rc = main(['lint', 'LlamaAttention']); "
        "print(rc, any(m in sys.modules for m in ('torch', 'transformers', 'pytest')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "0 False"


def test_contract_of_a_mapping_from_the_command_line() -> None:
    fused = ["lint", "--family", "llama", "--mapping", "fixtures.patches.llama_fused_qkv:MAPPING"]
    result = modelpatch(*fused, "--check", "weights,plan")  # CONVERSIONS beside MAPPING is used
    assert result.returncode == 0, result.stdout + result.stderr
    assert "note [PARALLEL_PLAN]" in result.stdout and "'layers.*.self_attn.q_proj': 'colwise'" in result.stdout
    result = modelpatch(*fused, "--check", "weights", "--conversions", "fixtures.patches.qwen3_moe_router:CONVERSIONS")
    assert result.returncode == 1
    assert "FAIL [WEIGHT_NAMES]" in result.stdout and "No conversion is registered for 'llama'" in result.stdout
