"""isolated_patch_state() and builtin_patch_state() restore every global a patch can touch."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, conversion_mapping, monkey_patching
from transformers.core_model_loading import WeightRenaming
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mixtral import modeling_mixtral

from pytest_modelpatch.isolation.guard import PatchStateGuard, builtin_patch_state, isolated_patch_state

CONFIG = LlamaConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
)  # fmt: skip


class RecordingAttention(LlamaAttention):
    pass


class ExplodingAttention(LlamaAttention):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("replacement __init__ failed")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).save_pretrained(path)
    return path


def _attentions(path: Path) -> int:
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
    return len(model(torch.tensor([[1, 2, 3]]), output_attentions=True).attentions or ())


def test_mapping_conversions_and_recorders_come_back(checkpoint: Path) -> None:
    with isolated_patch_state():
        monkey_patching.register_patch_mapping({"LlamaAttention": RecordingAttention, "(": RecordingAttention})
        conversion_mapping.register_checkpoint_conversion_mapping("llama", [WeightRenaming("x", "y")])
        LlamaForCausalLM.from_pretrained(checkpoint)
        assert modeling_llama.LlamaPreTrainedModel._can_record_outputs["attentions"] is RecordingAttention
    assert monkey_patching.get_patch_mapping() == {}
    assert "(" not in monkey_patching._compiled_patterns_cache
    assert conversion_mapping.get_checkpoint_conversion_mapping("llama") is None
    assert modeling_llama.LlamaPreTrainedModel._can_record_outputs["attentions"] is LlamaAttention
    assert _attentions(checkpoint) == CONFIG.num_hidden_layers


def test_classes_stay_original_when_a_replacement_raises_during_from_pretrained(checkpoint: Path) -> None:
    # transformers' apply_patches restores the swapped classes only on a clean exit
    with isolated_patch_state():
        monkey_patching.register_patch_mapping({"LlamaAttention": ExplodingAttention})
        with pytest.raises(RuntimeError, match="replacement __init__ failed"):
            LlamaForCausalLM.from_pretrained(checkpoint)
        assert modeling_llama.LlamaAttention is LlamaAttention
    assert modeling_llama.LlamaAttention is LlamaAttention


def test_changes_name_what_leaked(checkpoint: Path) -> None:
    guard = PatchStateGuard()
    monkey_patching.register_patch_mapping({"LlamaAttention": RecordingAttention})
    LlamaForCausalLM.from_pretrained(checkpoint)
    changes = guard.restore()
    assert any("'LlamaAttention' -> " in c and "RecordingAttention was registered" in c for c in changes)
    assert any("LlamaPreTrainedModel._can_record_outputs['attentions']" in c for c in changes)
    assert guard.restore() == []  # idempotent
    assert monkey_patching.get_patch_mapping() == {}


def test_without_patches_builds_the_original_model_and_keeps_the_patches(checkpoint: Path) -> None:
    with isolated_patch_state():
        monkey_patching.register_patch_mapping({"LlamaAttention": RecordingAttention})
        conversion_mapping.register_checkpoint_conversion_mapping("llama", [WeightRenaming("x", "y")])
        patched = LlamaForCausalLM.from_pretrained(checkpoint)
        with builtin_patch_state():
            assert monkey_patching.get_patch_mapping() == {}
            assert conversion_mapping.get_checkpoint_conversion_mapping("llama") is None
            assert _attentions(checkpoint) == CONFIG.num_hidden_layers
        assert type(patched.model.layers[0].self_attn) is RecordingAttention
        assert monkey_patching.get_patch_mapping() == {"LlamaAttention": RecordingAttention}
        assert conversion_mapping.get_checkpoint_conversion_mapping("llama") is not None


def test_fusion_caches_are_restored() -> None:
    fusion = pytest.importorskip("transformers.fusion_mapping", reason="fusion_mapping arrived in transformers 5.10")
    sources = getattr(fusion, "_REGISTERED_FUSION_SOURCE_PATTERNS", None)  # not in 5.17; in 5.23
    with isolated_patch_state():
        fusion._FUSION_DISCOVERY_CACHE.setdefault("patch_embeddings", {})[LlamaForCausalLM] = {"X": RecordingAttention}
        if sources is not None:
            sources[("llama", "patch_embeddings")] = {("a",)}
    assert LlamaForCausalLM not in fusion._FUSION_DISCOVERY_CACHE.get("patch_embeddings", {})
    assert sources is None or ("llama", "patch_embeddings") not in sources


def test_saved_attributes_are_put_back_or_removed() -> None:
    with isolated_patch_state() as snapshot:
        snapshot.save_attribute(LlamaAttention, "forward")
        snapshot.save_attribute(LlamaAttention, "brand_new")
        original = LlamaAttention.forward
        LlamaAttention.forward = lambda self: None
        LlamaAttention.brand_new = 1
    assert LlamaAttention.forward is original
    assert not hasattr(LlamaAttention, "brand_new")


class _AliasModule(types.ModuleType):
    """A backward-compat alias module whose listing imports a missing library (transformers 5.17)."""

    def __dir__(self) -> list[str]:
        raise ModuleNotFoundError("No module named 'torchvision'")

    def __getattr__(self, name: str) -> object:
        raise ModuleNotFoundError("No module named 'torchvision'")


def test_a_module_whose_listing_imports_does_not_crash_a_patched_load(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alias = "transformers.models.llama.image_processing_llama_alias"
    monkeypatch.setitem(sys.modules, alias, _AliasModule(alias))
    with isolated_patch_state():
        monkey_patching.register_patch_mapping({"LlamaAttention": RecordingAttention})
        model = LlamaForCausalLM.from_pretrained(checkpoint)
    assert type(model.model.layers[0].self_attn) is RecordingAttention
    assert modeling_llama.LlamaAttention is LlamaAttention


def _append_converter() -> None:
    conversion_mapping._checkpoint_conversion_mapping_cache["mixtral"].append(WeightRenaming("a", "b"))


def _replace_entry() -> None:
    conversion_mapping._checkpoint_conversion_mapping_cache["mixtral"] = [WeightRenaming("a", "b")]


def _swap_converters() -> None:
    converters = conversion_mapping._checkpoint_conversion_mapping_cache["mixtral"]
    converters[0], converters[-1] = converters[-1], converters[0]


def _rebind_mapping() -> None:
    monkey_patching._monkey_patch_mapping_cache["LlamaAttention"] = RecordingAttention


def _compile_pattern() -> None:
    monkey_patching._compiled_patterns_cache["Llama.*"] = object()


def _repoint_recorder() -> None:
    modeling_mixtral.MixtralPreTrainedModel._can_record_outputs["router_logits"].target_class = RecordingAttention


def _add_recorder() -> None:
    modeling_llama.LlamaPreTrainedModel._can_record_outputs["extra"] = RecordingAttention


def _rebind_saved_attribute() -> None:
    LlamaAttention.forward = lambda self: None


def _discover_fusion() -> None:
    fusion = pytest.importorskip("transformers.fusion_mapping", reason="fusion_mapping arrived in transformers 5.10")
    fusion._FUSION_DISCOVERY_CACHE.setdefault("patch_embeddings", {})[LlamaForCausalLM] = {"X": RecordingAttention}


@pytest.mark.parametrize("change", [
    _append_converter, _replace_entry, _swap_converters, _rebind_mapping, _compile_pattern,
    _repoint_recorder, _add_recorder, _rebind_saved_attribute, _discover_fusion,
])  # fmt: skip
def test_the_guards_fast_path_sees_every_change_restore_undoes(change: object) -> None:
    # unchanged() stands in for restore()+changes() in every test that patched nothing: a change
    # it misses is a leak never restored
    conversion_mapping.get_checkpoint_conversion_mapping("mixtral")  # the built-in table, as after any load
    guard = PatchStateGuard()
    snapshot = guard.snapshot
    snapshot.save_attribute(LlamaAttention, "forward")
    try:
        snapshot.settle()
        assert snapshot.unchanged()
        change()
        assert not snapshot.unchanged()
    finally:
        guard.restore()
    snapshot.settle()
    assert snapshot.unchanged()
