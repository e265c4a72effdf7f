"""Reports are strict JSON and valid against the schema the package ships (report.schema.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pytest_modelpatch.reporting.records import CheckRecord
from pytest_modelpatch.reporting.report import SCHEMA_FILE, load_report, row_from_record, summary_lines, write_report

# jsonschema is not a dependency: this validates the subset of JSON Schema that report.schema.json uses.
_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value: Any, schema: dict[str, Any], root: dict[str, Any], where: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema`` (a JSON Schema subset: type, const, enum, anyOf, $ref, ...)."""
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return schema_errors(value, target, root, where)
    if "anyOf" in schema and all(schema_errors(value, s, root, where) for s in schema["anyOf"]):
        return [f"{where}: {value!r} matches none of {schema['anyOf']}"]
    if "const" in schema and value != schema["const"]:
        return [f"{where}: {value!r} is not {schema['const']!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} is not one of {schema['enum']}"]
    types = schema.get("type")
    if types is not None and not any(_is_type(value, t) for t in ([types] if isinstance(types, str) else types)):
        return [f"{where}: {value!r} is not of type {types}"]
    errors: list[str] = []
    if isinstance(value, dict):
        errors += [f"{where}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key, schema.get("additionalProperties", True))
            if sub is False:
                errors.append(f"{where}: unexpected {key!r}")
            elif isinstance(sub, dict):
                errors += schema_errors(item, sub, root, f"{where}.{key}")
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf):
            errors.append(f"{where}: {len(value)} items")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items")
            errors += schema_errors(item, sub, root, f"{where}[{i}]") if sub else []
    if "minimum" in schema and _is_type(value, "number") and value < schema["minimum"]:
        errors.append(f"{where}: {value} < {schema['minimum']}")
    return errors


def _is_type(value: Any, name: str) -> bool:
    if name in ("number", "integer"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok and (name == "number" or float(value).is_integer())
    return isinstance(value, _TYPES[name])


def _strict(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"not strict JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def assert_valid_report(path: Path) -> dict[str, Any]:
    data = _strict(path.read_text())
    schema = json.loads(SCHEMA_FILE.read_text())
    errors = schema_errors(data, schema, schema)
    assert not errors, "\n".join(errors[:20])
    return data


NAN_SUITE = """
import pytest
from transformers.models.llama.modeling_llama import LlamaMLP
from pytest_modelpatch import assert_equivalent, check_equivalent


class NaNMLP(LlamaMLP):
    def forward(self, x):
        return super().forward(x) * float("nan")


@pytest.mark.model("llama")
@pytest.mark.patch({"LlamaMLP": NaNMLP})
def test_nan(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)


@pytest.mark.model("llama")
@pytest.mark.patch(unpatched=True)
def test_property(reference_model, patched_model):
    check_equivalent(reference_model, patched_model, max_examples=3)
"""


def test_a_nan_producing_patch_writes_a_strict_report_valid_against_the_schema(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nan=NAN_SUITE)
    result = pytester.runpytest("-p", "no:randomly", "--modelpatch-report", "r.json")
    result.assert_outcomes(passed=1, failed=1)
    data = assert_valid_report(pytester.path / "r.json")
    assert data["schema_version"] == 4
    nan, prop = data["rows"]
    assert (nan["max_abs_error"], nan["max_rel_error"]) == ("inf", "inf")
    assert any(error == "inf" for _, error in nan["profile"])
    # the terminal table prints inf, not the float64 maximum (1.8e+308), and a passing property
    # row shows its worst example's device, dtype and tolerance instead of -@-
    result.stdout.fnmatch_lines(["failed   inf      inf  *equivalence#1*test_nan.py::test_nan"])
    result.stdout.no_fnmatch_line("*1.8e+308*")
    assert (prop["device"], prop["dtype"], prop["outcome"], prop["examples"]) == ("cpu", "float32", "passed", 3)
    assert prop["atol"] is not None and prop["output"]
    assert load_report(pytester.path / "r.json")["rows"][0]["max_abs_error"] == math.inf


def test_non_finite_figures_round_trip_and_print_as_inf_and_nan(tmp_path: Path) -> None:
    record = CheckRecord(kind="equivalence", outcome="failed", max_abs_error=math.inf, max_rel_error=math.nan,
                         profile=[("model.layers.0.mlp", -math.inf)])  # fmt: skip
    write_report(tmp_path / "r.json", {"seed": 0}, [row_from_record(record, "t.py::test_a", 1)])
    assert '"max_abs_error": "inf"' in (tmp_path / "r.json").read_text()
    row = assert_valid_report(tmp_path / "r.json")["rows"][0]
    assert (row["max_rel_error"], row["profile"]) == ("nan", [["model.layers.0.mlp", "-inf"]])
    back = load_report(tmp_path / "r.json")["rows"][0]
    assert back["max_abs_error"] == math.inf and math.isnan(back["max_rel_error"])
    assert summary_lines([back])[1].split()[:3] == ["failed", "inf", "nan"]


def test_the_validator_rejects_what_the_schema_forbids(tmp_path: Path) -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    row = row_from_record(CheckRecord(kind="equivalence", outcome="passed", max_abs_error=0.0), "t.py::test_a", 1)
    good = {"schema_version": 4, "header": {"seed": 0}, "rows": [row]}
    assert schema_errors(good, schema, schema) == []
    for broken in (
        {**row, "max_abs_error": "Infinity"},
        {**row, "outcome": "xfailed"},
        {**row, "expected_failure": "yes"},
    ):
        assert schema_errors({**good, "rows": [broken]}, schema, schema), broken
    assert schema_errors({"header": {}, "rows": []}, schema, schema) == ["$: missing 'schema_version'"]
    with pytest.raises(ValueError, match="bare Infinity"):
        _strict('{"max_abs_error": Infinity}')


def test_a_report_with_a_family_sweep_is_valid_and_a_wrong_outcome_is_not(tmp_path: Path) -> None:
    record = CheckRecord(kind="equivalence", outcome="failed", model="GemmaForCausalLM", max_abs_error=2.0)
    where = "first diverging module: model.norm (GemmaRMSNorm in the reference, LlamaStyleNorm in the patched model)"
    refusal = "XLMWithLMHeadModel does not support an attention implementation through ... yet."
    sweeps = {"t.py::test_norm": {"gemma": ("failed", where), "llama": ("passed", ""), "bark": ("skipped", ""),
                                  "xlm": ("not applicable", refusal)}}  # fmt: skip
    write_report(tmp_path / "r.json", {"seed": 0}, [row_from_record(record, "t.py::test_norm[gemma]", 1)], sweeps)
    data = assert_valid_report(tmp_path / "r.json")
    assert data["sweeps"]["t.py::test_norm"]["gemma"] == {"outcome": "failed", "divergence": where}
    assert data["sweeps"]["t.py::test_norm"]["xlm"] == {
        "outcome": "not applicable",
        "divergence": "",
        "reason": refusal,
    }
    schema = json.loads(SCHEMA_FILE.read_text())
    data["sweeps"]["t.py::test_norm"]["llama"]["outcome"] = "ok"
    assert schema_errors(data, schema, schema), "an outcome outside the enum must be refused"
