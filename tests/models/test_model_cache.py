"""ini modelpatch_model_cache: reference models released least recently used first, rebuilt and verified when asked again."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_modelpatch.errors import PatchUsageError
from pytest_modelpatch.models.builder import ModelBuilder, ModelRequest
from pytest_modelpatch.models.memory_cache import CacheBound, model_bytes, parse_model_cache
from pytest_modelpatch.models.reference import reference_problems


def test_the_bound_is_a_count_or_a_size_and_anything_else_says_how_to_write_it() -> None:
    assert parse_model_cache("") == CacheBound()
    assert parse_model_cache("8") == CacheBound(count=8)
    assert parse_model_cache("512MB") == CacheBound(max_bytes=512 << 20)
    assert parse_model_cache("1.5 gb") == CacheBound(max_bytes=int(1.5 * (1 << 30)))
    for bad in ("0", "-1", "lots", "12 parsecs", "0MB"):
        with pytest.raises(PatchUsageError, match=r"expected a number of models \(e.g. 8\) or a size \(e.g. 512MB"):
            parse_model_cache(bad)


def _seeded(seed: int) -> ModelRequest:
    return ModelRequest("llama", seed=seed)


def test_the_least_recently_used_reference_is_released_and_rebuilt_pristine(tmp_path: Path) -> None:
    builder = ModelBuilder(tmp_path, model_cache=CacheBound(count=2))
    first, second = builder.reference(_seeded(0)), builder.reference(_seeded(1))
    assert builder.reference(_seeded(0)) is first  # a hit makes seed 0 the most recently used
    builder.reference(_seeded(2))  # over the bound: seed 1, the least recently used, goes
    assert len(builder._references) == 2 and builder._references.released == 1
    assert builder.reference(_seeded(0)) is first
    again = builder.reference(_seeded(1))
    assert again is not second and reference_problems(again) == []
    assert again.state_dict()["lm_head.weight"].equal(second.state_dict()["lm_head.weight"])  # same checkpoint


def test_a_size_bound_counts_parameters_and_buffers(tmp_path: Path) -> None:
    unbounded = ModelBuilder(tmp_path)
    size = model_bytes(unbounded.reference(_seeded(0)))
    assert size > 0
    builder = ModelBuilder(tmp_path, model_cache=CacheBound(max_bytes=int(size * 2.5)))
    for seed in range(4):
        builder.reference(_seeded(seed))
    assert len(builder._references) == 2 and builder._references.total_bytes <= size * 2.5
    for seed in range(4):
        unbounded.reference(_seeded(seed))
    assert len(unbounded._references) == 4  # no bound: every reference stays, as before


def test_a_cached_reference_that_was_tampered_with_is_not_handed_out_again(tmp_path: Path) -> None:
    builder = ModelBuilder(tmp_path, model_cache=CacheBound(count=2))
    reference = builder.reference(_seeded(0))
    mlp = reference.model.layers[0].mlp
    mlp.__class__ = type("TamperedMLP", (type(mlp),), {})
    assert reference_problems(reference)
    fresh = builder.reference(_seeded(0))
    assert fresh is not reference and reference_problems(fresh) == []


SUITE = """
import pytest
from pytest_modelpatch import assert_equivalent

@pytest.mark.parametrize("seed", [0, 1, 2, 0, 1, 2])
def test_seeds(model_builder, seed, request):
    from pytest_modelpatch.models.builder import ModelRequest
    reference = model_builder.reference(ModelRequest("llama", seed=seed))
    patched = model_builder.patched(ModelRequest("llama", seed=seed), unpatched=True)
    assert_equivalent(reference, patched)
    assert len(model_builder._references) <= 1
"""


def test_a_session_under_a_one_model_bound_passes_and_a_bad_bound_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_seeds=SUITE)
    pytester.makeini("[pytest]\nmodelpatch_model_cache = 1\n")
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=6)
    pytester.makeini("[pytest]\nmodelpatch_model_cache = lots\n")
    result = pytester.runpytest("-p", "no:randomly")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*modelpatch_model_cache = 'lots': expected a number of models (e.g. 8) or a size*"])
