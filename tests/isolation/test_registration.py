"""patch_registry and registration-time validation: clear errors before anything is registered."""

from __future__ import annotations

import pytest
import torch
from transformers import monkey_patching
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from pytest_modelpatch import PatchUsageError
from pytest_modelpatch.isolation import PatchRegistry


class FusedAttention(LlamaAttention):
    pass


class NotAModule:
    pass


def test_register_unregister_and_read_only_mapping(patch_registry: PatchRegistry) -> None:
    patch_registry.register({"LlamaAttention": FusedAttention, ".*MLP$": FusedAttention})
    assert dict(patch_registry.mapping) == {"LlamaAttention": FusedAttention, ".*MLP$": FusedAttention}
    with pytest.raises(TypeError):
        patch_registry.mapping["LlamaMLP"] = FusedAttention
    patch_registry.unregister(".*MLP$")
    assert dict(patch_registry.mapping) == {"LlamaAttention": FusedAttention}


def test_registered_conversions_are_visible_then_gone() -> None:
    rename = WeightRenaming(source_patterns="gate_proj", target_patterns="w1")
    registry = PatchRegistry()
    try:
        registry.register(conversions={"llama": [rename]})
        assert [t.source_patterns for t in get_checkpoint_conversion_mapping("llama")] == [["gate_proj"]]
        assert list(registry.conversions) == ["llama"]
    finally:
        registry.close()
    assert get_checkpoint_conversion_mapping("llama") is None
    assert monkey_patching.get_patch_mapping() == {}


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"(": FusedAttention}, r"patch key '\(' is not a valid regex .*re\.escape"),
        ({"LlamaAttention": NotAModule}, r"must subclass torch.nn.Module.*NotAModule inherits from object"),
        ({"LlamaAttention": FusedAttention.__init__}, r"must be a class, got function"),
        ({"LlamaMLP": torch.nn.Linear(2, 2)}, r"pass the class itself, Linear, not an instance of it"),
        ({"": FusedAttention}, r"must be a non-empty string"),
        ([("LlamaAttention", FusedAttention)], r"must be a dict"),
    ],
    ids=["invalid-regex", "not-a-module", "not-a-class", "instance", "empty-key", "not-a-dict"],
)
def test_bad_mapping_is_a_usage_error_and_registers_nothing(
    patch_registry: PatchRegistry, mapping: object, message: str
) -> None:
    with pytest.raises(PatchUsageError, match=message):
        patch_registry.register({"LlamaMLP": FusedAttention, **mapping} if isinstance(mapping, dict) else mapping)
    assert dict(patch_registry.mapping) == {}


def test_taken_key_needs_overwrite(patch_registry: PatchRegistry) -> None:
    patch_registry.register({"LlamaMLP": FusedAttention})
    with pytest.raises(PatchUsageError, match=r"already registered.*overwrite=True"):
        patch_registry.register({"LlamaMLP": LlamaMLP})
    patch_registry.register({"LlamaMLP": LlamaMLP}, overwrite=True)
    assert patch_registry.mapping["LlamaMLP"] is LlamaMLP


def test_bad_conversions_are_usage_errors(patch_registry: PatchRegistry) -> None:
    with pytest.raises(PatchUsageError, match=r"conversions\['llama'\] must be a list of WeightConverter"):
        patch_registry.register(conversions={"llama": ["q_proj"]})
    with pytest.raises(PatchUsageError, match="must be a dict"):
        patch_registry.register(conversions=[WeightRenaming("a", "b")])


def test_unregister_unknown_key_lists_registered_keys(patch_registry: PatchRegistry) -> None:
    patch_registry.register({"LlamaMLP": FusedAttention})
    with pytest.raises(
        PatchUsageError, match=r"cannot unregister \['LlamaAttention'\].*Registered keys: \['LlamaMLP'\]"
    ):
        patch_registry.unregister(["LlamaAttention"])


MARKER_ERRORS = [
    ("@pytest.mark.patch({'(': Attn})", "*patch key '(' is not a valid regex*re.escape*"),
    ("@pytest.mark.patch({'LlamaAttention': Plain})", "*must subclass torch.nn.Module*"),
    ("@pytest.mark.patch({'LlamaAttention': len})", "*must be a class, got builtin_function_or_method*"),
    (
        "@pytest.mark.patch({'LlamaAttention': Attn}, overwirte=True)",
        "*unknown keyword(s) ?'overwirte'?*It takes mapping*",
    ),
    ("@pytest.mark.patch({'LlamaAttention': Attn}, {'LlamaMLP': Attn})", "*takes one positional argument*"),
    ("@pytest.mark.patch(context=42)", "*context must be a callable returning a context manager*"),
    ("@pytest.mark.patch(context=lambda: 1)", "*must return a context manager, got int*contextmanager*"),
    ("@pytest.mark.patch(methods=[Plain])", "*must declare _PATCHED_CLASS_*_PATCHES_*"),
    ("@pytest.mark.patch(['LlamaAttention'])", "*mapping must be a dict {class name or regex: replacement class}*"),
    (
        "@pytest.mark.patch(conversions=[1])",
        "*conversions must be a dict {model_type: ?WeightConverter, ...?}, got list*",
    ),
]


def test_marker_misuse_is_a_clear_setup_error(pytester: pytest.Pytester) -> None:
    tests = "\n".join(
        f"{decorator}\ndef test_misuse_{i}():\n    pass\n" for i, (decorator, _) in enumerate(MARKER_ERRORS)
    )
    pytester.makepyfile(
        f"""
import pytest
from transformers.models.llama.modeling_llama import LlamaAttention


class Attn(LlamaAttention):
    pass


class Plain:
    pass


{tests}
"""
    )
    result = pytester.runpytest("-p", "no:xdist")
    result.assert_outcomes(errors=len(MARKER_ERRORS))
    for i, (_, expected) in enumerate(MARKER_ERRORS):
        result.stdout.fnmatch_lines([f"*ERROR at setup of test_misuse_{i} *", f"PatchUsageError: {expected}"])
