"""The round-trip's output step: forward passes run and flattened as every check does (compare._engine.outputs), judged bit for bit."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from fixtures.make_checkpoints import build_model
from fixtures.patches import llama_fused_qkv
from pytest_modelpatch.compare._engine.outputs import flatten_outputs
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.models.checkpoints import seeded_model
from pytest_modelpatch.roundtrip.check import assert_roundtrip
from pytest_modelpatch.roundtrip.differences import identical_outputs

torch.set_num_threads(1)


def leaves(output: Any) -> dict[str, Any]:
    return dict(flatten_outputs(output))


def test_identical_outputs_reaches_nested_outputs_and_names_them_by_path() -> None:
    pooled = torch.tensor([0.5, -1.0])
    reference = leaves(
        {"logits": torch.ones(2, 3), "vision": {"pooled": pooled, "layers": (pooled, None)}, "loss": None}
    )
    moved = pooled.clone()
    moved[1] = -1.25
    actual = leaves({"logits": torch.ones(2, 3), "vision": {"pooled": moved, "layers": (pooled, None)}, "loss": None})
    rows = {row.name: row for row in identical_outputs(reference, actual)}
    assert list(rows) == ["logits", "vision.pooled", "vision.layers[0]"]  # None leaves are not rows
    assert rows["logits"].identical and rows["vision.layers[0]"].identical
    assert not rows["vision.pooled"].identical and rows["vision.pooled"].max_abs_diff == 0.25
    assert str(rows["vision.pooled"]) == "vision.pooled[2]: max abs diff 0.25"


def test_identical_outputs_is_exact_and_fails_a_tensor_on_one_side_or_of_another_shape_or_dtype() -> None:
    tiny = torch.tensor([1.0, 2.0])
    rows = identical_outputs(
        leaves({"a": tiny, "b": tiny, "c": tiny, "d": None}),
        leaves({"a": tiny + 1e-7, "b": tiny.double(), "c": tiny[:1], "d": tiny, "e": tiny}),
    )
    assert [(row.name, row.identical) for row in rows] == [
        ("a", False),
        ("b", False),
        ("c", False),
        ("d", False),
        ("e", False),
    ]
    assert 0 < rows[0].max_abs_diff < 1e-6  # one float32 ulp at 2.0 is not identical
    assert all(row.max_abs_diff == float("inf") for row in rows[1:])


def test_a_model_source_compares_every_output_path_cache_layers_included(patch_registry: Any, tmp_path: Path) -> None:
    patch_registry.register(llama_fused_qkv.MAPPING, conversions=llama_fused_qkv.CONVERSIONS, overwrite=True)
    report = assert_roundtrip(build_model("llama", seed=3), tmp_path=tmp_path)
    names = [row.name for row in report.outputs]
    assert report.passed and names[0] == "logits"
    # the KV cache (`cache` from transformers 5.24, `past_key_values` before) is compared layer by layer
    assert [n for n in names if re.fullmatch(r"(cache|past_key_values)\.layers\[1\]\.(keys|values)", n)], names


def test_a_model_that_draws_in_eval_mode_round_trips_with_identical_outputs(tmp_path: Path) -> None:
    # ViT-MAE masks random patches in every forward, eval mode included: the reference and the
    # reloaded model must draw the same mask (compare._engine.running.forward seeds each pass)
    model = seeded_model(tiny_config("vit_mae"))
    torch.manual_seed(5)
    report = assert_roundtrip(model, tmp_path=tmp_path)
    assert report.passed and report.outputs and report.outputs_identical, str(report)
