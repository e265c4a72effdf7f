"""Models whose eval forward draws random numbers (ViT-MAE's masking) compare from one random state."""

from __future__ import annotations

import pytest
import torch

from pytest_modelpatch import assert_equivalent
from pytest_modelpatch.compare._engine.running import forward
from pytest_modelpatch.families.catalog import tiny_config
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.models.checkpoints import seeded_model

MAE = tiny_config("vit_mae")


def test_two_copies_of_a_randomly_masking_model_are_equivalent() -> None:
    reference, patched = seeded_model(MAE), seeded_model(MAE)
    assert_equivalent(reference, patched)


def test_a_patch_that_masks_other_patches_still_fails() -> None:
    # The same weights, but the patched embedding draws its noise after one extra number:
    # another mask, which the shared random state must not hide.
    reference, patched = seeded_model(MAE), seeded_model(MAE)
    embeddings = patched.embeddings
    original = embeddings.random_masking

    def shifted(sequence: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        torch.rand(1)
        return original(sequence, noise)

    embeddings.random_masking = shifted
    with pytest.raises(AssertionError, match="differs from reference ViTMAEModel"):
        assert_equivalent(reference, patched)


def test_a_forward_leaves_the_callers_random_state_alone() -> None:
    model = seeded_model(MAE).eval()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with torch.no_grad():
        forward(model, example_inputs(MAE))
    assert torch.equal(torch.rand(3), expected)
