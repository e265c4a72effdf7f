"""The example patches under fixtures/patches/ behave as their docstrings say, checked with plain transformers.

Each test builds a seeded tiny checkpoint, loads it with and without the example's patches and
conversions through ``from_pretrained``, and compares logits (or, for round-trips, the saved
safetensors tensors byte for byte).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.monkey_patching import register_patch_mapping

from fixtures import PATCH_MODULES, load_patch
from fixtures.make_checkpoints import write_checkpoint
from pytest_modelpatch.families.inputs import example_inputs
from pytest_modelpatch.isolation.guard import isolated_patch_state

FP32 = {"atol": 1e-5, "rtol": 1.3e-6}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``checkpoint(name, **kwargs)``: a seeded tiny checkpoint, written once per module and arguments."""
    made: dict[tuple[Any, ...], Path] = {}

    def make(name: str, **kwargs: Any) -> Path:
        key = (name, *sorted(kwargs.items()))
        if key not in made:
            made[key] = write_checkpoint(name, tmp_path_factory.mktemp(name), **kwargs)
        return made[key]

    return make


def model_class(path: Path) -> type[transformers.PreTrainedModel]:
    return getattr(transformers, transformers.AutoConfig.from_pretrained(path).architectures[0])


@contextmanager
def registered(mapping: dict[str, type], conversions: dict[str, list[Any]]) -> Iterator[None]:
    """Register a patch mapping and conversions for the block; nothing outlives it."""
    with isolated_patch_state():
        register_patch_mapping(mapping)
        for model_type, transforms in conversions.items():
            register_checkpoint_conversion_mapping(model_type, transforms, overwrite=True)
        yield


def load(
    path: Path,
    patch: types.ModuleType | None = None,
    *,
    mapping: dict[str, type] | None = None,
    conversions: dict[str, list[Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """``from_pretrained(path)`` in eval mode; with ``patch`` (or ``mapping``/``conversions``) registered
    it returns ``(model, loading_info)``."""
    mapping = mapping if mapping is not None else getattr(patch, "MAPPING", None)
    conversions = conversions if conversions is not None else getattr(patch, "CONVERSIONS", {})
    if mapping is None:
        return model_class(path).from_pretrained(path, **kwargs).eval()
    with registered(mapping, conversions):
        model, info = model_class(path).from_pretrained(path, output_loading_info=True, **kwargs)
    return model.eval(), info


def reference_and_patched(
    path: Path, patch: types.ModuleType | None = None, *, mapping: dict[str, type] | None = None, **kwargs: Any
) -> tuple[Any, Any]:
    """The unpatched model and the one with ``patch`` (or ``mapping``), checking every weight loaded.

    ``kwargs`` (e.g. ``attn_implementation``) go to both ``from_pretrained`` calls.
    """
    patched, info = load(path, patch, mapping=mapping, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return load(path, **kwargs), patched


def input_ids(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def output_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    return next((value for value in (*args, *kwargs.values()) if torch.is_tensor(value)), None)


def module_records(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[str, torch.Tensor | None, Any]]:
    """(qualified name, first input tensor, output) per submodule call, in the order the calls finished."""
    records: list[tuple[str, torch.Tensor | None, Any]] = []
    hooks = [
        module.register_forward_hook(
            lambda m, args, kwargs, out, name=name: records.append((name, first_tensor(args, kwargs), out)),
            with_kwargs=True,
        )
        for name, module in model.named_modules()
        if name
    ]
    try:
        output_of(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return records


def leading_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of a module output (a tensor, tuple or ModelOutput)."""
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    if isinstance(output, (tuple, list)):
        output = output[0] if output else None
    return output if torch.is_tensor(output) else None


def same(a: Any, b: Any) -> bool | None:
    """Whether two module inputs/outputs agree within fp32 tolerance; None when they cannot be compared."""
    a, b = leading_tensor(a), leading_tensor(b)
    if a is None or b is None or a.shape != b.shape:
        return None
    return torch.allclose(a, b, **FP32)


def first_divergence(reference: torch.nn.Module, patched: torch.nn.Module, ids: torch.Tensor) -> str | None:
    """The first module to finish, present in both models, that got the same input and gave a different output."""
    patched_calls = {name: (inp, out) for name, inp, out in module_records(patched, ids)}
    for name, inp, out in module_records(reference, ids):
        if name in patched_calls and same(inp, patched_calls[name][0]) and same(out, patched_calls[name][1]) is False:
            return name
    return None


def read_tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes) over every safetensors shard in ``directory``."""
    found: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name).contiguous()
                found[name] = (str(tensor.dtype), tuple(tensor.shape), tensor.view(torch.uint8).numpy().tobytes())
    assert found, f"no safetensors files in {directory}"
    return found


def roundtrip_differences(source: Path, saved: Path) -> list[str]:
    """What differs between two checkpoints, tensor by tensor (empty: bit-exact)."""
    a, b = read_tensors(source), read_tensors(saved)
    problems = [f"missing {name}" for name in sorted(a.keys() - b.keys())]
    problems += [f"unexpected {name}" for name in sorted(b.keys() - a.keys())]
    for name in sorted(a.keys() & b.keys()):
        if a[name][:2] != b[name][:2]:
            problems.append(f"{name}: {a[name][:2]} != {b[name][:2]}")
        elif a[name][2] != b[name][2]:
            problems.append(f"{name}: bytes differ")
    return problems


def load_and_save(source: Path, out: Path, patch: types.ModuleType | None = None, **kwargs: Any) -> Path:
    """Load ``source`` with a patch and its conversions (see ``load``), save it to ``out`` (original format)."""
    save_kwargs = {"max_shard_size": kwargs.pop("max_shard_size")} if "max_shard_size" in kwargs else {}
    model, info = load(source, patch, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.save_pretrained(out, **save_kwargs)
    return out


# ---------------------------------------------------------------------------
# every example declares the same contract
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", PATCH_MODULES)
def test_example_module_exports_mapping_conversions_model_type_and_expected(name: str) -> None:
    patch = load_patch(name)
    assert patch.__doc__ and ("GOOD" in patch.__doc__ or "BROKEN" in patch.__doc__)
    assert patch.EXPECTED in {"equivalent", "diverges", "lossless", "lossy"}
    assert isinstance(patch.MODEL_TYPE, str)
    assert patch.MAPPING or getattr(patch, "METHODS", None), "a patch replaces classes, methods or both"
    assert all(issubclass(cls, torch.nn.Module) for cls in patch.MAPPING.values())
    assert all(hasattr(cls, "_PATCHED_CLASS_") and cls._PATCHES_ for cls in getattr(patch, "METHODS", []))
    assert isinstance(patch.CONVERSIONS, dict)


# ---------------------------------------------------------------------------
# llama_fused_qkv (good)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_fused_qkv_llama_matches_original_logits_with_grouped_query_attention(
    checkpoint: Callable[..., Path], kv_heads: int
) -> None:
    path = checkpoint("llama", num_key_value_heads=kv_heads)
    reference, patched = reference_and_patched(path, load_patch("llama_fused_qkv"))
    assert all(type(layer.self_attn).__name__ == "LlamaFusedQKVAttention" for layer in patched.model.layers)
    ids = input_ids()
    for attn_implementation in ("sdpa", "eager"):
        reference.set_attn_implementation(attn_implementation)
        patched.set_attn_implementation(attn_implementation)
        torch.testing.assert_close(output_of(patched, ids), output_of(reference, ids), **FP32)


def test_fused_qkv_llama_checkpoint_round_trips_bit_exact(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = checkpoint("llama")
    saved = load_and_save(source, tmp_path / "saved", load_patch("llama_fused_qkv"))
    assert roundtrip_differences(source, saved) == []


def test_fused_qkv_llama_round_trips_sharded_bf16_checkpoint(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = checkpoint("llama", dtype="bfloat16", max_shard_size="20KB")
    assert len(list(source.glob("*.safetensors"))) > 2
    saved = load_and_save(source, tmp_path / "saved", load_patch("llama_fused_qkv"), max_shard_size="30KB")
    assert roundtrip_differences(source, saved) == []


def test_builtin_concatenate_would_not_round_trip_grouped_query_attention(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # Why the example ships ConcatenateQKV: Concatenate reverses to Chunk, which splits 64+32+32 rows
    # of the tiny Llama's qkv_proj into three equal parts.
    from transformers.core_model_loading import Concatenate, WeightConverter

    naive = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], operations=[Concatenate(dim=0)])
    source = checkpoint("llama")
    saved = load_and_save(
        source, tmp_path / "saved", mapping=load_patch("llama_fused_qkv").MAPPING, conversions={"llama": [naive]}
    )
    problems = roundtrip_differences(source, saved)
    assert (
        "model.layers.0.self_attn.q_proj.weight: ('torch.float32', (64, 64)) != ('torch.float32', (43, 64))" in problems
    )


# ---------------------------------------------------------------------------
# llama_fused_qkv_noncausal (broken)
# ---------------------------------------------------------------------------


def test_noncausal_fused_qkv_diverges_under_sdpa_first_in_layer_0_attention(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    reference, patched = reference_and_patched(path, load_patch("llama_fused_qkv_noncausal"))
    assert reference.config._attn_implementation == "sdpa"
    ids = input_ids()

    # The value recorded in the example's docstring.
    assert max_abs_diff(output_of(patched, ids), output_of(reference, ids)) == pytest.approx(4.631, abs=0.005)
    assert first_divergence(reference, patched, ids) == "model.layers.0.self_attn"


def test_noncausal_fused_qkv_hides_under_eager_attention(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    reference, patched = reference_and_patched(
        path, load_patch("llama_fused_qkv_noncausal"), attn_implementation="eager"
    )
    ids = input_ids()
    torch.testing.assert_close(output_of(patched, ids), output_of(reference, ids), **FP32)


# ---------------------------------------------------------------------------
# bert_broad_attention (broken with the broad key, good with the narrow one)
# ---------------------------------------------------------------------------


def test_broad_attention_key_replaces_bert_container_and_diverges(checkpoint: Callable[..., Path]) -> None:
    patch = load_patch("bert_broad_attention")
    path = checkpoint("bert")
    reference = load(path)
    patched, info = load(path, patch)

    attention = patched.encoder.layer[0].attention
    assert type(attention) is patch.BertSdpaSelfAttention  # the container itself was replaced
    assert not hasattr(attention, "output") and not hasattr(attention, "self")
    assert "encoder.layer.0.attention.output.dense.weight" in info["unexpected_keys"]
    assert "encoder.layer.0.attention.query.weight" in info["missing_keys"]
    ids = input_ids()
    assert max_abs_diff(output_of(patched, ids), output_of(reference, ids)) > 1.0
    assert first_divergence(reference, patched, ids) == "encoder.layer.0.attention"


def test_broad_attention_key_swaps_model_output_classes_while_patches_apply() -> None:
    from transformers.models.bert import modeling_bert
    from transformers.monkey_patching import apply_patches

    patch = load_patch("bert_broad_attention")
    original = modeling_bert.BaseModelOutputWithPoolingAndCrossAttentions
    with registered(patch.MAPPING, {}), apply_patches():
        assert modeling_bert.BaseModelOutputWithPoolingAndCrossAttentions is patch.BertSdpaSelfAttention
        assert modeling_bert.BertCrossAttention is patch.BertSdpaSelfAttention
    assert modeling_bert.BaseModelOutputWithPoolingAndCrossAttentions is original


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_narrow_self_attention_key_is_equivalent_with_and_without_padding(
    checkpoint: Callable[..., Path], attn_implementation: str
) -> None:
    patch = load_patch("bert_broad_attention")
    path = checkpoint("bert")
    reference, patched = reference_and_patched(
        path, mapping=patch.NARROW_MAPPING, attn_implementation=attn_implementation
    )
    assert type(patched.encoder.layer[0].attention).__name__ == "BertAttention"
    assert type(patched.encoder.layer[0].attention.self) is patch.BertSdpaSelfAttention
    ids = input_ids()
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0  # right padding on the first row
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(actual, expected, **FP32)
    torch.testing.assert_close(output_of(patched, ids), output_of(reference, ids), **FP32)


# ---------------------------------------------------------------------------
# qwen2_moe (good): the docs' ModuleListExperts + fused-QKV attention
# ---------------------------------------------------------------------------


def test_qwen2_moe_module_list_experts_and_fused_qkv_match_original_logits(checkpoint: Callable[..., Path]) -> None:
    patch = load_patch("qwen2_moe")
    path = checkpoint("qwen2_moe")
    reference, patched = reference_and_patched(path, patch)
    layer = patched.model.layers[0]
    assert type(layer.mlp.experts) is patch.ModuleListExperts
    assert type(layer.self_attn) is patch.Qwen2MoeFusedQKVAttention
    ids = input_ids()
    for attn_implementation in ("sdpa", "eager"):
        reference.set_attn_implementation(attn_implementation)
        patched.set_attn_implementation(attn_implementation)
        torch.testing.assert_close(output_of(patched, ids), output_of(reference, ids), **FP32)


@pytest.mark.parametrize(
    ("dtype", "max_shard_size"), [("float32", None), ("bfloat16", "40KB")], ids=["fp32", "bf16-sharded"]
)
def test_qwen2_moe_checkpoint_round_trips_bit_exact(
    checkpoint: Callable[..., Path], tmp_path: Path, dtype: str, max_shard_size: str | None
) -> None:
    source = checkpoint("qwen2_moe", dtype=dtype, max_shard_size=max_shard_size)
    assert max_shard_size is None or len(list(source.glob("*.safetensors"))) > 2
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": "64KB"}
    saved = load_and_save(source, tmp_path / "saved", load_patch("qwen2_moe"), **save_kwargs)
    assert roundtrip_differences(source, saved) == []


# ---------------------------------------------------------------------------
# qwen3_moe_router (good): the docs' replayable router
# ---------------------------------------------------------------------------


def test_replayable_router_without_forced_indices_matches_original_outputs(checkpoint: Callable[..., Path]) -> None:
    patch = load_patch("qwen3_moe_router")
    path = checkpoint("qwen3_moe")
    reference, patched = reference_and_patched(path, patch)
    assert all(type(layer.mlp.gate) is patch.ReplayableQwen3MoeTopKRouter for layer in patched.model.layers)
    ids = input_ids()
    with torch.no_grad():
        expected = reference(input_ids=ids, output_router_logits=True)
        actual = patched(input_ids=ids, output_router_logits=True)
    torch.testing.assert_close(actual.logits, expected.logits, **FP32)
    torch.testing.assert_close(actual.router_logits, expected.router_logits, **FP32)
    torch.testing.assert_close(actual.aux_loss, expected.aux_loss, **FP32)


def test_replayed_routing_survives_a_router_weight_change(checkpoint: Callable[..., Path]) -> None:
    patch = load_patch("qwen3_moe_router")
    patched, _ = load(checkpoint("qwen3_moe"), patch)
    ids = input_ids()
    recorded = patch.record_routing(patched, input_ids=ids)
    assert len(recorded) == patched.config.num_hidden_layers

    with torch.no_grad():
        for layer in patched.model.layers:
            layer.mlp.gate.weight.mul_(-1.0)  # reverses every token's expert ranking
        assert not all(torch.equal(a, b) for a, b in zip(patch.record_routing(patched, input_ids=ids), recorded))
        with patch.replay_moe_routing(patched, recorded):
            replayed = patch.record_routing(patched, input_ids=ids)
    assert all(torch.equal(a, b) for a, b in zip(replayed, recorded))
    assert all(router._forced_indices is None for router in patch._routers(patched))


# ---------------------------------------------------------------------------
# lossy (broken round-trips that load exactly)
# ---------------------------------------------------------------------------


def test_fused_weight_saved_through_bfloat16_loads_exactly_but_changes_qkv_bytes(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    patch = load_patch("lossy")
    source = checkpoint("llama")
    patched, _ = load(source, patch)
    ids = input_ids()
    torch.testing.assert_close(output_of(patched, ids), output_of(load(source), ids), **FP32)

    saved = load_and_save(source, tmp_path / "saved", patch)
    assert roundtrip_differences(source, saved) == [
        f"model.layers.{layer}.self_attn.{proj}_proj.weight: bytes differ" for layer in (0, 1) for proj in "kqv"
    ]


def test_fused_weight_saved_through_bfloat16_survives_a_bfloat16_checkpoint(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = checkpoint("llama", dtype="bfloat16")
    assert roundtrip_differences(source, load_and_save(source, tmp_path / "saved", load_patch("lossy"))) == []


def test_many_to_one_renaming_saves_down_proj_under_its_first_source_name(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    patch = load_patch("lossy")
    source = checkpoint("llama")
    variant = {"mapping": patch.RENAMED_MAPPING, "conversions": patch.RENAMED_CONVERSIONS}
    patched, _ = load(source, **variant)
    ids = input_ids()
    torch.testing.assert_close(output_of(patched, ids), output_of(load(source), ids), **FP32)

    saved = load_and_save(source, tmp_path / "saved", **variant)
    assert roundtrip_differences(source, saved) == [
        "missing model.layers.0.mlp.down_proj.weight",
        "missing model.layers.1.mlp.down_proj.weight",
        "unexpected model.layers.0.mlp.w2.weight",
        "unexpected model.layers.1.mlp.w2.weight",
    ]


# ---------------------------------------------------------------------------
# fixtures package and make_checkpoints.py
# ---------------------------------------------------------------------------


def test_make_checkpoints_script_writes_the_same_bytes_for_the_same_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import runpy

    import fixtures

    monkeypatch.setattr(sys, "path", list(sys.path))
    script = str(fixtures.FIXTURES_DIR / "make_checkpoints.py")
    for outdir in ("first", "second"):
        monkeypatch.setattr(sys, "argv", [script, str(tmp_path / outdir), "llama", "--max-shard-size", "40KB"])
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(script, run_name="__main__")
        assert exited.value.code == 0
    assert "llama: " in capsys.readouterr().out
    assert read_tensors(tmp_path / "first" / "llama") == read_tensors(tmp_path / "second" / "llama")
    assert len(list((tmp_path / "first" / "llama").glob("*.safetensors"))) > 1


def test_make_checkpoints_seed_changes_the_weights(tmp_path: Path) -> None:
    a = write_checkpoint("llama", tmp_path / "a", seed=0)
    b = write_checkpoint("llama", tmp_path / "b", seed=1)
    assert read_tensors(a).keys() == read_tensors(b).keys()
    assert read_tensors(a) != read_tensors(b)


def test_make_checkpoints_rejects_an_unknown_config_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fixtures.make_checkpoints import main

    with pytest.raises(SystemExit):
        main([str(tmp_path), "lama"])
    assert "unknown config(s) lama; known: " in capsys.readouterr().err


def test_tiny_config_and_load_patch_name_what_exists_when_asked_for_something_else() -> None:
    from fixtures import tiny_config

    with pytest.raises(FileNotFoundError, match="known configs: .*llama"):
        tiny_config("lama")
    with pytest.raises(ValueError, match="known: llama_fused_qkv"):
        load_patch("fused_qkv")
    assert tiny_config("llama", num_key_value_heads=1).num_key_value_heads == 1


# ---------------------------------------------------------------------------
# fusion_config={"patch_embeddings": True} on the tiny vision-language configs
# ---------------------------------------------------------------------------


def test_qwen3_vl_patch_embedding_fusion_is_equivalent_and_round_trips(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = checkpoint("qwen3_vl")
    reference = load(source)
    with isolated_patch_state():
        fused, info = model_class(source).from_pretrained(
            source, fusion_config={"patch_embeddings": True}, output_loading_info=True
        )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(fused.model.visual.patch_embed).__name__ == "FusedQwen3VLVisionPatchEmbed"
    inputs = example_inputs(reference.config, model_class=type(reference))
    with torch.no_grad():
        expected, actual = reference(**inputs).logits, fused.eval()(**inputs).logits
    torch.testing.assert_close(actual, expected, **FP32)  # Conv3d vs Linear: ~5e-7 apart

    fused.save_pretrained(tmp_path / "saved")
    assert roundtrip_differences(source, tmp_path / "saved") == []


@pytest.mark.skipif(
    not transformers.__version__.startswith("5.23."), reason="pins transformers 5.23 behaviour; recheck on upgrade"
)
def test_qwen2_vl_patch_embedding_fusion_leaves_linear_proj_uninitialised_in_transformers_5_23(
    checkpoint: Callable[..., Path],
) -> None:
    # fusion_mapping registers its Conv3d->Linear converter under the model type "qwen2_vl", but
    # Qwen2VLForConditionalGeneration has a class-name conversion mapping, which takes priority, so the
    # converter never runs: the fused Linear is freshly initialised and the outputs are wrong.
    source = checkpoint("qwen2_vl")
    with isolated_patch_state():
        _, info = model_class(source).from_pretrained(
            source, fusion_config={"patch_embeddings": True}, output_loading_info=True
        )
    assert "model.visual.patch_embed.linear_proj.weight" in info["missing_keys"]
    assert "model.visual.patch_embed.proj.weight" in info["unexpected_keys"]
