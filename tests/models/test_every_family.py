"""Every model family transformers ships, as a user tries it: ``@pytest.mark.model(t)`` plus ``assert_equivalent``.

One real pytest session (pytester) runs a test per family with the plugin's own
``reference_model``/``patched_model`` fixtures, no patch, and checks the model's size
against the budget. The families that cannot run here are listed in ``docs/families.md``
with the reason; they are strict xfails, so a family that starts working (or one that
breaks) changes the outcome. By default a representative subset runs (a few of each kind
of model); ``MODELPATCH_FAMILY_SWEEP=all`` runs every family, as CI's family-sweep step
does, and then also checks the counts ``docs/families.md`` quotes against
``benchmarks/model_coverage.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_modelpatch.models.families import available_model_types

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "families.md"
SWEEP = os.environ.get("MODELPATCH_FAMILY_SWEEP", "")
PARAMETER_BUDGET = 5_000_000

# a few of each kind: decoders, MoE, hybrids, encoders, encoder-decoders, VLMs, vision, audio, time series
REPRESENTATIVE = [
    "llama", "qwen2_moe", "mixtral", "jamba", "mamba2", "bert", "t5", "whisper", "wav2vec2", "qwen2_vl",
    "llava", "clip", "vit", "swin", "detr", "vit_mae", "gemma4_text", "big_bird",
]  # fmt: skip

INNER = """
import json

import pytest
import torch

from pytest_modelpatch import assert_equivalent, example_inputs
from pytest_modelpatch.compare.outputs import vacuous_outputs

FAMILIES = {families!r}
EXCEPTIONS = {exceptions!r}
BUDGET = {budget}
SIZES = {{}}


def _param(family):
    marks = [pytest.mark.model(family)]
    if family in EXCEPTIONS:
        marks.append(pytest.mark.xfail(reason=EXCEPTIONS[family], strict=True))
    return pytest.param(family, marks=marks, id=family)


@pytest.mark.parametrize("family", [_param(f) for f in FAMILIES])
def test_family(family, reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    # a test may call the shared reference again (BigBird rewires its own attention on the
    # first call), and what it computes must mean something: NaN would compare equal to NaN
    with torch.no_grad():
        outputs = reference_model(**example_inputs(reference_model.config, model_class=type(reference_model)))
    assert not vacuous_outputs(outputs), f"{{family}}: the outputs hold NaN or no finite value"
    parameters = sum(p.numel() for p in reference_model.parameters())
    assert parameters <= BUDGET, f"{{family}}: {{parameters:,}} parameters, over the budget of {{BUDGET:,}}"
"""


def documented_exceptions() -> dict[str, str]:
    """``docs/families.md``'s table of families that do not run here: type -> reason."""
    rows = re.findall(r"^\| `([\w.-]+)` \| (\w+) \| (.+?) \|$", DOC.read_text(encoding="utf-8"), flags=re.M)
    return {family: f"{stage}: {reason}" for family, stage, reason in rows}


def families_to_run() -> list[str]:
    every = available_model_types()
    if SWEEP == "all":
        return every
    return [f for f in REPRESENTATIVE if f in every]


def test_the_documented_exceptions_are_real_families() -> None:
    unknown = sorted(set(documented_exceptions()) - set(available_model_types()))
    assert not unknown, f"docs/families.md lists families transformers does not have: {unknown}"
    assert not set(documented_exceptions()) & set(REPRESENTATIVE), "the representative subset must be families that run"


def test_every_family_builds_tiny_and_passes_assert_equivalent_through_the_fixtures(pytester: pytest.Pytester) -> None:
    families = families_to_run()
    exceptions = {f: r for f, r in documented_exceptions().items() if f in families}
    pytester.makepyfile(test_families=INNER.format(families=families, exceptions=exceptions, budget=PARAMETER_BUDGET))
    xdist = ["-n", "2"] if SWEEP == "all" else []
    result = pytester.runpytest("-p", "no:randomly", "-q", "-rfEX", *xdist)
    outcomes = result.parseoutcomes()
    failed = outcomes.get("failed", 0) + outcomes.get("errors", 0) + outcomes.get("xpassed", 0)
    assert failed == 0, "\n".join(line for line in result.outlines if line.startswith(("FAILED", "ERROR", "XPASS")))
    assert outcomes.get("passed", 0) == len(families) - len(exceptions)
    assert outcomes.get("xfailed", 0) == len(exceptions)


@pytest.mark.skipif(SWEEP != "all", reason="runs every family (minutes): MODELPATCH_FAMILY_SWEEP=all")
def test_the_counts_docs_quote_are_what_the_coverage_script_prints(tmp_path: Path) -> None:
    rows = tmp_path / "coverage.json"
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "model_coverage.py"), "--markdown", "--json", str(rows)],
        capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
    )
    quoted = _generated_block(DOC.read_text(encoding="utf-8"))
    assert quoted == run.stdout.strip(), "docs/families.md is stale: paste `python benchmarks/model_coverage.py --markdown`"
    failing = {row["model_type"]: row["stage"] for row in json.loads(rows.read_text()) if row["stage"] != "ok"}
    documented = {f: reason.split(":")[0] for f, reason in documented_exceptions().items()}
    assert failing == documented, "the families that fail are not the ones docs/families.md lists (type: stage)"


def _generated_block(text: str) -> str:
    match = re.search(r"<!-- coverage:begin -->\n(.*?)\n<!-- coverage:end -->", text, flags=re.S)
    assert match, "docs/families.md has no <!-- coverage:begin --> ... <!-- coverage:end --> block"
    return match.group(1).strip()
