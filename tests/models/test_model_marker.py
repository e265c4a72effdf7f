"""@pytest.mark.model keywords: each one reaches both models, or the mark is refused naming the key."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
from _support.runs import IN_ORDER

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.models.builder import ModelRequest


def test_both_built_models_carry_every_override(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        from fixtures.patches import llama_fused_qkv as fused

        @pytest.mark.model("llama", num_hidden_layers=3, rms_norm_eps=1e-5, attn_implementation="eager",
                           seed=3, init="transformers")
        @pytest.mark.patch(fused.MAPPING, conversions=fused.CONVERSIONS)
        def test_overrides(reference_model, patched_model):
            for model in (reference_model, patched_model):
                assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
                assert model.config.rms_norm_eps == 1e-5
                assert model.config._attn_implementation == "eager"
                assert torch.equal(model.model.norm.weight, torch.ones(64))  # init="transformers"
            assert type(patched_model.model.layers[0].self_attn).__name__ == "LlamaFusedQKVAttention"

        @pytest.mark.model("llama", seed=3)
        def test_seed_changes_the_weights(reference_model):
            assert not torch.equal(reference_model.model.norm.weight, torch.ones(64))
        """
    )
    pytester.runpytest(*IN_ORDER).assert_outcomes(passed=2)


def test_attn_implementation_reaches_the_models_it_hides_a_sdpa_only_bug(pytester: pytest.Pytester) -> None:
    # the non-causal patch is correct under eager and wrong under sdpa: the mark decides the outcome
    pytester.makepyfile(
        """
        import pytest
        from fixtures.patches import llama_fused_qkv_noncausal as broken
        from pytest_modelpatch import assert_equivalent

        def check(reference, patched, impl):
            assert reference.config._attn_implementation == patched.config._attn_implementation == impl
            assert_equivalent(reference, patched)

        @pytest.mark.model("llama", attn_implementation="eager")
        @pytest.mark.patch(broken.MAPPING, conversions=broken.CONVERSIONS)
        def test_eager(reference_model, patched_model):
            check(reference_model, patched_model, "eager")

        @pytest.mark.model("llama", attn_implementation="sdpa")
        @pytest.mark.patch(broken.MAPPING, conversions=broken.CONVERSIONS)
        def test_sdpa(reference_model, patched_model):
            check(reference_model, patched_model, "sdpa")
        """
    )
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*_ test_sdpa _*", "*AssertionError: patched LlamaForCausalLM differs from reference*"]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_hiden_layers": 5}, "config override num_hiden_layers=5 is not a field of LlamaConfig*Did you mean 'num_hidden_layers'"),
        ({"attn_implementation": "eagr"}, "attn_implementation='eagr' is not an attention implementation. Did you mean 'eager'"),
        ({"dtype": "bf16"}, "dtype='bf16' is not a model override*@pytest.mark.dtypes('bfloat16')"),
        ({"torch_dtype": "bf16"}, "torch_dtype='bf16' is not a model override"),
        ({"init": "xavier"}, "init='xavier' is not a weight scheme"),
        ({"seed": "1"}, "seed must be an int"),
        ({"fusion_config": {"patch_embedding": True}}, "fusion_config key 'patch_embedding' is not a transformers fusion. Did you mean 'patch_embeddings'"),
    ],
)  # fmt: skip
def test_a_wrong_keyword_is_refused_naming_the_key_and_the_closest_names(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PatchUsageError) as refused:
        ModelRequest.from_marker(("llama",), kwargs, "test_x.py::test_a")
    assert refused.match("^@pytest.mark.model on test_x.py::test_a: ")
    assert fnmatch(str(refused.value), f"*{message}*"), str(refused.value)


def test_a_sub_config_override_is_checked_against_the_sub_config() -> None:
    assert ModelRequest.from_marker(("llava",), {"text_config": {"num_hidden_layers": 1}}, "t").overrides
    with pytest.raises(PatchUsageError, match=r"text_config.num_layers=1 is not a field of LlamaConfig"):
        ModelRequest.from_marker(("llava",), {"text_config": {"num_layers": 1}}, "t")


def test_an_alias_from_the_attribute_map_is_a_valid_override() -> None:
    request = ModelRequest.from_marker(("gpt2",), {"num_hidden_layers": 1, "n_head": 2}, "t")
    assert dict(request.overrides) == {"num_hidden_layers": 1, "n_head": 2}


def test_seed_and_init_are_refused_for_a_checkpoint_with_its_own_weights(tmp_path: Path) -> None:
    from pytest_modelpatch.families.catalog import tiny_config
    from pytest_modelpatch.models.checkpoints import cached_checkpoint

    path = cached_checkpoint(tiny_config("llama"), cache_dir=tmp_path)
    with pytest.raises(PatchUsageError, match=r"seed shape the seeded tiny checkpoints, but .* has its own weights"):
        ModelRequest.from_marker((str(path),), {"seed": 1}, "t")


def test_a_misspelled_override_is_a_setup_error_in_a_real_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.model("llama", num_hiden_layers=5)
        def test_typo(reference_model):
            pass
        """
    )
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*num_hiden_layers=5 is not a field of LlamaConfig*Did you mean 'num_hidden_layers'?*"]
    )


# Counts the calls of the name resolve_model_spec reaches tiny_config by, per test item. The
# lint's tiny meta-device structures read the catalog directly, once per process (cached): they
# are not the test's model request, so they are not counted.
COUNT_RESOLUTIONS = """
import collections

import pytest

from pytest_modelpatch.models import specs

RESOLVED = collections.Counter()
RUNNING = [None]
_tiny_config = specs.tiny_config


def counting_tiny_config(model_type, **overrides):
    RESOLVED[RUNNING[0]] += 1
    return _tiny_config(model_type, **overrides)


specs.tiny_config = counting_tiny_config


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    RUNNING[0] = item.nodeid
    try:
        return (yield)
    finally:
        RUNNING[0] = None


def pytest_terminal_summary(terminalreporter):
    for nodeid, count in sorted(RESOLVED.items(), key=str):
        terminalreporter.write_line(f"RESOLVED {nodeid} {count}")
"""


def test_each_test_resolves_its_model_request_once(pytester: pytest.Pytester) -> None:
    # the patch mark's lint, both model fixtures and the patched load's key check read one request
    pytester.makeconftest(COUNT_RESOLUTIONS)
    pytester.makepyfile(
        test_once="""
        import pytest
        from fixtures.patches import llama_fused_qkv as fused

        @pytest.mark.model("llama")
        @pytest.mark.patch(fused.MAPPING, conversions=fused.CONVERSIONS)
        def test_patched_pair(reference_model, patched_model):
            assert type(patched_model.model.layers[0].self_attn).__name__ == "LlamaFusedQKVAttention"

        @pytest.mark.model("llama", num_hidden_layers=3)
        def test_reference_only(reference_model):
            assert len(reference_model.model.layers) == 3

        def test_without_models():
            pass
        """
    )
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(passed=3)
    counts = {line.split()[1]: int(line.split()[2]) for line in result.outlines if line.startswith("RESOLVED ")}
    assert counts == {"test_once.py::test_patched_pair": 1, "test_once.py::test_reference_only": 1}
