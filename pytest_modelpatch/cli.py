"""The ``modelpatch`` command line: ``modelpatch lint PATTERN... [--family F] [--json]`` and
``modelpatch gate REPORT.json [REPORT.json ...] [--baseline BASE.json]`` (the reports of shards and
devices judged as one run).

``modelpatch lint --family llama --mapping fixtures.patches.llama_fused_qkv:MAPPING`` lints the
replacement classes' contract too (``--check signature,weights,plan``).

Subcommands are argparse sub-parsers; add one with ``_add_<name>(subparsers)`` and a
``run`` default. Nothing heavy is imported until a subcommand runs.
Exit codes: 0 clean, 1 failing findings, 2 wrong use.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pytest_modelpatch.errors import ReportFileError

if TYPE_CHECKING:
    from pytest_modelpatch.reporting.shards import Run

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
CHECKS = ("names", "signature", "weights", "plan")  # as pytest_modelpatch.lint.patterns.CHECKS


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="modelpatch", description="Check patches of transformers models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_lint(subparsers)
    _add_gate(subparsers)
    return parser


def _add_lint(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lint = subparsers.add_parser(
        "lint",
        help="lint patch-mapping keys against the installed transformers",
        description="Report keys that would replace containers or non-modules, or match nothing. "
        "Exit 1 when a CONTAINER, NOT_A_MODULE, NO_MATCH or INVALID_REGEX finding is not allowed.",
    )
    lint.add_argument("patterns", nargs="*", metavar="PATTERN", help="keys, in mapping order (exact names or regexes)")
    lint.add_argument(
        "--mapping",
        metavar="MODULE:NAME",
        help="a patch mapping to import (keys and replacement classes), e.g. "
        "'fixtures.patches.llama_fused_qkv:MAPPING'; with --family its contract is linted too",
    )
    lint.add_argument(
        "--conversions",
        metavar="MODULE:NAME",
        help="the mapping's weight conversions ({model_type: [WeightConverter, ...]}); "
        "default: CONVERSIONS beside --mapping's NAME, if its module has one",
    )
    lint.add_argument(
        "--check",
        default=",".join(CHECKS),
        metavar="CHECK[,CHECK]",
        help=f"which checks to run, of {','.join(CHECKS)} (contract checks need --mapping and --family)",
    )
    lint.add_argument(
        "--family",
        action="append",
        dest="families",
        metavar="FAMILY",
        help="limit to a model family (model type such as 'bert'); repeatable",
    )
    lint.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PATTERN=KIND[,KIND]",
        help="accept these finding kinds for one key, e.g. '.*Attention=CONTAINER'",
    )
    lint.add_argument("--json", action="store_true", help="print JSON for CI instead of text")
    lint.add_argument("--rebuild-index", action="store_true", help="rebuild the cached scan index first")
    lint.set_defaults(run=_run_lint)


def _parse_allow(values: list[str]) -> dict[str, list[str]]:
    allow: dict[str, list[str]] = {}
    for value in values:
        key, sep, kinds = value.rpartition("=")
        if not sep or not key or not kinds:
            raise ValueError(f"--allow {value!r}: expected PATTERN=KIND[,KIND], e.g. '.*Attention=CONTAINER'")
        allow.setdefault(key, []).extend(k.strip().upper() for k in kinds.split(","))
    return allow


def _run_lint(args: argparse.Namespace) -> int:
    from pytest_modelpatch.lint import patterns
    from pytest_modelpatch.lint.scan_index import load_index

    mapping: dict[str, object] = dict.fromkeys(args.patterns)
    conversions = None
    if args.mapping:
        mapping.update(_import_object(args.mapping, "--mapping"))
        conversions = _conversions(args)
    if not mapping:
        raise ValueError("give PATTERN arguments or --mapping MODULE:NAME")
    allow = _parse_allow(args.allow)
    patterns._check_allow(mapping, allow)
    index = load_index(rebuild=args.rebuild_index)
    checks = [c for c in args.check.split(",") if c.strip()]
    from pytest_modelpatch.lint.patterns import lint_patterns  # the public function: the same findings

    findings = lint_patterns(mapping, families=args.families, index=index, conversions=conversions, checks=checks)
    args.patterns = list(mapping)
    bad = patterns.failing_findings(findings, allow)
    failed = {id(f) for f in bad}  # findings compare by value; thousands of them, so by identity
    if args.json:
        matches = patterns.matched_classes(args.patterns, families=args.families, index=index)
        print(
            json.dumps(
                {
                    "transformers": index.transformers_version,
                    "families": sorted(args.families or []),
                    "failing": len(bad),
                    "matches": {key: sorted(names) for key, names in matches.items()},
                    "findings": [dict(f.to_json(), failing=id(f) in failed) for f in findings],
                },
                indent=2,
            )
        )
    else:
        for finding in findings:
            print(("FAIL " if id(finding) in failed else "note ") + str(finding))
        scope = f" in {', '.join(args.families)}" if args.families else ""
        print(
            f"{len(findings)} findings, {len(bad)} failing, for {len(args.patterns)} keys{scope} "
            f"(transformers {index.transformers_version})"
        )
    return EXIT_FINDINGS if bad else EXIT_OK


def _import_object(spec: str, option: str) -> Any:
    """``package.module:NAME`` imported from the current folder, as pytest imports test modules."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{option} {spec!r}: expected MODULE:NAME, e.g. 'fixtures.patches.llama_fused_qkv:MAPPING'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{option} {spec!r}: cannot import {module_name!r} ({error}); run from the folder that "
            f"holds it or put it on PYTHONPATH"
        ) from error
    if not hasattr(module, name):
        raise ValueError(f"{option} {spec!r}: module {module_name!r} has no {name!r}")
    return getattr(module, name)


def _conversions(args: argparse.Namespace) -> Any:
    if args.conversions:
        return _import_object(args.conversions, "--conversions")
    module = sys.modules[args.mapping.partition(":")[0]]
    return getattr(module, "CONVERSIONS", None)


def _add_gate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gate = subparsers.add_parser(
        "gate",
        help="judge --modelpatch-report files (shards, devices) as one run against thresholds and a baseline",
        description="Merge the reports of shards and jobs into one run and print the verdict and a markdown "
        "summary with a section per device (for $GITHUB_STEP_SUMMARY). Each check is compared with the "
        "baseline's row of its device class. Exit 1 when a check failed, passed a threshold, grew beyond the "
        "baseline or is missing from every report, a test failed, errored or has no outcome, or nothing was "
        "judged (no check; --allow-empty allows it); 2 on wrong use: a missing or malformed report (named with "
        "its row and field), a non-finite baseline figure or limit, two reports from one device holding the "
        "same check.",
    )
    gate.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT.json",
        help="reports written by pytest --modelpatch-report: one per shard and device",
    )
    gate.add_argument("--baseline", metavar="BASE.json", help="an earlier report to compare against")
    gate.add_argument(
        "--update-baseline",
        action="store_true",
        help="rewrite --baseline with these reports' checks instead of comparing: the rows of the "
        "tests and devices they ran are replaced, the others kept",
    )
    gate.add_argument(
        "--markdown",
        metavar="OUT.md",
        help="also write (append) the markdown summary to this file, creating its folder if need be",
    )
    gate.add_argument(
        "--max-abs-error", type=_limit("1e-3"), metavar="X", help="fail when a check's max abs error exceeds X"
    )
    gate.add_argument(
        "--max-rel-error", type=_limit("1e-2"), metavar="X", help="fail when a check's max rel error exceeds X"
    )
    gate.add_argument(
        "--factor", type=_limit("2"), default=None, metavar="F", help="allowed growth over the baseline (default 2)"
    )
    gate.add_argument(
        "--floor", type=_limit("1e-6"), default=None, metavar="X", help="growth below X always passes (default 1e-6)"
    )
    gate.add_argument(
        "--min-speedup",
        type=_limit("1.1"),
        default=None,
        metavar="X",
        help="fail when a timed check (pytest --modelpatch-timing) is less than X times as fast as its reference",
    )
    gate.add_argument(
        "--max-speedup-drop",
        type=_limit("0.2", fraction=True),
        default=None,
        metavar="F",
        help="with --baseline: fail when a timed check's speedup fell more than the fraction F below the "
        "baseline's (e.g. 0.2: a 2.0x check must stay at 1.6x or more)",
    )
    gate.add_argument(
        "--allow-empty",
        action="store_true",
        help="pass a run that judged nothing: no check in any report, or a report with no check and no test "
        "that ran (by default the gate fails on it, since no threshold or baseline judged anything)",
    )
    gate.set_defaults(run=_run_gate)


def _limit(example: str, fraction: bool = False) -> Callable[[str], float]:
    """An argparse type for a gate limit: a finite number, 0 or more (below 1 for a fraction).

    ``--floor inf`` would let any growth pass, ``--max-abs-error nan`` fail every check: refused, with an example.
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0 and (value < 1 or not fraction)):
            expected = "a fraction in [0, 1)" if fraction else "a finite number, 0 or more"
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}, e.g. {example}")
        return value

    return parse


def _run_gate(args: argparse.Namespace) -> int:
    """Every input read and checked first (reports, baseline, the markdown file), then the verdict."""
    from pytest_modelpatch.reporting import gate
    from pytest_modelpatch.reporting.report import load_report
    from pytest_modelpatch.reporting.shards import merge_reports

    if args.update_baseline and not args.baseline:
        raise ValueError("--update-baseline needs --baseline BASE.json: the file to rewrite")
    thresholds = gate.Thresholds(
        args.max_abs_error, args.max_rel_error,
        gate.DEFAULT_FACTOR if args.factor is None else args.factor, gate.DEFAULT_FLOOR if args.floor is None else args.floor,
        min_speedup=args.min_speedup, max_speedup_drop=args.max_speedup_drop,
    )  # fmt: skip
    loaded = [(name, load_report(name)) for name in args.reports]
    run = merge_reports(loaded)
    baseline = None
    if args.update_baseline and Path(args.baseline).exists():
        load_report(args.baseline)  # the rows it keeps are rewritten as they are: a malformed one is refused now
    elif args.baseline and not args.update_baseline:
        baseline = gate.load_baseline(args.baseline, thresholds)
    with _markdown_file(args.markdown) as out:
        if args.update_baseline:
            verdict = gate.evaluate(run.rows, thresholds, run=run, allow_empty=args.allow_empty)
            verdict.notes.append(_update_baseline(args, run, loaded[0][1]["header"]))
        else:
            verdict = gate.evaluate(
                run.rows, thresholds, baseline, args.baseline or "", run, allow_empty=args.allow_empty
            )
        markdown = verdict.markdown(run.rows)
        print(verdict)
        print()
        print(markdown, end="")
        if out is not None:
            out.write(markdown)
    return EXIT_OK if verdict.passed else EXIT_FINDINGS


def _markdown_file(path: str | None) -> contextlib.AbstractContextManager[TextIO | None]:
    """``--markdown``'s file opened to append, its folder made first (as CI tools make their output folders)."""
    if not path:
        return contextlib.nullcontext()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--markdown {path}: cannot write it ({error.strerror or error})") from None


def _update_baseline(args: argparse.Namespace, run: Run, header: dict[str, Any]) -> str:
    """Rewrite ``--baseline`` from ``run``, unless it judged nothing (its rows would replace the baseline's with none)."""
    from pytest_modelpatch.reporting.gate import unjudged
    from pytest_modelpatch.reporting.shards import rewrite_baseline

    if not args.allow_empty and unjudged(run):
        return f"baseline {args.baseline} not rewritten: nothing was judged"
    try:
        return rewrite_baseline(args.baseline, run, {**header, "merged_from": list(args.reports)})
    except OSError as error:
        raise ReportFileError(f"--baseline {args.baseline}: cannot write it ({error.strerror or error})") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``modelpatch`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, ReportFileError) as error:
        print(f"modelpatch: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:
        # PatchUsageError is a pytest.UsageError: look it up only when something else went wrong,
        # so that a clean run imports no pytest.
        from pytest_modelpatch.errors import PatchUsageError

        if isinstance(error, PatchUsageError):
            print(f"modelpatch: error: {error}", file=sys.stderr)
            return EXIT_USAGE
        raise
