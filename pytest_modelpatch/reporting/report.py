"""The JSON report: rows of checks and a header, written once, read back by baselines and the gate.

Pure data work: no pytest, torch or transformers imports, so ``modelpatch gate`` stays
light. The pytest side (attaching rows to test reports, merging them on the xdist
controller, the terminal table) lives in :mod:`pytest_modelpatch.reporting.session`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pytest_modelpatch.errors import ReportFileError
from pytest_modelpatch.reporting.records import CheckRecord, shown_outcome

REPORT_FORMAT = 1


def _current_patches() -> tuple[list[str], list[str]]:
    """Keys and replacement classes registered with transformers now (empty if it is not imported)."""
    if "transformers.monkey_patching" not in sys.modules:
        return [], []
    mapping = dict(sys.modules["transformers.monkey_patching"].get_patch_mapping())
    return sorted(map(str, mapping)), sorted(f"{c.__module__}.{c.__qualname__}" for c in mapping.values())


def row_from_record(record: CheckRecord, nodeid: str, index: int) -> dict[str, Any]:
    """The JSON row of one record: node id stamped, patch keys filled in, ``check`` naming it in its test."""
    row = record.to_dict()
    row["nodeid"] = nodeid
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


def write_report(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, "rows": sort_rows(rows)}, indent=2) + "\n", encoding="utf-8")


def load_report(path: Path) -> dict[str, Any]:
    """A report (or baseline) file; a missing or malformed file is a usage error naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportFileError(f"{path}: no such report; write one with pytest --modelpatch-report {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportFileError(f"{path}: not a modelpatch JSON report ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ReportFileError(f"{path}: not a modelpatch JSON report (no 'rows' list); write one with --modelpatch-report")
    return data


def worst_first(row: dict[str, Any]) -> tuple[float, str, str]:
    """Sort key: largest max abs error first, then by node id and check."""
    return -(row.get("max_abs_error") or 0.0), row["nodeid"], row["check"]


def _figure(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def summary_lines(rows: list[dict[str, Any]], limit: int = 20) -> list[str]:
    """A compact table of checks, worst max abs error first."""
    ordered = sorted(rows, key=worst_first)
    table = [("outcome", "max abs", "max rel", "check", "model", "dtype@device", "test")]
    for r in ordered[:limit]:
        where = f"{r.get('dtype') or '-'}@{r.get('device') or '-'}"
        table.append((shown_outcome(r["outcome"], bool(r.get("expected_failure"))), _figure(r.get("max_abs_error")), _figure(r.get("max_rel_error")),
                      r["check"], r.get("model") or "-", where, r["nodeid"]))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in table]
    if len(ordered) > limit:
        lines.append(f"... and {len(ordered) - limit} more (see --modelpatch-report)")
    return lines
