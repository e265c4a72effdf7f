"""The plugin verifying transformers' own implementations: sdpa and grouped_mm against eager, over every family.

One real pytest session, the two tests a kernel author would write::

    @pytest.mark.model(families="all")
    @pytest.mark.patch(attn_implementation="sdpa")           # and experts_implementation="grouped_mm"
    def test_sdpa_matches_eager(reference_model, patched_model):
        assert_equivalent(reference_model, patched_model)

then its JSON report, read per sweep: the families that passed, failed, were not applicable
(transformers refuses them the implementation) and were skipped (they do not run here), and the
time. It fails (exit 1) on any error, on any failure under :data:`ROUND_OFF` max abs (round-off
the default tolerance should pass: a false alarm), and on any failure ``docs/families.md`` does not
list among the known differences between transformers' implementations with the module it names,
or a listed one that no longer fails (the table is stale). So it is the regression test of the
plugin's precision as much as a check of transformers.

    python benchmarks/implementation_sweeps.py               # -n 2; counts, time, every failure explained
    python benchmarks/implementation_sweeps.py --markdown    # just the counts block docs/families.md quotes
    python benchmarks/implementation_sweeps.py --check-doc   # CI: also fail when docs/families.md quotes other counts
    python benchmarks/implementation_sweeps.py --jobs 4 --families llama xlm qwen3_moe   # a few families
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "families.md"
KNOWN_HEADING = "### Known differences between transformers' implementations"
ROUND_OFF = 1e-4  # a failure under this max abs error is round-off the default tolerance must pass
SWEEPS = {"sdpa": ("attn_implementation", "sdpa"), "grouped_mm": ("experts_implementation", "grouped_mm")}
OUTCOMES = ("passed", "failed", "not applicable", "skipped", "errors")

TESTS = """
import pytest
from pytest_modelpatch import assert_equivalent


@pytest.mark.model({marker})
@pytest.mark.patch(attn_implementation="sdpa")
def test_sdpa(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model({marker})
@pytest.mark.patch(experts_implementation="grouped_mm")
def test_grouped_mm(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
"""


@dataclass
class SweepResult:
    """One sweep's families by outcome; a failure's max abs error and first diverging module."""

    name: str
    families: dict[str, list[str]] = field(default_factory=dict)  # outcome -> families
    failures: dict[str, tuple[float, str]] = field(default_factory=dict)  # family -> (max abs, divergence)

    def count(self, outcome: str) -> int:
        return len(self.families.get(outcome, []))


def run_sweeps(families: list[str] | None, jobs: int, report: Path) -> float:
    """Run the session (``families="all"``, or a list); its report lands in ``report``; returns the seconds it took."""
    marker = repr(families) if families else 'families="all"'
    with tempfile.TemporaryDirectory(prefix="implementation-sweeps-") as scratch:
        Path(scratch, "test_sweeps.py").write_text(TESTS.format(marker=marker))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", "pytest", "test_sweeps.py", "-p", "no:randomly", "-p", "no:cacheprovider", "-q",
                   *(["-n", str(jobs)] if jobs > 1 else ["-p", "no:xdist"]), "--modelpatch-report", str(report)]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(command, cwd=scratch, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        return time.perf_counter() - start


def read_results(report: Path) -> dict[str, SweepResult]:
    """Each sweep's families by outcome: a failure with no check row failed before comparing (an error)."""
    data = json.loads(report.read_text())
    rows = {row["nodeid"]: row for row in data["rows"]}
    results = {}
    for name in SWEEPS:
        result = results[name] = SweepResult(name)
        for family, entry in data.get("sweeps", {}).get(f"test_sweeps.py::test_{name}", {}).items():
            row = rows.get(f"test_sweeps.py::test_{name}[{family}]")
            outcome = entry["outcome"]
            if outcome == "failed" and row is None:
                outcome = "errors"
            elif outcome == "failed":
                error = row["max_abs_error"]
                result.failures[family] = (
                    float(error) if not isinstance(error, str) else float("inf"),
                    entry["divergence"],
                )
            result.families.setdefault(outcome, []).append(family)
    return results


def known_differences() -> dict[tuple[str, str], str]:
    """``docs/families.md``'s known differences: (family, implementation) -> the first diverging module it names."""
    text = DOC.read_text(encoding="utf-8")
    assert KNOWN_HEADING in text, f"docs/families.md has no section '{KNOWN_HEADING}'"
    section = text.split(KNOWN_HEADING, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `([\w.-]+)` \| `(\w+)` \| `([\w.]+)` \|", section, flags=re.M)
    return {(family, implementation): module for family, implementation, module in rows}


def problems(results: dict[str, SweepResult], known: dict[tuple[str, str], str]) -> list[str]:
    """What makes the job fail: errors, round-off failures, failures the docs do not explain, stale entries."""
    found = []
    for name, result in results.items():
        found += [
            f"{name}: {family} errored (see the session's output)" for family in result.families.get("errors", [])
        ]
        for family, (error, divergence) in sorted(result.failures.items()):
            module = known.get((family, name))
            if error < ROUND_OFF:
                found.append(
                    f"{name}: {family} fails on round-off (max abs {error:.3g} < {ROUND_OFF:g}): a false alarm"
                )
            elif module is None:
                found.append(f"{name}: {family} fails (max abs {error:.3g}, {divergence or 'no divergence found'}), "
                             "and docs/families.md lists no known difference for it")  # fmt: skip
            elif f"first diverging module: {module} " not in f"{divergence} ":
                found.append(f"{name}: {family} now diverges elsewhere ({divergence}); docs/families.md names {module}")
        ran = {family for names in result.families.values() for family in names}
        found += [f"{name}: {family} is listed as a known difference but no longer fails: update docs/families.md"
                  for (family, sweep), _ in known.items() if sweep == name and family in ran and family not in result.failures]  # fmt: skip
    return found


def quoted_counts() -> str:
    """The counts block docs/families.md quotes now."""
    text = DOC.read_text(encoding="utf-8")
    return text.split("<!-- sweeps:begin -->\n", 1)[1].split("\n<!-- sweeps:end -->", 1)[0]


def markdown(results: dict[str, SweepResult]) -> str:
    """The counts block docs/families.md quotes (deterministic: no timings)."""
    lines = [
        "| sweep | passed | failed (known differences) | not applicable | skipped | errors |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, (axis, value) in SWEEPS.items():
        result = results[name]
        lines.append(
            f'| `{axis}="{value}"` against eager | ' + " | ".join(str(result.count(o)) for o in OUTCOMES) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="model types (default: every family, families='all')")
    parser.add_argument("--jobs", type=int, default=2, help="xdist workers (default 2; 1 runs without xdist)")
    parser.add_argument("--markdown", action="store_true", help="print only the counts block docs/families.md quotes")
    parser.add_argument("--report", type=Path, help="keep the session's JSON report here")
    parser.add_argument(
        "--check-doc", action="store_true", help="also fail when docs/families.md quotes other counts (CI)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="implementation-sweeps-report-") as scratch:
        report = args.report or Path(scratch) / "report.json"
        seconds = run_sweeps(args.families, args.jobs, report)
        results = read_results(report)
    found = problems(results, known_differences())
    block = markdown(results)
    if args.check_doc and block != quoted_counts():
        found.append(
            "docs/families.md quotes other counts between <!-- sweeps:begin --> and <!-- sweeps:end -->: paste the block above"
        )
    print(block)
    if not args.markdown:
        print(f"\ntime: {seconds:.0f}s for both sweeps ({args.jobs} worker{'s' * (args.jobs != 1)})")
        for name, result in results.items():
            for family, (error, divergence) in sorted(result.failures.items()):
                print(f"  {name}: {family} fails, max abs {error:.3g}; {divergence}")
    if found:
        print(f"\n{len(found)} problem{'s' * (len(found) != 1)}:", *found, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
