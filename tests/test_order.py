"""The suite does not depend on test order: pytester runs keep file order unless they test ordering."""

from __future__ import annotations

import pytest

ORDERED = """
SEEN = []


def test_a_first():
    SEEN.append("a")


def test_b_second():
    assert SEEN == ["a"]
"""


def test_pytester_runs_keep_file_order_with_pytest_randomly_installed(pytester: pytest.Pytester) -> None:
    # tests/conftest.py adds -p no:randomly to every pytester run: without it, randomly
    # would shuffle these two and fail test_b about half the time.
    pytester.makepyfile(ORDERED)
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*--randomly-seed=*")


@pytest.mark.tests_ordering
def test_a_run_marked_tests_ordering_keeps_pytest_randomly(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_randomly", reason="pytest-randomly is in the test extra")
    pytester.makepyfile(ORDERED)
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["*randomly-seed=*"])
