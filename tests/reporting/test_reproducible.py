"""Same run, same figures: a broken example reports identical numbers every time it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The broad pattern replaces BertAttention, whose replacement's weights the checkpoint lacks:
# from_pretrained initialises them from torch's RNG, which once made every run's figures differ.
BROKEN_BERT = """
import pytest
from fixtures.patches import bert_broad_attention
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("bert")
@pytest.mark.patch(bert_broad_attention.MAPPING, allow={".*Attention": ["CONTAINER", "NOT_A_MODULE", "WEIGHT_NAMES", "UNUSED_ARGUMENT"]})
def test_broad_pattern(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""

FIGURES = ("max_abs_error", "max_rel_error", "elements_over_tolerance", "output", "profile")


def test_a_broken_example_reports_identical_figures_in_three_runs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_broken=BROKEN_BERT)
    runs = []
    for i in range(3):
        result = pytester.runpytest("-p", "no:randomly", "--modelpatch-report", f"r{i}.json")
        result.assert_outcomes(failed=1)
        (row,) = json.loads((pytester.path / f"r{i}.json").read_text())["rows"]
        runs.append({name: row[name] for name in FIGURES})
    assert runs[0]["max_abs_error"] > 0.1 and runs[0]["profile"]  # it is caught, with a profile
    # exact, not up to round-off: the same machine runs the same kernels on the same inputs three times
    assert runs[0] == runs[1] == runs[2]


def test_loading_leaves_the_tests_random_state_alone(tmp_path: Path) -> None:
    import torch

    from fixtures import tiny_config
    from pytest_modelpatch.models.checkpoints import cached_checkpoint, load_pretrained

    path = cached_checkpoint(tiny_config("llama"), cache_dir=tmp_path)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_pretrained(path)
    assert torch.equal(torch.rand(3), expected)
