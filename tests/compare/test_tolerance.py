"""Tolerance policies: per-dtype numbers, the magnitude-aware ulp term, and override precedence."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from pytest_modelpatch.compare._engine.tolerance import (
    DEFAULT_POLICY,
    DtypeTolerance,
    ToleranceOverride,
    TolerancePolicy,
    get_policy,
    resolve_tolerance,
    set_test_tolerance,
    ulp,
)
from pytest_modelpatch.errors import PatchUsageError


@pytest.fixture
def set_overrides() -> Iterator[Callable[..., None]]:
    """Set marker/ini overrides the way the plugin does around a test; undone at teardown."""
    resets: list[Callable[[], None]] = []
    yield lambda *overrides: resets.append(set_test_tolerance(*overrides))
    for reset in reversed(resets):
        reset()


@pytest.mark.parametrize(
    ("dtype", "atol", "rtol", "ulps"),
    # torch.testing's atol and rtol; 4 ulps, and 256 in float32: round-off between correct implementations (docs/tolerance.md)
    [
        (torch.float32, 1e-5, 1.3e-6, 256),
        (torch.float16, 1e-5, 1e-3, 4),
        (torch.bfloat16, 1e-5, 1.6e-2, 4),
        (torch.float64, 1e-7, 1e-7, 4),
    ],
)
def test_default_policy_uses_torch_testing_numbers(dtype: torch.dtype, atol: float, rtol: float, ulps: float) -> None:
    tolerance = resolve_tolerance().for_dtype(dtype)
    assert (tolerance.atol, tolerance.rtol, tolerance.ulps) == (atol, rtol, ulps)


def test_integer_outputs_compare_exactly_under_every_policy() -> None:
    for name in ("default", "loose"):
        assert resolve_tolerance(policy=name).for_dtype(torch.int64).exact


def test_ulp_is_the_spacing_of_the_dtype_at_that_magnitude() -> None:
    assert ulp(16.0, torch.bfloat16) == 0.125  # bf16 values in [16, 32) are 0.125 apart
    assert ulp(31.9, torch.bfloat16) == 0.125
    assert ulp(1.0, torch.float32) == torch.finfo(torch.float32).eps
    assert ulp(0.0, torch.float16) == 0.0
    assert torch.tensor(16.0, dtype=torch.bfloat16) + 0.125 != torch.tensor(16.0, dtype=torch.bfloat16)


def test_bf16_absolute_term_grows_with_the_tensor_magnitude() -> None:
    tolerance = resolve_tolerance().for_dtype(torch.bfloat16)
    assert tolerance.abs_term(0.5) == pytest.approx(4 * 2**-8)
    assert tolerance.abs_term(20.0) == 4 * 0.125
    assert tolerance.abs_term(0.0) == 1e-5  # the atol floor


def test_explicit_atol_replaces_the_ulp_term() -> None:
    tolerance = resolve_tolerance(atol=0.0).for_dtype(torch.bfloat16)
    assert tolerance.abs_term(20.0) == 0.0
    assert tolerance.rtol == 1.6e-2  # rtol still from the policy


def test_arguments_beat_marker_beat_ini_beat_policy(set_overrides: Callable[..., None]) -> None:
    set_overrides(ToleranceOverride(atol=1e-3, source="marker"), ToleranceOverride(atol=1e-2, rtol=1e-1, source="ini"))
    fp32 = resolve_tolerance().for_dtype(torch.float32)
    assert (fp32.atol, fp32.atol_source, fp32.rtol, fp32.rtol_source) == (1e-3, "marker", 1e-1, "ini")
    explicit = resolve_tolerance(rtol=0.5).for_dtype(torch.float32)
    assert (explicit.atol, explicit.rtol, explicit.rtol_source) == (1e-3, 0.5, "argument")


def test_test_overrides_are_gone_after_reset() -> None:
    reset = set_test_tolerance(ToleranceOverride(atol=0.5, source="marker"))
    assert resolve_tolerance().for_dtype(torch.float32).atol == 0.5
    reset()
    assert resolve_tolerance().for_dtype(torch.float32).atol == 1e-5


def test_marker_can_choose_a_named_policy(set_overrides: Callable[..., None]) -> None:
    set_overrides(ToleranceOverride.from_marker((), {"policy": "strict"}))
    assert resolve_tolerance().for_dtype(torch.bfloat16).exact
    assert "marker" in str(resolve_tolerance())


def test_marker_rejects_positional_and_unknown_arguments() -> None:
    with pytest.raises(PatchUsageError, match=r"keyword arguments atol=, rtol=, policy=.*unknown \['tol'\]"):
        ToleranceOverride.from_marker((), {"tol": 1e-3}, where="test_x.py::test_a")
    with pytest.raises(PatchUsageError, match="positional"):
        ToleranceOverride.from_marker((1e-3,), {})


@pytest.mark.parametrize("value", [-1.0, "abc", float("nan"), True])
def test_bad_tolerance_values_are_usage_errors_naming_the_source(value: object) -> None:
    with pytest.raises(PatchUsageError, match=r"ini modelpatch_atol: atol=.* is not a non-negative number"):
        ToleranceOverride.from_ini(value, None)


def test_ini_strings_are_parsed_and_empty_means_unset() -> None:
    override = ToleranceOverride.from_ini("1e-4", "")
    assert (override.atol, override.rtol, override.source) == (1e-4, None, "ini")


def test_unknown_policy_name_lists_the_known_ones() -> None:
    with pytest.raises(
        PatchUsageError,
        match=r"unknown tolerance policy 'tight'.*\['default', 'loose', 'oracle', 'sqnr', 'strict'\], 'sqnr:DB'",
    ):
        get_policy("tight")
    with pytest.raises(PatchUsageError, match=r"sqnr='loud' is not a non-negative number"):
        get_policy("sqnr:loud")


def test_custom_policy_entries_and_fallback_for_other_float_dtypes() -> None:
    policy = TolerancePolicy("mine", {"bfloat16": DtypeTolerance(atol=0.1, rtol=0.2, ulps=1)})
    assert resolve_tolerance(policy=policy).for_dtype(torch.float8_e4m3fn).atol == 0.1
    assert resolve_tolerance(policy=policy).for_dtype(torch.float32).atol == 0.1  # fallback entry
    assert DEFAULT_POLICY.entry(torch.float8_e5m2).rtol == 1.6e-2


def test_tolerance_text_says_where_each_number_came_from() -> None:
    text = str(resolve_tolerance(rtol=1e-3).for_dtype(torch.float32))
    assert text == "atol=1e-05 or 256 ulps of max|ref| (policy 'default'), rtol=0.001 (argument) at float32"


def test_marker_and_ini_reach_assert_equivalent_in_a_real_run(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmodelpatch_atol = 1e-6\nmodelpatch_rtol = 0\n")
    pytester.makepyfile(
        """
        import pytest
        import torch
        from pytest_modelpatch.compare.forward.equivalence import assert_equivalent

        class Scale(torch.nn.Module):
            def __init__(self, factor):
                super().__init__()
                self.factor = torch.nn.Parameter(torch.tensor(factor))

            def forward(self, x):
                return x * self.factor

        INPUTS = {"x": torch.ones(3)}

        def test_ini_applies():
            assert_equivalent(Scale(1.0), Scale(1.001), INPUTS)

        @pytest.mark.tolerance(atol=1e-2)
        def test_marker_beats_ini():
            assert_equivalent(Scale(1.0), Scale(1.001), INPUTS)

        @pytest.mark.tolerance(atol=1e-2)
        def test_argument_beats_marker():
            assert_equivalent(Scale(1.0), Scale(1.001), INPUTS, atol=0.0)

        @pytest.mark.tolerance(tol=1e-2)
        def test_misspelled_marker_argument():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*PatchUsageError: @pytest.mark.tolerance on *test_misspelled_marker_argument: takes only keyword arguments*",
            "*test_ini_applies*",
            "E*tolerance: atol=1e-06, rtol=0 at float32 (ini)",
            "*test_argument_beats_marker*",
            "E*tolerance: atol=0 (argument), rtol=0 (ini) at float32",
        ]
    )


# ---------------------------------------------------------------------------
# sqnr: a whole tensor judged by its signal-to-quantization-noise ratio
# ---------------------------------------------------------------------------


def test_sqnr_policy_has_per_dtype_defaults_and_a_named_threshold() -> None:
    assert resolve_tolerance(policy="sqnr").for_dtype(torch.bfloat16).min_sqnr_db == 25.0
    assert resolve_tolerance(policy="sqnr").for_dtype(torch.float32).min_sqnr_db == 30.0
    assert resolve_tolerance(policy="sqnr:55").for_dtype(torch.float16).min_sqnr_db == 55.0
    assert (
        str(resolve_tolerance(policy="sqnr:55").for_dtype(torch.float32))
        == "SQNR >= 55 dB at float32 (policy 'sqnr:55')"
    )


def test_sqnr_is_ten_log10_of_signal_over_noise() -> None:
    from pytest_modelpatch.compare._engine.outputs import compare_tensors, sqnr_db

    reference = torch.ones(100, dtype=torch.float64)
    assert sqnr_db(reference, reference + 0.01) == pytest.approx(40.0)  # signal 100, noise 0.01
    assert sqnr_db(reference, reference) == float("inf")
    spec = resolve_tolerance(policy="sqnr:39")
    assert compare_tensors("x", reference, reference + 0.01, spec).passed
    failing = compare_tensors("x", reference, reference + 0.01, resolve_tolerance(policy="sqnr:41"))
    assert not failing.passed and failing.over == 100
    assert "x: shape (100,) float64: SQNR 40.0 dB, below the minimum 41 dB" in str(failing)


INT8_SUITE = """
import pytest
from fixtures.patches import llama_int8_mlp
from pytest_modelpatch import assert_equivalent, check_equivalent

INT8 = pytest.mark.patch(llama_int8_mlp.MAPPING)


@pytest.mark.model("llama")
@INT8
def test_default_policy_calls_quantization_a_bug(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@INT8
@pytest.mark.tolerance(policy="sqnr")
def test_sqnr_marker(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
    check_equivalent(reference_model, patched_model, max_examples=5)


@pytest.mark.model("llama")
@INT8
def test_sqnr_argument_at_a_stricter_threshold(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model, policy="sqnr:60")


@pytest.mark.model("llama")
@pytest.mark.dtypes("bfloat16")
@INT8
def test_sqnr_from_ini_in_bfloat16(reference_model, patched_model):
    report = assert_equivalent(reference_model, patched_model)
    assert str(report).endswith("tolerance: policy 'sqnr' (ini)")
"""


def test_int8_weight_only_patch_passes_sqnr_and_fails_a_stricter_threshold(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_int8=INT8_SUITE)
    pytester.makeini("[pytest]\nmodelpatch_tolerance_policy = sqnr\n")
    result = pytester.runpytest("-p", "no:randomly", "-k", "sqnr")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*test_sqnr_argument_at_a_stricter_threshold*",
        "E*logits: shape (2, 8, 256) float32: SQNR *.* dB, below the minimum 60 dB*",
        "E*tolerance: SQNR >= 60 dB at float32 (policy 'sqnr:60')",
    ])  # fmt: skip
    default = pytester.runpytest("-p", "no:randomly", "-k", "default_policy", "-o", "modelpatch_tolerance_policy=")
    default.assert_outcomes(failed=1)
    default.stdout.fnmatch_lines(["E*logits: shape (2, 8, 256) float32: *elements over tolerance*"])


# ---------------------------------------------------------------------------
# oracle: no worse against a float64 run than the reference itself
# ---------------------------------------------------------------------------

ORACLE_SUITE = """
import pytest
from fixtures.patches import llama_reordered_mlp
from pytest_modelpatch import assert_equivalent, check_equivalent


@pytest.mark.model("llama")
@pytest.mark.dtypes("float16", "bfloat16")
@pytest.mark.patch(llama_reordered_mlp.MAPPING)
@pytest.mark.tolerance(policy="oracle")
def test_reordered_accumulation(reference_model, patched_model):
    report = assert_equivalent(reference_model, patched_model)
    assert not all(c.max_abs == 0 for c in report.comparisons)  # it does round differently
    check_equivalent(reference_model, patched_model, max_examples=5)


@pytest.mark.model("llama")
@pytest.mark.dtypes("float32", "float16", "bfloat16")
@pytest.mark.patch(llama_reordered_mlp.BIAS_MAPPING)
def test_bias(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model, policy="oracle")
"""


def test_reordered_accumulation_passes_oracle_and_a_small_bias_fails_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_oracle=ORACLE_SUITE)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=3)
    result.stdout.fnmatch_lines([
        "*test_bias?bfloat16?*",
        "E*tolerance: rmse against float64 <= 2 x the reference's + 0.001 at bfloat16 (policy 'oracle')",
        "E*logits: shape (2, 8, 256) bfloat16: rmse against float64 0.0*, more than allowed 0.0* "
        "(2 x the reference's 0.00* + 0.001)*",
    ])  # fmt: skip
    result.stdout.fnmatch_lines(
        ["FAILED test_oracle.py::test_bias[[]float32[]]*", "FAILED test_oracle.py::test_bias[[]float16[]]*"]
    )


def test_oracle_policy_numbers_and_names() -> None:
    from pytest_modelpatch.compare._engine.tolerance import oracle_policy

    tolerance = resolve_tolerance(policy="oracle").for_dtype(torch.bfloat16)
    assert (tolerance.oracle_factor, tolerance.oracle_floor) == (2.0, 1e-3)
    assert resolve_tolerance(policy="oracle:3").for_dtype(torch.float32).oracle_factor == 3.0
    assert oracle_policy(4, {"float32": 0.0}).entry("float32").oracle_floor == 0.0
    assert resolve_tolerance(policy="oracle").uses_oracle and not resolve_tolerance().uses_oracle
