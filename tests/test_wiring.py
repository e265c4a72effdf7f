"""The plugin is cheap when unused and documents itself through pytest's own help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pytest_modelpatch.plugin import MARKERS


def test_importing_the_plugin_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, pytest_modelpatch, pytest_modelpatch.plugin, pytest_modelpatch.errors;"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules);"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "HEAVY []"


@pytest.mark.fresh_interpreter  # what the session imports is the point: not a fork of an interpreter with torch
def test_a_session_not_using_the_plugin_never_imports_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import sys


def pytest_sessionfinish(session):
    print("HEAVY", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    )
    pytester.makepyfile("def test_plain():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest("-s", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*plugins:*modelpatch*", "*HEAVY ?]"])


def test_markers_are_listed_with_signatures(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines_random(
        [
            "@pytest.mark.patch(mapping=None, *, conversions=None, overwrite=False, methods=None, allow=None, "
            "context=None, **context_kwargs):*",
            "@pytest.mark.cpu:*",
            "@pytest.mark.gpu:*",
            "@pytest.mark.devices(*names):*",
            "@pytest.mark.dtypes(*dtypes):*",
        ]
    )
    assert len(MARKERS) >= 5


def test_options_are_in_one_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "verify patched transformers models (pytest-modelpatch):",
            "*--modelpatch-device=DEVICE*",
            "*--modelpatch-require-gpu*",
        ]
    )
    result.stdout.fnmatch_lines(["*modelpatch_leaks (string):*"])


def test_every_public_name_resolves() -> None:
    import pytest_modelpatch

    missing = [name for name in pytest_modelpatch.__all__ if getattr(pytest_modelpatch, name, None) is None]
    assert missing == []
