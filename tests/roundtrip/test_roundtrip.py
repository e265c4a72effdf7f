"""assert_roundtrip: patched load -> save gives the source checkpoint back bit for bit, or a report naming the tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.core_model_loading import ConversionOps, WeightConverter

from fixtures.make_checkpoints import build_model, write_checkpoint
from fixtures.patches import llama_fused_qkv, qwen2_moe
from fixtures.patches._fused_qkv import ConcatenateQKV, qkv_sizes
from pytest_modelpatch.errors import CheckpointError
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.isolation.guard import isolated_patch_state
from pytest_modelpatch.isolation.registration import register_patches
from pytest_modelpatch.roundtrip.check import Roundtrip, assert_roundtrip
from pytest_modelpatch.roundtrip.safetensors_diff import diff_checkpoints

torch.set_num_threads(1)


def register(patch: Any, registry: Any) -> None:
    registry.register(patch.MAPPING, conversions=patch.CONVERSIONS, overwrite=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture(scope="module")
def sharded_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama-sharded") / "ckpt", max_shard_size="60KB")


# ---------------------------------------------------------------------------
# lossless conversions pass
# ---------------------------------------------------------------------------


def test_fused_qkv_llama_roundtrip_is_bit_exact(patch_registry: Any, llama_dir: Path, tmp_path: Path) -> None:
    register(llama_fused_qkv, patch_registry)
    report = assert_roundtrip(llama_dir, tmp_path=tmp_path)
    # identical tensors and config.json: the unpatched reload would be the source model itself
    assert report.passed and report.outputs_checked and report.outputs_implied and not report.outputs
    assert report.weights.summary() == "21/21 tensors identical, 361.7 kB compared"
    assert "outputs unchanged (implied: identical tensors and config)" in report.summary()
    assert "model.layers.0.self_attn.q_proj.weight" in {row.name for row in report.weights.tensors}


def test_fused_qkv_llama_roundtrip_is_bit_exact_across_differing_shards(
    patch_registry: Any, sharded_llama_dir: Path, tmp_path: Path
) -> None:
    register(llama_fused_qkv, patch_registry)
    assert len(list(sharded_llama_dir.glob("*.safetensors"))) >= 3
    report = assert_roundtrip(sharded_llama_dir, tmp_path=tmp_path, max_shard_size="100KB")
    saved_shards = sorted(p.name for p in report.saved.glob("*.safetensors"))
    assert len(saved_shards) >= 2 and saved_shards != sorted(p.name for p in sharded_llama_dir.glob("*.safetensors"))
    assert report.passed, str(report)


def test_fused_qkv_llama_roundtrip_is_bit_exact_in_bf16(patch_registry: Any, tmp_path: Path) -> None:
    source = write_checkpoint("llama", tmp_path / "bf16", dtype="bfloat16", max_shard_size="40KB")
    register(llama_fused_qkv, patch_registry)
    report = assert_roundtrip(source, tmp_path=tmp_path)
    assert report.dtype == "bfloat16"
    assert {row.source.dtype for row in report.weights.tensors} == {"BF16"}
    assert report.passed


@pytest.mark.parametrize(
    ("dtype", "max_shard_size"),
    [pytest.param("float32", None, id="fp32"), pytest.param("bfloat16", "50KB", id="bf16-sharded")],
)
def test_qwen2_moe_module_list_experts_and_fused_qkv_roundtrip_bit_exact(
    patch_registry: Any, tmp_path: Path, dtype: str, max_shard_size: str | None
) -> None:
    source = write_checkpoint("qwen2_moe", tmp_path / "source", dtype=dtype, max_shard_size=max_shard_size)
    assert (source / "model.safetensors.index.json").exists() == (max_shard_size is not None)
    register(qwen2_moe, patch_registry)
    report = assert_roundtrip(source, tmp_path=tmp_path)
    names = {row.name for row in report.weights.tensors}
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and "model.layers.1.self_attn.v_proj.bias" in names
    assert report.passed, str(report)


def test_reference_model_source_is_saved_first_and_compared(patch_registry: Any, tmp_path: Path) -> None:
    reference = build_model("llama", seed=3)
    register(llama_fused_qkv, patch_registry)
    report = Roundtrip(tmp_path).check(reference)
    assert report.source.parent.parent == tmp_path and report.passed
    assert report.outputs and all(row.identical for row in report.outputs)


def test_patched_layout_survives_save_and_reload_with_patches(
    patch_registry: Any, llama_dir: Path, tmp_path: Path
) -> None:
    register(llama_fused_qkv, patch_registry)
    report = assert_roundtrip(llama_dir, tmp_path=tmp_path, save_original_format=False)
    names = {row.name for row in report.weights.tensors}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.self_attn.q_proj.weight" not in names
    assert report.passed and report.outputs


def test_roundtrip_writes_one_record_per_check(patch_registry: Any, llama_dir: Path, tmp_path: Path) -> None:
    from pytest_modelpatch.reporting.records import set_record_sink

    rows: list[Any] = []
    previous = set_record_sink(rows.append)
    try:
        register(llama_fused_qkv, patch_registry)
        assert_roundtrip(llama_dir, tmp_path=tmp_path, check_outputs=False)
    finally:
        set_record_sink(previous)
    assert [(r.kind, r.outcome, r.patch_keys) for r in rows] == [("roundtrip", "passed", ["LlamaAttention"])]
    assert rows[0].detail.startswith("roundtrip passed: 21/21 tensors identical")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    heads_and_kv=st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 3), (8, 2)]),
    head_dim=st.sampled_from([4, 8, 16]),
    attention_bias=st.booleans(),
)
def test_fused_qkv_roundtrip_is_bit_exact_over_tiny_configs(
    tmp_path_factory: pytest.TempPathFactory, heads_and_kv: tuple[int, int], head_dim: int, attention_bias: bool
) -> None:
    heads, kv_heads = heads_and_kv
    overrides = dict(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=heads * head_dim,
        head_dim=head_dim,
        attention_bias=attention_bias,
        num_hidden_layers=1,
    )
    work = tmp_path_factory.mktemp("hypothesis")
    source = write_checkpoint("llama", work / "source", **overrides)
    with isolated_patch_state():
        register_patches(llama_fused_qkv.MAPPING, conversions=llama_fused_qkv.CONVERSIONS, overwrite=True)
        report = assert_roundtrip(source, tmp_path=work, check_outputs=False)
    assert report.passed


# ---------------------------------------------------------------------------
# fusion_config: transformers' own fused patch embeddings
# ---------------------------------------------------------------------------

FUSION = {"patch_embeddings": True}


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import Qwen3VLForConditionalGeneration

    from pytest_modelpatch.families.catalog import tiny_config

    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_config("qwen3_vl")).eval()
    path = tmp_path_factory.mktemp("qwen3_vl") / "ckpt"
    model.save_pretrained(path)
    return model, path


def test_fused_patch_embeddings_match_the_conv3d_model_and_leak_nothing(qwen3_vl: tuple[Any, Path]) -> None:
    from transformers.monkey_patching import get_patch_mapping

    from pytest_modelpatch.compare._engine.devices import evaluating
    from pytest_modelpatch.compare._engine.outputs import compare_outputs
    from pytest_modelpatch.compare._engine.running import forward
    from pytest_modelpatch.compare._engine.tolerance import resolve_tolerance
    from pytest_modelpatch.roundtrip.check import load_with_fusion

    reference, path = qwen3_vl
    before = dict(get_patch_mapping())
    fused = load_with_fusion(path, FUSION)
    assert type(fused.model.visual.patch_embed).__name__ == "FusedQwen3VLVisionPatchEmbed"
    assert dict(get_patch_mapping()) == before
    inputs = example_inputs(reference.config, model_class=type(reference))
    with evaluating(reference, fused):
        found = compare_outputs(
            forward(reference, inputs), forward(fused, inputs), resolve_tolerance(atol=1e-5, rtol=0)
        )
    assert "logits" in {c.path for c in found} and not [str(c) for c in found if not c.passed]


def test_fused_patch_embeddings_roundtrip_bit_exact(qwen3_vl: tuple[Any, Path], tmp_path: Path) -> None:
    reference, path = qwen3_vl
    inputs = example_inputs(reference.config, model_class=type(reference))
    report = assert_roundtrip(path, tmp_path=tmp_path, fusion_config=FUSION, inputs=inputs)
    assert report.passed and report.outputs
    assert "'fusion_config' added: {'patch_embeddings': True}" in str(report)


def test_qwen2_vl_patch_embeddings_fusion_is_caught_dropping_the_conv_weight(tmp_path: Path) -> None:
    # transformers 5.23 registers the fusion's converter under model type "qwen2_vl", but the
    # class-name mapping of Qwen2VLForConditionalGeneration shadows it: the fused Linear starts
    # from fresh weights and is saved under its own name.
    from transformers import Qwen2VLForConditionalGeneration

    from pytest_modelpatch.families.catalog import tiny_config

    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(tiny_config("qwen2_vl")).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(AssertionError) as failure:
        assert_roundtrip(tmp_path / "ckpt", tmp_path=tmp_path, fusion_config=FUSION, check_outputs=False)
    message = str(failure.value)
    assert "visual.patch_embed.proj.weight: missing from the saved checkpoint" in message
    assert "visual.patch_embed.linear_proj.weight: unexpected in the saved checkpoint" in message


# ---------------------------------------------------------------------------
# lossy conversions fail with a report naming the tensor
# ---------------------------------------------------------------------------


class ConcatenateInBF16(ConcatenateQKV):
    """Fuses q/k/v but rounds the fused weight through bfloat16: a lossy load."""

    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        fused = super().convert(input_dict, source_patterns, target_patterns, **kwargs)
        return {key: value.to(torch.bfloat16).to(value.dtype) for key, value in fused.items()}


class SplitKVSwapped(ConversionOps):
    """Reverses the fusion but writes the k rows back as v_proj and the v rows as k_proj."""

    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        config: Any = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        q, k, v = torch.split(tensors[0], qkv_sizes(config), dim=0)
        names = [target_patterns[0], target_patterns[2], target_patterns[1]]
        return {name: chunk.contiguous() for name, chunk in zip(names, (q, k, v))}

    @property
    def reverse_op(self) -> ConversionOps:
        return ConcatenateQKV(0)


class ConcatenateSavingSwapped(ConcatenateQKV):
    @property
    def reverse_op(self) -> ConversionOps:
        return SplitKVSwapped()


def fused_qkv_with(op: ConversionOps) -> dict[str, list[WeightConverter]]:
    return {"llama": [WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], operations=[op])]}


def test_lossy_bf16_fusion_fails_naming_the_rounded_tensors(
    patch_registry: Any, llama_dir: Path, tmp_path: Path
) -> None:
    patch_registry.register(llama_fused_qkv.MAPPING, conversions=fused_qkv_with(ConcatenateInBF16(0)), overwrite=True)
    with pytest.raises(AssertionError) as failure:
        assert_roundtrip(llama_dir, tmp_path=tmp_path)
    message = str(failure.value)
    assert "roundtrip FAILED: 15/21 tensors identical" in message
    assert "model.layers.0.self_attn.q_proj.weight: bytes differ;" in message
    assert "max abs diff" in message and "outputs differ" in message


def test_conversion_saving_k_as_v_fails_naming_both_tensors(
    patch_registry: Any, llama_dir: Path, tmp_path: Path
) -> None:
    patch_registry.register(
        llama_fused_qkv.MAPPING, conversions=fused_qkv_with(ConcatenateSavingSwapped(0)), overwrite=True
    )
    with pytest.raises(AssertionError) as failure:
        assert_roundtrip(llama_dir, tmp_path=tmp_path, check_outputs=False)
    message = str(failure.value)
    for layer in (0, 1):
        assert f"model.layers.{layer}.self_attn.k_proj.weight: bytes differ;" in message
        assert f"model.layers.{layer}.self_attn.v_proj.weight: bytes differ;" in message
    assert "q_proj" not in message


def test_failure_in_a_pytest_run_shows_the_report(pytester: pytest.Pytester, llama_dir: Path) -> None:
    pytester.makepyfile(
        f"""
        from fixtures.patches import llama_fused_qkv, qwen2_moe
        from tests.roundtrip.test_roundtrip import ConcatenateInBF16, fused_qkv_with
        from pytest_modelpatch.roundtrip.check import assert_roundtrip

        def test_lossy(patch_registry, tmp_path):
            patch_registry.register(llama_fused_qkv.MAPPING, conversions=fused_qkv_with(ConcatenateInBF16(0)), overwrite=True)
            assert_roundtrip({str(llama_dir)!r}, tmp_path=tmp_path, check_outputs=False)
        """
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*AssertionError: roundtrip FAILED: 15/21 tensors identical*",
            "*model.layers.0.self_attn.k_proj.weight: bytes differ*",
        ]
    )
    assert "def assert_roundtrip" not in result.stdout.str()  # __tracebackhide__: the user's line is shown


# ---------------------------------------------------------------------------
# the comparison itself and bad input
# ---------------------------------------------------------------------------


def test_diff_reports_missing_unexpected_shape_and_dtype(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file(
        {"same": torch.ones(3), "gone": torch.ones(2), "shape": torch.ones(4), "dtype": torch.ones(2)},
        tmp_path / "a/model.safetensors",
        metadata={"format": "pt"},
    )
    save_file(
        {
            "same": torch.ones(3),
            "new": torch.ones(2),
            "shape": torch.ones(2, 2),
            "dtype": torch.ones(2, dtype=torch.float16),
        },
        tmp_path / "b/model.safetensors",
        metadata={"format": "np"},
    )
    diff = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert {row.name: row.status for row in diff.tensors} == {
        "same": "identical",
        "gone": "missing",
        "new": "unexpected",
        "shape": "shape",
        "dtype": "dtype",
    }
    assert diff.summary() == "1/4 tensors identical, 1 unexpected, 1 metadata difference(s), 20 B compared"
    text = str(diff)
    assert "gone: missing from the saved checkpoint" in text and "shape: shape [2, 2] saved, [4] in the source" in text
    assert "dtype: dtype F16 saved, F32 in the source; 0/2 elements differ" in text
    assert "metadata: safetensors header 'format': 'np' saved, 'pt' in the source" in text


def test_byte_compare_sees_negative_zero_and_counts_elements(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    for name, values in (("a", [0.0, 1.0, 2.0, 3.0]), ("b", [-0.0, 1.0, 2.5, 3.0])):
        (tmp_path / name).mkdir()
        save_file({"w": torch.tensor(values)}, tmp_path / name / "model.safetensors")
    (row,) = diff_checkpoints(tmp_path / "a", tmp_path / "b").tensors
    assert (row.status, row.differing_elements, row.elements, row.max_abs_diff) == ("bytes", 2, 4, 0.5)


def test_missing_directory_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"checkpoint directory {tmp_path / 'nowhere'} does not exist"):
        assert_roundtrip(tmp_path / "nowhere")


def test_directory_with_only_pytorch_model_bin_is_rejected(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \.safetensors file in .*pytorch_model\.bin.*pickled weights only"):
        assert_roundtrip(tmp_path)


def test_truncated_safetensors_file_is_named(llama_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    data = (llama_dir / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=f"{copy / 'model.safetensors'} is not a readable safetensors file.*truncated or corrupt"
    ):
        assert_roundtrip(copy)


def test_corrupt_header_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        assert_roundtrip(tmp_path)


def test_a_checkpoint_without_config_json_is_named(llama_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    os.symlink(llama_dir / "model.safetensors", copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{copy} has no config.json"):
        assert_roundtrip(copy)


def test_index_naming_an_absent_shard_is_named(sharded_llama_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    shards = sorted(sharded_llama_dir.glob("*.safetensors"))
    for path in [*shards[1:], sharded_llama_dir / "model.safetensors.index.json", sharded_llama_dir / "config.json"]:
        os.symlink(path, copy / path.name)
    with pytest.raises(
        CheckpointError, match=f"names shard '{shards[0].name}'.*{copy / shards[0].name} does not exist"
    ):
        assert_roundtrip(copy)


def test_index_disagreeing_with_its_shards_is_named(sharded_llama_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    index = json.loads((sharded_llama_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = sorted(set(index["weight_map"].values()))[0]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    for path in sharded_llama_dir.glob("*.safetensors"):
        os.symlink(path, copy / path.name)
    with pytest.raises(CheckpointError, match="places 'lm_head.weight' in .*-00001-of-.*, but it is in"):
        assert_roundtrip(copy)
