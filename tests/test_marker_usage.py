"""A wrong marker fails its own test, with the fix in the message, and the rest of the session runs."""

from __future__ import annotations

import pytest
from _support.runs import IN_ORDER

BAD_MARKERS = {
    "both": ('@pytest.mark.model("llama", families="all")', "reference_model",
             "*families= chooses the model types; drop the positional 'llama'*"),
    "no_mapping": ('@pytest.mark.model(families="patched")', "reference_model", "*no class mapping or method patch*"),
    "dtype_typo": ('@pytest.mark.dtypes("float23")', "dtype", "*@pytest.mark.dtypes('float23',) on *"),
    "device_typo": ('@pytest.mark.devices("cpuu")', "device", "*@pytest.mark.devices('cpuu',) on *"),
    "misspelled": ('@pytest.mark.patches({"LlamaMLP": object})', "device",
                   "*@pytest.mark.patches is not a marker pytest-modelpatch knows*Did you mean @pytest.mark.patch?*"),
}  # fmt: skip


def test_a_bad_marker_fails_its_test_and_every_other_test_runs(pytester: pytest.Pytester) -> None:
    cases = "".join(
        f"\n\n{marks}\ndef test_{case}({fixture}):\n    pass\n" for case, (marks, fixture, _) in BAD_MARKERS.items()
    )
    pytester.makepyfile(
        test_bad="import pytest\n" + cases,
        test_good="import pytest\n\n\n@pytest.mark.parametrize('n', [1, 2])\ndef test_runs(n):\n    assert n\n",
    )
    result = pytester.runpytest(*IN_ORDER, "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=2, errors=len(BAD_MARKERS))
    assert "Interrupted" not in result.stdout.str()
    for case, (_, _, message) in BAD_MARKERS.items():
        result.stdout.fnmatch_lines([f"*ERROR at setup of test_{case}*", f"PatchUsageError: {message}"])
    assert "_caller.py" not in result.stdout.str()  # the message, not a traceback through pluggy and the plugin


def test_a_bad_marker_on_a_parametrized_test_fails_each_of_its_items(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.parametrize("n", [1, 2, 3])
        @pytest.mark.dtypes("bfloat61")
        def test_each(n, dtype):
            pass


        def test_other():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:randomly", "-n", "2")
    result.assert_outcomes(passed=1, errors=3)
    for n in (1, 2, 3):
        result.stdout.fnmatch_lines(
            [f"*ERROR at setup of test_each[[]{n}[]]*", "PatchUsageError: @pytest.mark.dtypes('bfloat61',)*"]
        )


@pytest.mark.parametrize("name", ["patches", "modell", "paralel", "dtype", "toleranse"])
def test_a_mark_close_to_a_plugin_marker_fails_with_did_you_mean(pytester: pytest.Pytester, name: str) -> None:
    pytester.makepyfile(f"import pytest\n\n\n@pytest.mark.{name}\ndef test_marked():\n    pass\n")
    result = pytester.runpytest(*IN_ORDER)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*@pytest.mark.{name} is not a marker pytest-modelpatch knows*Did you mean*"])


def test_a_registered_or_unrelated_mark_is_left_alone(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    models: a marker of the project's own\n")
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.models
        @pytest.mark.slow
        def test_marked():
            pass
        """
    )
    result = pytester.runpytest(*IN_ORDER, "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=1)


def test_under_strict_markers_pytest_refuses_the_file_and_says_did_you_mean(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("import pytest\n\n\n@pytest.mark.patches({})\ndef test_marked():\n    pass\n")
    result = pytester.runpytest(*IN_ORDER, "--strict-markers")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'patches' not found in `markers` configuration option*",
                                 "PatchUsageError: @pytest.mark.patches is not a marker pytest-modelpatch knows. "
                                 "Did you mean @pytest.mark.patch?"])  # fmt: skip
