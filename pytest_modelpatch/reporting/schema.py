"""What a report file may hold, as ``report.schema.json`` says, and the check of a file read back.

``load_report`` runs :func:`check_report` on every report and baseline before anything judges it,
so ``modelpatch gate`` refuses a malformed file in one line (the file, the row or entry, the
field) instead of failing on it half-way through a verdict. Pure data work, like ``report.py``.

Example::

    check_report("r.json", {"header": {}, "rows": [{"nodeid": "t.py::t", "check": "equivalence#1",
                                                   "kind": "equivalence", "outcome": "passed"}]})
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pytest_modelpatch.errors import ReportFileError

# 2: strict JSON (non-finite numbers as "nan"/"inf"/"-inf"), expected_failure and intent on rows
# 3: each row's device_class, the header's default device and device classes, the report's selection
# 4: each selected test's outcome (``tests``), so a test that failed or errored without writing a row is seen
SCHEMA_VERSION = 4
# what a test came to, as pytest counts it; the gate fails on the first two (an xfail test that failed is xfailed)
FAILING_OUTCOMES = ("failed", "error")
TEST_OUTCOMES = (*FAILING_OUTCOMES, "passed", "skipped", "xfailed", "xpassed")
NOT_APPLICABLE = "not applicable"  # a swept family transformers refuses what the test asks (fixtures.not_applicable)
SWEEP_OUTCOMES = ("passed", "failed", NOT_APPLICABLE, "skipped", "xfailed", "xpassed")
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
NUMBER_FIELDS = ("max_abs_error", "max_rel_error", "atol", "rtol", "duration_s")  # a row's figures, "nan" as text

# A field's test and the words for a message. A field the schema does not require may be absent or
# null; a bool is never a number here (Python's True is an int).
Expect = tuple[Callable[[Any], bool], str]


def is_number(value: Any) -> bool:
    """An int or a float, never a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_figure(value: Any) -> bool:
    """A number, or the text a strict report writes for a non-finite one (``"nan"``, ``"inf"``, ``"-inf"``)."""
    return is_number(value) or (isinstance(value, str) and value in NON_FINITE)


def _is_error(value: Any) -> bool:
    # an error or a tolerance is never below 0: a "-inf" error would pass every ceiling
    return is_figure(value) and value != "-inf" and not (is_number(value) and value < 0)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_pairs(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and is_figure(item[1]) for item in value
    )


def _one_of(*allowed: str) -> Expect:
    return (lambda value: isinstance(value, str) and value in allowed), "one of " + ", ".join(allowed)


TEXT: Expect = (lambda value: isinstance(value, str), "a string")
FLAG: Expect = (lambda value: isinstance(value, bool), "true or false")
COUNT: Expect = (_is_count, "a whole number, 0 or more")
STRINGS: Expect = (
    lambda value: isinstance(value, list) and all(isinstance(v, str) for v in value),
    "a list of strings",
)
OBJECT: Expect = (lambda value: isinstance(value, dict), "an object")
FIGURE: Expect = (is_figure, 'a number, "nan", "inf" or "-inf"')
ERROR: Expect = (_is_error, 'a number 0 or more, "nan" or "inf"')

ROW_REQUIRED: dict[str, Expect] = {
    "nodeid": (lambda value: isinstance(value, str) and bool(value.strip()), "a test's node id"),
    "check": (lambda value: isinstance(value, str) and bool(re.fullmatch(r".+#\d+", value)), "KIND#N (equivalence#1)"),
    "kind": (lambda value: isinstance(value, str) and bool(value), "a check's kind (equivalence)"),
    "outcome": _one_of("passed", "failed"),
}
ROW_FIELDS: dict[str, Expect] = {
    "expected_failure": FLAG, "timing": OBJECT, "parallel": OBJECT, "implementations": OBJECT,
    "profile": (_is_pairs, "a list of [module, figure] pairs"),
    **dict.fromkeys(NUMBER_FIELDS, ERROR),
    **dict.fromkeys(("examples", "elements_over_tolerance", "elements_compared", "routing_near_ties"), COUNT),
    **dict.fromkeys(("intent", "model", "output", "device", "device_class", "dtype", "detail", "first_diverging"), TEXT),
    **dict.fromkeys(("patch_keys", "replacements", "blamed", "coverage"), STRINGS),
}  # fmt: skip
TIMING_FIELDS: dict[str, Expect] = {"speedup": FIGURE, "reference_s": FIGURE, "patched_s": FIGURE, "measurable": FLAG}
HEADER_FIELDS: dict[str, Expect] = {
    "format": COUNT, "workers": COUNT, "seed": (lambda value: isinstance(value, int) and not isinstance(value, bool),
                                                "a whole number"),
    "versions": (lambda value: isinstance(value, dict) and all(v is None or isinstance(v, str) for v in value.values()),
                 "an object of package versions"),
    **dict.fromkeys(("python", "platform", "default_device", "default_device_class", "timestamp"), TEXT),
    **dict.fromkeys(("devices", "accelerators", "device_classes", "command_line", "merged_from"), STRINGS),
}  # fmt: skip
SELECTION_FIELDS: dict[str, Expect] = dict.fromkeys(("paths", "selected", "deselected"), STRINGS)
TEST_REQUIRED: dict[str, Expect] = {"outcome": _one_of(*TEST_OUTCOMES)}
TEST_FIELDS: dict[str, Expect] = {"when": _one_of("setup", "call", "teardown"), "detail": TEXT}
SWEEP_REQUIRED: dict[str, Expect] = {"outcome": _one_of(*SWEEP_OUTCOMES)}
SWEEP_FIELDS: dict[str, Expect] = {"divergence": TEXT, "reason": TEXT}


def check_report(name: str, data: Mapping[str, Any]) -> None:
    """Refuse a report whose fields do not hold what the schema says: a :class:`ReportFileError` naming
    the file ``name``, the row (``rows[3] (its node id)``) or entry, and the field.

    ``data``: the file's JSON object, with a ``rows`` list (``load_report`` checks that much first).
    """
    header = data.get("header", {})
    check_fields(f"{name}: header", header, {}, HEADER_FIELDS)
    version = data.get("schema_version", header.get("format", 1))
    if not _is_count(version) or not 1 <= version <= SCHEMA_VERSION:
        newer = _is_count(version) and version > SCHEMA_VERSION
        raise ReportFileError(
            f"{name}: schema_version {version!r} is newer than this pytest-modelpatch reads ({SCHEMA_VERSION}); "
            "upgrade pytest-modelpatch where you gate"
            if newer
            else f"{name}: schema_version is {shown(version)}, expected a whole number from 1 to {SCHEMA_VERSION}"
        )
    for index, row in enumerate(data["rows"]):
        nodeid = row.get("nodeid") if isinstance(row, dict) else None
        where = f"{name}: rows[{index}]" + (f" ({nodeid})" if isinstance(nodeid, str) and nodeid.strip() else "")
        check_fields(where, row, ROW_REQUIRED, ROW_FIELDS)
        if row.get("timing") is not None:
            check_fields(f"{where} timing", row["timing"], {}, TIMING_FIELDS)
    if data.get("selection") is not None:
        check_fields(f"{name}: selection", data["selection"], {}, SELECTION_FIELDS)
    for nodeid, entry in _entries(name, data, "tests"):
        check_fields(f"{name}: tests[{shown(nodeid)}]", entry, TEST_REQUIRED, TEST_FIELDS)
    for test, families in _entries(name, data, "sweeps"):
        if not isinstance(families, dict):
            raise ReportFileError(f"{name}: sweeps[{shown(test)}] is {shown(families)}, expected an object of families")
        for family, entry in families.items():
            check_fields(f"{name}: sweeps[{shown(test)}][{shown(family)}]", entry, SWEEP_REQUIRED, SWEEP_FIELDS)


def _entries(name: str, data: Mapping[str, Any], key: str) -> Iterable[tuple[str, Any]]:
    """The ``tests`` or ``sweeps`` object's entries; none when the report (older, or a baseline) has none."""
    entries = data.get(key)
    if entries is None:
        return ()
    if not isinstance(entries, dict):
        raise ReportFileError(f"{name}: {key} is {shown(entries)}, expected an object keyed by test")
    return entries.items()


def check_fields(where: str, entry: Any, required: Mapping[str, Expect], fields: Mapping[str, Expect]) -> None:
    """``entry`` is an object, has each ``required`` field, and every field it has holds what it should."""
    if not isinstance(entry, dict):
        raise ReportFileError(f"{where} is {shown(entry)}, expected an object")
    for field_name, (holds, expected) in {**required, **fields}.items():
        value = entry.get(field_name)
        if value is None and field_name in required:
            raise ReportFileError(f"{where}: {field_name} is missing, expected {expected}")
        if value is not None and not holds(value):
            raise ReportFileError(f"{where}: {field_name} is {shown(value)}, expected {expected}")


def shown(value: Any) -> str:
    """A value as its JSON reads, cut short for a one-line message: ``"abc"``, ``true``, ``[1, 2]``."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
