"""Every model family transformers ships, as a user tries it: ``@pytest.mark.model(t)`` plus ``assert_equivalent``.

One real pytest session (pytester) runs a test per family with the plugin's own
``reference_model``/``patched_model`` fixtures, no patch, and checks the model's size
against the budget. The families that cannot run here are listed in ``docs/families.md``
with the reason; they are strict xfails, so a family that starts working (or one that
breaks) changes the outcome. By default a representative subset runs (a few of each kind
of model); ``MODELPATCH_FAMILY_SWEEP=all`` runs every family, as CI's family-sweep step
does, and then also checks the counts ``docs/families.md`` quotes against
``benchmarks/model_coverage.py``. The families whose towers are timm models are strict
xfails where timm cannot be imported and must pass where it can:
``MODELPATCH_FAMILY_SWEEP=timm`` runs just them, as CI's vision step does in a venv with
torchvision and timm, and checks their counts block too.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_modelpatch.families.catalog import available_model_types

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

from pytest_modelpatch import assert_equivalent
from pytest_modelpatch.models import example_inputs
from pytest_modelpatch.compare._engine.outputs import vacuous_outputs

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
@pytest.mark.patch(unpatched=True)  # every family built, loaded and compared with itself
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


def _documented(heading: str) -> dict[str, str]:
    """One ``docs/families.md`` table under ``## heading``: type -> "stage: reason"."""
    text = DOC.read_text(encoding="utf-8")
    assert f"\n## {heading}\n" in text, f"docs/families.md has no section '## {heading}'"
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.-]+)` \| (\w+) \| (.+?) \|$", section, flags=re.M)
    return {family: f"{stage}: {reason}" for family, stage, reason in rows}


def timm_families() -> dict[str, str]:
    """The families that need timm: type -> where and why they stop without it."""
    return _documented("Families that need timm")


@functools.cache
def timm_runs() -> bool:
    """timm imports here (it needs a torchvision built for this torch)."""
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or torchvision's own failure to load its operators
        return False
    return True


def documented_exceptions() -> dict[str, str]:
    """The families that do not run here, with their reasons: the timm ones too where timm does not import."""
    found = _documented("Families that do not run here")
    return found if timm_runs() else {**found, **timm_families()}


def families_to_run() -> list[str]:
    every = available_model_types()
    if SWEEP == "all":
        return every
    if SWEEP == "timm":
        return [f for f in timm_families() if f in every]
    return [f for f in REPRESENTATIVE if f in every]


def test_the_documented_exceptions_are_real_families() -> None:
    listed = set(_documented("Families that do not run here")) | set(timm_families())
    unknown = sorted(listed - set(available_model_types()))
    assert not unknown, f"docs/families.md lists families transformers does not have: {unknown}"
    both = sorted(set(_documented("Families that do not run here")) & set(timm_families()))
    assert not both, f"docs/families.md lists these both as needing timm and as not running at all: {both}"
    assert not set(documented_exceptions()) & set(REPRESENTATIVE), "the representative subset must be families that run"


def test_sweeps_skip_by_the_tables_docs_families_md_prints() -> None:
    from pytest_modelpatch.families.not_running import NEEDS_TIMM, NOT_RUNNING

    assert {f: f"{stage}: {why}" for f, (stage, why) in NOT_RUNNING.items()} == _documented(
        "Families that do not run here"
    ), "families/not_running.py's NOT_RUNNING must say what docs/families.md says"
    assert {f: f"{stage}: {why}" for f, (stage, why) in NEEDS_TIMM.items()} == timm_families()


def test_every_family_builds_tiny_and_passes_assert_equivalent_through_the_fixtures(pytester: pytest.Pytester) -> None:
    families = families_to_run()
    exceptions = {f: r for f, r in documented_exceptions().items() if f in families}
    pytester.makepyfile(test_families=INNER.format(families=families, exceptions=exceptions, budget=PARAMETER_BUDGET))
    xdist = ["-n", "2"] if SWEEP in ("all", "timm") else []
    result = pytester.runpytest("-p", "no:randomly", "-q", "-rfEX", *xdist)
    outcomes = result.parseoutcomes()
    failed = outcomes.get("failed", 0) + outcomes.get("errors", 0) + outcomes.get("xpassed", 0)
    assert failed == 0, "\n".join(line for line in result.outlines if line.startswith(("FAILED", "ERROR", "XPASS")))
    assert outcomes.get("passed", 0) == len(families) - len(exceptions)
    assert outcomes.get("xfailed", 0) == len(exceptions)


def _coverage(tmp_path: Path, *families: str) -> tuple[str, dict[str, str]]:
    """``model_coverage.py --markdown`` over ``families`` (all when none): its block, and type -> stage."""
    rows = tmp_path / "coverage.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "model_coverage.py"),
            "--markdown",
            "--jobs",
            "2",
            "--json",
            str(rows),
            *families,
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    )
    return run.stdout.strip(), {row["model_type"]: row["stage"] for row in json.loads(rows.read_text())}


@pytest.mark.skipif(SWEEP != "all", reason="runs every family (minutes): MODELPATCH_FAMILY_SWEEP=all")
def test_the_counts_docs_quote_are_what_the_coverage_script_prints(tmp_path: Path) -> None:
    block, stages = _coverage(tmp_path)
    quoted = _generated_block(DOC.read_text(encoding="utf-8"), "coverage")
    assert quoted == block, "docs/families.md is stale: paste `python benchmarks/model_coverage.py --markdown`"
    failing = {family: stage for family, stage in stages.items() if stage != "ok"}
    documented = {f: reason.split(":")[0] for f, reason in documented_exceptions().items()}
    assert failing == documented, "the families that fail are not the ones docs/families.md lists (type: stage)"


@pytest.mark.skipif(
    SWEEP != "timm", reason="needs timm and torchvision: MODELPATCH_FAMILY_SWEEP=timm, in CI's vision step"
)
def test_with_timm_the_timm_families_pass_the_coverage_script_as_docs_quote(tmp_path: Path) -> None:
    assert timm_runs(), "MODELPATCH_FAMILY_SWEEP=timm needs timm to import: bash .ci/setup .venv-vision '' vision"
    block, stages = _coverage(tmp_path, *timm_families())
    assert {family: stage for family, stage in stages.items() if stage != "ok"} == {}
    quoted = _generated_block(DOC.read_text(encoding="utf-8"), "coverage-timm")
    assert quoted == block, (
        "docs/families.md is stale: paste `python benchmarks/model_coverage.py --markdown <the timm families>`, "
        "run where timm imports"
    )


def _generated_block(text: str, name: str) -> str:
    match = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", text, flags=re.S)
    assert match, f"docs/families.md has no <!-- {name}:begin --> ... <!-- {name}:end --> block"
    return match.group(1).strip()
