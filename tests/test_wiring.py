"""The plugin is cheap when unused and documents itself through pytest's own help."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_modelpatch import fixtures
from pytest_modelpatch.plugin import MARKERS, PLUGIN_FIXTURES, fixtures_of


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


@pytest.mark.fresh_interpreter  # the fork server imported the plugin before pytest's rewrite hook could look
def test_a_session_under_w_error_starts_and_pytest_rewrites_nothing_already_imported(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # plugin.py imported fixtures.py and also named it in pytest_plugins: on an editable install
    # (this repository's venv) pytest then warned that it could not rewrite it, and -W error, or
    # filterwarnings = error, failed every session at start
    pytester.makepyfile(
        """
def test_registry(patch_registry):
    assert dict(patch_registry.mapping) == {}
"""
    )
    # as a user runs it: the plugin found through its installation, not through the repository on PYTHONPATH
    # (with the repository on PYTHONPATH the warning never showed)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    result = pytester.runpytest_subprocess("-W", "error", "-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "PytestAssertRewriteWarning" not in result.stdout.str() + result.stderr.str()


def test_a_rank_under_w_error_starts_its_session(pytester: pytest.Pytester) -> None:
    # a rank process (python -m pytest_modelpatch.parallel.rank) imports the package before its pytest
    # starts: pytest warned that it could not rewrite it, and under -W error every parallel test failed.
    # It shows with the package imported from a path (the repository on PYTHONPATH here, pythonpath = .
    # in the repository's own runs), where pytest knows its modules' names
    pytester.makepyfile(
        """
import pytest
import torch.distributed as dist


@pytest.mark.parallel("ddp", world_size=2)
def test_in_two_ranks():
    assert dist.get_world_size() == 2
"""
    )
    result = pytester.runpytest_subprocess("-W", "error", "-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "PytestAssertRewriteWarning" not in result.stdout.str() + result.stderr.str()


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


def _decorated_fixtures(source: str) -> set[str]:
    """The functions of a module's source decorated with ``@pytest.fixture`` (or ``@pytest.fixture(...)``)."""
    found = set()
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            if ast.unparse(call.func if call else decorator) == "pytest.fixture":
                named = [k.value.value for k in (call.keywords if call else []) if k.arg == "name"]
                found.add(named[0] if named else node.name)
    return found


def test_every_fixture_of_fixtures_py_opts_a_test_in_to_leak_errors() -> None:
    assert PLUGIN_FIXTURES == _decorated_fixtures(Path(fixtures.__file__).read_text())
    assert {"device", "dtype", "reference_model", "patched_model", "patch_registry"} <= PLUGIN_FIXTURES


def test_a_new_fixture_defined_beside_them_counts_too() -> None:
    source = Path(fixtures.__file__).read_text() + (
        "\n\n@pytest.fixture\ndef tiny_tokenizer():\n    return None\n"
        "\n\n@pytest.fixture(name='seeded_inputs')\ndef _seeded_inputs():\n    return None\n"
    )
    namespace: dict[str, object] = {"__name__": "pytest_modelpatch.fixtures_copy"}
    exec(compile(source, fixtures.__file__, "exec"), namespace)
    assert fixtures_of(namespace) == PLUGIN_FIXTURES | {"tiny_tokenizer", "seeded_inputs"}
