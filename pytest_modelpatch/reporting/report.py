"""The JSON report: rows of checks and a header, written once, read back by baselines and the gate.

Pure data work: no pytest, torch or transformers imports, so ``modelpatch gate`` stays
light. The pytest side (attaching rows to test reports, merging them on the xdist
controller, the terminal table) lives in :mod:`pytest_modelpatch.reporting.session`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_modelpatch.errors import ReportFileError
from pytest_modelpatch.reporting.records import CheckRecord, shown_outcome
from pytest_modelpatch.reporting.schema import (
    NON_FINITE,
    NOT_APPLICABLE,
    NUMBER_FIELDS,
    SCHEMA_VERSION,
    check_report,
    shown,
)

REPORT_FORMAT = SCHEMA_VERSION  # the header's "format", kept for readers of version 1
SCHEMA_FILE = Path(__file__).with_name("report.schema.json")


def strict_json_value(value: Any) -> Any:
    """``value`` with every non-finite float written as the string ``"nan"``, ``"inf"`` or ``"-inf"``.

    Strict parsers (jq, JavaScript, ``json.loads(..., parse_constant=...)``) reject bare
    ``NaN``/``Infinity``, so the report never holds them. Example: ``{"e": inf}`` -> ``{"e": "inf"}``.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json_value(v) for v in value]
    return value


def _read_figure(value: Any) -> Any:
    return NON_FINITE[value] if isinstance(value, str) and value in NON_FINITE else value


def read_figures(row: dict[str, Any]) -> dict[str, Any]:
    """A row as read back: the number fields' ``"nan"``/``"inf"`` strings as floats again."""
    out = {k: _read_figure(v) if k in NUMBER_FIELDS else v for k, v in row.items()}
    if isinstance(out.get("profile"), list):
        out["profile"] = [[name, _read_figure(error)] for name, error in out["profile"]]
    return out


def _current_patches() -> tuple[list[str], list[str]]:
    """Keys and replacement classes registered with transformers now (empty if it is not imported)."""
    if "transformers.monkey_patching" not in sys.modules:
        return [], []
    mapping = dict(sys.modules["transformers.monkey_patching"].get_patch_mapping())
    return sorted(map(str, mapping)), sorted(f"{c.__module__}.{c.__qualname__}" for c in mapping.values())


def device_class(device: str, gpu_names: Sequence[str] = (), current: int = 0) -> str:
    """The class of ``device`` a baseline compares within: a CUDA GPU's name as torch reports it, else the device type.

    ``gpu_names`` are ``torch.cuda.get_device_name(i)`` for each index ``i``, ``current`` the index a
    bare ``cuda`` means. A row with no device ran on the CPU; a CUDA device whose name is not known
    (a report written before version 3 without ``accelerators``) is the class ``cuda``.
    Example: ``device_class("cuda:1", ["NVIDIA A10", "NVIDIA H100 80GB HBM3"]) == "NVIDIA H100 80GB HBM3"``.
    """
    kind, _, index = str(device).strip().lower().partition(":")
    if kind != "cuda":
        return kind or "cpu"
    position = int(index) if index.isdigit() else current
    return str(gpu_names[position]) if position < len(gpu_names) else "cuda"


def class_of(row: Mapping[str, Any], gpu_names: Sequence[str] = ()) -> str:
    """A row's device class: its ``device_class``, or derived from its ``device`` for rows made before there was one."""
    return str(row.get("device_class") or device_class(str(row.get("device") or ""), gpu_names))


def device_order(classes: Iterable[str]) -> list[str]:
    """Device classes once each, ``cpu`` first, then by name: how reports and summaries list devices."""
    return sorted(set(classes), key=lambda device: (device != "cpu", device))


def row_from_record(record: CheckRecord, nodeid: str, index: int, gpu_names: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON row of one record: node id stamped, patch keys and device class filled in, ``check`` naming it in its test.

    ``gpu_names``: this machine's CUDA GPU names (only read for a check that ran on CUDA).
    """
    row = record.to_dict()
    row["nodeid"] = nodeid
    row["device_class"] = row["device_class"] or device_class(row["device"], gpu_names)
    if not row["patch_keys"]:
        keys, classes = _current_patches()
        row["patch_keys"] = keys
        row["replacements"] = row["replacements"] or classes
    # equivalence rows may name the output that erred most; older records do not
    row.setdefault("output", getattr(record, "output", ""))
    row["check"] = f"{record.kind}#{index}"
    return row


def sort_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in a stable order: by node id, then kind, then their order within the test."""
    return sorted(rows, key=lambda r: (r["nodeid"], r["kind"], int(str(r.get("check", "#0")).rpartition("#")[2] or 0)))


def report_data(
    header: dict[str, Any],
    rows: list[dict[str, Any]],
    sweeps: dict[str, dict[str, tuple[str, str]]] | None = None,
    selection: dict[str, Any] | None = None,
    tests: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """The report as written and as ``load_report`` reads it back (see :func:`write_report`)."""
    data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "header": header}
    if selection is not None:
        data["selection"] = selection
    if tests is not None:
        data["tests"] = {nodeid: dict(entry) for nodeid, entry in sorted(tests.items())}
    data["rows"] = sort_rows(rows)
    if sweeps:
        data["sweeps"] = {test: {family: sweep_entry(outcome, detail) for family, (outcome, detail) in sorted(families.items())}
                          for test, families in sorted(sweeps.items())}  # fmt: skip
    return data


def write_report(
    path: Path,
    header: dict[str, Any],
    rows: list[dict[str, Any]],
    sweeps: dict[str, dict[str, tuple[str, str]]] | None = None,
    selection: dict[str, Any] | None = None,
    tests: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Write the report as strict JSON (no NaN/Infinity tokens), valid against ``report.schema.json``.

    ``sweeps``: each swept test -> family -> (outcome, detail), as ``sweep_lines`` reads them.
    ``selection``: the session's test paths and the tests it selected and deselected; ``tests``: each
    test that ran -> its ``outcome`` (one of ``TEST_OUTCOMES``), the phase it ended in and, when it did
    not pass, why (neither for a baseline, which holds every test it was given).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    data = report_data(header, rows, sweeps, selection, tests)
    path.write_text(json.dumps(strict_json_value(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")


def sweep_entry(outcome: str, detail: str) -> dict[str, str]:
    """One family's JSON entry: its outcome, and the first diverging module of a failure or the refusal of a family not applicable."""
    if outcome == NOT_APPLICABLE:
        return {"outcome": outcome, "divergence": "", "reason": detail}
    return {"outcome": outcome, "divergence": detail}


def load_report(path: Path) -> dict[str, Any]:
    """A report (or baseline) file, checked field by field; a missing or malformed file is a usage error naming it.

    Each message names the file, the row (``rows[3]`` and its node id) or entry, and the field, so
    ``modelpatch gate`` refuses it in one line instead of judging what it cannot read.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportFileError(f"{path}: no such report; write one with pytest --modelpatch-report {path}") from None
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON, or bytes that are not UTF-8
        raise ReportFileError(f"{path}: not a modelpatch JSON report ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        found = "no 'rows' list" if isinstance(data, dict) else f"{shown(data)}, not an object"
        raise ReportFileError(f"{path}: not a modelpatch JSON report ({found}); write one with --modelpatch-report")
    data.setdefault("header", {})
    check_report(str(path), data)
    # reports before version 3 have no device class: a row is the GPU its device names in the
    # header's accelerators (cuda:1 -> accelerators[1]), or the device type ("cpu" when none)
    data["rows"] = [read_figures(row) for row in data["rows"]]
    first: dict[tuple[str, str, str], int] = {}
    for index, row in enumerate(data["rows"]):
        row["device_class"] = class_of(row, data["header"].get("accelerators") or ())
        key = (row["nodeid"], row["check"], row["device_class"])
        if first.setdefault(key, index) != index:
            raise ReportFileError(
                f"{path}: rows[{first[key]}] and rows[{index}] are the same check, {key[0]} {key[1]} on {key[2]}: "
                "a report holds each check once: give two runs' reports as two files, or write it again with --modelpatch-report"
            )
    return data


# failures first, then checks that passed against their test's intent, then those meant to fail, then passes
_OUTCOME_ORDER = {"failed": 0, "xpassed": 1, "xfailed": 2, "passed": 3}


def worst_first(row: dict[str, Any]) -> tuple[int, float, str, str]:
    """Sort key: failures first, then by max abs error as printed (largest first), then by node id and check.

    The error is rounded to the digits the table prints, so two rows whose figures print alike
    keep the order of their ids whichever CPU's round-off made them (the docs quote this table).
    """
    error = _read_figure(row.get("max_abs_error"))
    error = 0.0 if error is None else (math.inf if math.isnan(error) else float(figure(error)))
    rank = _OUTCOME_ORDER.get(shown_outcome(row["outcome"], bool(row.get("expected_failure"))), 0)
    return rank, -error, row["nodeid"], row["check"]


def figure(value: Any) -> str:
    """A number for a table: ``1e-07``, ``inf``, ``nan``, or ``-`` when there is none."""
    return "-" if value is None else f"{_read_figure(value):.3g}"


def speedup(row: dict[str, Any]) -> float | None:
    """The row's ``timing.speedup`` (reference seconds / patched seconds), ``None`` when it was not timed."""
    timing = row.get("timing")
    return _read_figure(timing.get("speedup")) if isinstance(timing, dict) else None


def speedup_cell(row: dict[str, Any]) -> str:
    """``1.8x`` for a table, ``~1.03x`` for no measurable difference, ``-`` for a check that was not timed."""
    value = speedup(row)
    if value is None:
        return "-"
    return f"{'' if row['timing'].get('measurable', True) else '~'}{value:.2f}x"


NO_MEASURABLE_DIFFERENCE = (
    "~ no measurable difference: the two models' times overlap within the spread of their repeats (interquartile range)"
)


def parallel_cell(row: dict[str, Any]) -> str:
    """``/tp2`` after the device of a row from a ``parallel("tp")`` test over 2 ranks (``/ranks2`` unsharded), else ``""``."""
    parallel = row.get("parallel")
    if not isinstance(parallel, dict):
        return ""
    return f"/{parallel.get('kind') or 'ranks'}{parallel.get('world_size')}"


def summary_lines(rows: list[dict[str, Any]], limit: int = 20) -> list[str]:
    """A compact table of checks, worst max abs error first; a ``speedup`` column when any check was timed."""
    ordered = sorted(rows, key=worst_first)
    timed = any(speedup(r) is not None for r in rows)
    table = [
        ("outcome", "max abs", "max rel", *(("speedup",) if timed else ()), "check", "model", "dtype@device", "test")
    ]
    for r in ordered[:limit]:
        where = f"{r.get('dtype') or '-'}@{r.get('device') or '-'}{parallel_cell(r)}"
        table.append((shown_outcome(r["outcome"], bool(r.get("expected_failure"))), figure(r.get("max_abs_error")), figure(r.get("max_rel_error")),
                      *((speedup_cell(r),) if timed else ()), r["check"], r.get("model") or "-", where, r["nodeid"]))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in table]
    if len(ordered) > limit:
        lines.append(f"... and {len(ordered) - limit} more (see --modelpatch-report)")
    if any(speedup_cell(r).startswith("~") for r in ordered[:limit]):
        lines.append(NO_MEASURABLE_DIFFERENCE)
    return lines


_SWEEP_VERBS = (("passed", "passes on"), ("failed", "fails on"), (NOT_APPLICABLE, "not applicable on"),
                ("xfailed", "xfails on"), ("xpassed", "xpasses on"), ("skipped", "skips"))  # fmt: skip


def sweep_lines(sweeps: dict[str, dict[str, tuple[str, str]]]) -> list[str]:
    """One line per swept test: ``test: passes on 41 families; fails on 2 families: gemma, paligemma (first diverging module ...)``.

    ``sweeps`` maps a swept test (its node id without the family) to family -> (outcome, detail): where a
    failure diverged, or why transformers refused a family not applicable. Families are listed by name where
    few enough to read; the first failure's divergence is quoted, and the refusals in short, with their counts.
    """
    lines = []
    for test, families in sorted(sweeps.items()):
        by_outcome: dict[str, list[str]] = {}
        for family, (outcome, _) in sorted(families.items()):
            by_outcome.setdefault(outcome, []).append(family)
        parts = []
        for outcome, verb in _SWEEP_VERBS:
            names = by_outcome.get(outcome, [])
            if not names:
                continue
            count = f"{len(names)} famil{'y' if len(names) == 1 else 'ies'}"
            listed = f": {', '.join(names)}" if outcome not in ("passed", NOT_APPLICABLE) or len(names) <= 3 else ""
            if outcome == "failed":
                where = next((families[f][1] for f in names if families[f][1]), "")
                listed += f" ({where})" if where else ""
            elif outcome == NOT_APPLICABLE:
                listed += f" ({refusal_counts([families[f][1] for f in names])})"
            parts.append(f"{verb} {count}{listed}")
        lines.append(f"{test}: {'; '.join(parts)}")
    return lines


def refusal_counts(reasons: list[str]) -> str:
    """transformers' refusals in short, most frequent first: ``does not support ... yet`` or ``160: ...; 2: ...``."""
    counts: dict[str, int] = {}
    for reason in reasons:
        short = short_refusal(reason)
        counts[short] = counts.get(short, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    if len(ordered) == 1:
        return ordered[0][0]
    return "; ".join(f"{count}: {short}" for short, count in ordered)


def short_refusal(reason: str) -> str:
    """A refusal without the class that said it, first sentence only: the part every family shares.

    ``"XLMWithLMHeadModel does not support an attention implementation through torch...attention yet. Please ..."``
    -> ``"does not support an attention implementation through torch...attention yet"``.
    """
    start = reason.find("does not support")
    text = reason[start:] if start >= 0 else reason
    return re.split(r"(?<=[a-z\d)`'])\. ", text.strip(), maxsplit=1)[0].rstrip(".")
