"""Registration-time reversibility: a conversion save_pretrained cannot reverse is reported when registered."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.conversion_mapping import _build_checkpoint_conversion_mapping
from transformers.core_model_loading import Chunk, Concatenate, ConversionOps, WeightConverter, WeightRenaming

from fixtures.patches import llama_fused_qkv, qwen2_moe
from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.isolation.reversibility import assert_reversible, require_reversible, reversibility_problems


class ScaleByTwo(ConversionOps):
    """A one-way op: multiplies on load and has no reverse_op."""

    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        return {target_patterns[0]: tensors[0] * 2}


class BrokenReverse(Concatenate):
    @property
    def reverse_op(self) -> ConversionOps:
        raise RuntimeError("sizes unknown")


class ReverseIsOneWay(Concatenate):
    @property
    def reverse_op(self) -> ConversionOps:
        return ScaleByTwo()


def fuse(op: Any) -> WeightConverter:
    return WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], operations=[op])


def test_example_patches_and_every_builtin_mapping_are_reversible() -> None:
    builtin = {key: value for key, value in _build_checkpoint_conversion_mapping().items() if isinstance(value, list)}
    assert len(builtin) > 100
    assert reversibility_problems({**builtin, **llama_fused_qkv.CONVERSIONS, **qwen2_moe.CONVERSIONS}) == []


def test_custom_op_without_reverse_is_named_with_key_converter_and_op() -> None:
    conversions = {
        "llama": [WeightRenaming("input_layernorm", "attn_norm"), fuse(Concatenate(0))],
        "mistral": [WeightConverter("o_proj", "o_proj_scaled", operations=[ScaleByTwo()])],
    }
    (problem,) = reversibility_problems(conversions)
    assert (problem.key, problem.index, problem.operation) == ("mistral", 0, "ScaleByTwo")
    assert str(problem) == (
        "conversion 'mistral' [0] WeightConverter(['o_proj'] -> ['o_proj_scaled']), operation ScaleByTwo: "
        "has no reverse_op (ConversionOps.reverse_op raises NotImplementedError)"
    )


@pytest.mark.parametrize(
    ("op", "reason"),
    [
        pytest.param(BrokenReverse(0), "reverse_op raised RuntimeError: sizes unknown", id="raises"),
        pytest.param(ReverseIsOneWay(0), "its reverse has no reverse_op", id="reverse-not-reversible"),
        pytest.param(lambda tensors: tensors, "is function, not a transformers ConversionOps", id="not-an-op"),
    ],
)
def test_unusable_reverses_are_reported(op: Any, reason: str) -> None:
    converter = fuse(Concatenate(0))
    converter.operations = [op]
    (problem,) = reversibility_problems({"llama": [converter]})
    assert reason in str(problem)


@pytest.mark.parametrize(
    ("check", "raised"), [(assert_reversible, AssertionError), (require_reversible, PatchUsageError)]
)
def test_a_one_way_conversion_fails_the_check_and_is_refused_at_registration_with_the_fix(
    check: Any, raised: type[Exception]
) -> None:
    with pytest.raises(raised) as error:
        check({"llama": [fuse(ScaleByTwo())], "qwen2": [fuse(Chunk(0)), fuse(BrokenReverse(0))]})
    message = str(error.value)
    assert message.startswith("2 weight conversion(s) cannot be reversed")
    assert "conversion 'llama' [0]" in message and "conversion 'qwen2' [1]" in message
    assert "Give each custom ConversionOps a `reverse_op` property" in message
    assert not isinstance(error.value, PatchUsageError) or raised is PatchUsageError  # a failed check, not a misuse


def test_reversible_conversions_pass_the_check() -> None:
    assert_reversible({"llama": [fuse(Concatenate(0))]})


def test_registering_a_one_way_conversion_fails_at_registration(patch_registry: Any) -> None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    before = get_checkpoint_conversion_mapping("llama")
    with pytest.raises(PatchUsageError, match="conversion 'llama' \\[0\\].*operation ScaleByTwo"):
        patch_registry.register(llama_fused_qkv.MAPPING, conversions={"llama": [fuse(ScaleByTwo())]}, overwrite=True)
    assert repr(get_checkpoint_conversion_mapping("llama")) == repr(before)


def test_one_way_conversion_in_a_pytest_run_is_a_usage_error_naming_the_op(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from fixtures.patches import llama_fused_qkv
        from tests.isolation.test_reversibility import ScaleByTwo, fuse

        def test_register(patch_registry):
            patch_registry.register(llama_fused_qkv.MAPPING, conversions={"llama": [fuse(ScaleByTwo())]}, overwrite=True)
        """
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*PatchUsageError: 1 weight conversion(s) cannot be reversed*", "*operation ScaleByTwo*"]
    )
