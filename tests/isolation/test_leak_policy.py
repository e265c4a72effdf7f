"""Leak policy by opt-in: a suite that merely has the plugin installed keeps its outcomes.

A test that uses a modelpatch marker or fixture fails on a leak; one that uses none has it
restored and warned; ``modelpatch_leaks`` (ini) or ``--modelpatch-leaks`` set explicitly
applies to every test. The terminal summary counts the leaks either way.
"""

from __future__ import annotations

import pytest

SUITE = """
import pytest
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.monkey_patching import get_patch_mapping, register_patch_mapping


class FastNorm(LlamaRMSNorm):
    pass


def test_1_plain_leaks_like_a_kernel_library():
    modeling_llama.LlamaRMSNorm = FastNorm  # rebinding a modeling global, as instance patchers do


def test_2_plain_leaks_a_registration():
    register_patch_mapping({"LlamaRMSNorm": FastNorm})


def test_3_plain_sees_everything_restored():
    assert modeling_llama.LlamaRMSNorm is LlamaRMSNorm and get_patch_mapping() == {}


@pytest.mark.model("llama")
def test_4_marked_leaks():
    register_patch_mapping({"LlamaRMSNorm": FastNorm})


def test_5_fixture_user_leaks(patch_registry):
    modeling_llama.LlamaRMSNorm = FastNorm


def test_6_after_all():
    assert modeling_llama.LlamaRMSNorm is LlamaRMSNorm and get_patch_mapping() == {}
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_suite=SUITE)
    return pytester.runpytest("-p", "no:randomly", "-rA", *args)


def test_by_default_plain_tests_warn_and_tests_that_use_the_plugin_fail(pytester: pytest.Pytester) -> None:
    result = _run(pytester)
    result.assert_outcomes(passed=6, errors=2, warnings=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_4_marked_leaks*",
            "*ERROR at teardown of test_5_fixture_user_leaks*",
        ],
        consecutive=False,
    )
    result.stdout.fnmatch_lines(
        [
            "*ModelPatchWarning: test_suite.py::test_1_plain_leaks_like_a_kernel_library leaked transformers patch state*",
            "*It uses none of pytest-modelpatch's markers or fixtures, so this is a warning*",
        ]
    )
    result.stdout.fnmatch_lines(["*test_2_plain_leaks_a_registration leaked*"])
    result.stdout.fnmatch_lines(
        ["modelpatch: 4 leak(s) of transformers patch state restored: 2 failed their test, 2 warned*"]
    )


def test_the_default_is_the_same_under_xdist(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "-n", "2")
    result.assert_outcomes(passed=6, errors=2, warnings=2)
    result.stdout.fnmatch_lines(
        ["modelpatch: 4 leak(s) of transformers patch state restored: 2 failed their test, 2 warned*"]
    )


@pytest.mark.parametrize("how", ["ini", "option"])
def test_error_set_explicitly_fails_every_leaking_test(pytester: pytest.Pytester, how: str) -> None:
    if how == "ini":
        pytester.makeini("[pytest]\nmodelpatch_leaks = error\n")
        result = _run(pytester)
    else:
        result = _run(pytester, "--modelpatch-leaks=error")
    result.assert_outcomes(passed=6, errors=4)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_1_plain_leaks_like_a_kernel_library*"], consecutive=False)
    result.stdout.fnmatch_lines(
        ["modelpatch: 4 leak(s) of transformers patch state restored: 4 failed their test, 0 warned*"]
    )


def test_warn_set_explicitly_warns_tests_that_use_the_plugin_too(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmodelpatch_leaks = warn\n")
    result = _run(pytester)
    result.assert_outcomes(passed=6, warnings=4)
    result.stdout.fnmatch_lines(
        ["*test_4_marked_leaks leaked*", "*Set modelpatch_leaks = warn or off to relax this check*"]
    )
    result.stdout.fnmatch_lines(
        ["modelpatch: 4 leak(s) of transformers patch state restored: 0 failed their test, 4 warned"]
    )


def test_the_option_overrides_the_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmodelpatch_leaks = error\n")
    result = _run(pytester, "--modelpatch-leaks=warn")
    result.assert_outcomes(passed=6, warnings=4)
    bad = _run(pytester, "--modelpatch-leaks=loud")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*modelpatch_leaks = 'loud': use one of error, warn, off*"])


def test_without_any_leak_nothing_is_printed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_quiet():\n    pass\n")
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*modelpatch:*leak*")
