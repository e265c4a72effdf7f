"""The package's shape: rooms, the direction of imports, errors in one place, what the wheel ships.

docs/architecture.md draws what these tests pin; a change that breaks one of them changes the
architecture and should change that page too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pytest_modelpatch

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "pytest_modelpatch"
NAME = "pytest_modelpatch"
SUBPACKAGES = ["compare", "families", "isolation", "lint", "models", "parallel", "reporting", "roundtrip"]

# room -> the rooms its modules may import (the wiring modules plugin, fixtures and cli may import anything;
# reporting.session, the pytest side of reporting, keeps to its room: the session's settings reach
# models/ and compare/ through reporting.records, no arrow back up); the data flow of
# docs/architecture.md, lowest room first
ALLOWED = {
    "errors": set(),
    "families": {"errors"},
    "lint": {"errors"},
    "reporting": {"errors"},
    "isolation": {"errors", "lint", "reporting"},  # reporting.records: the implementation axes
    "models": {"errors", "families", "isolation", "lint", "reporting"},  # reporting.records: the session's settings
    "compare": {"errors", "families", "isolation", "models", "reporting"},
    "roundtrip": {"errors", "families", "isolation", "models", "compare", "reporting"},
    "parallel": {"errors", "reporting"},
}
WIRING = {f"{NAME}.plugin", f"{NAME}.fixtures", f"{NAME}.cli", f"{NAME}.__main__", NAME}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Package modules ``module`` imports, at module level or inside functions; TYPE_CHECKING blocks excluded."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        targets |= {n for n in names if n in known and n not in (module, NAME)}
    return targets


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {module: _imports(module, path, known) for module, path in known.items()}


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_no_import_cycles_among_the_package_modules() -> None:
    graph = _graph()
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_each_room_imports_only_the_rooms_below_it() -> None:
    wrong = []
    for module, targets in _graph().items():
        if module in WIRING:
            continue
        room = _room(module)
        for target in targets:
            other = _room(target)
            if other != room and other not in ALLOWED[room]:
                wrong.append(f"{module} imports {target}: {room}/ may import only {sorted(ALLOWED[room]) or 'nothing'}")
    assert not wrong, "\n".join(wrong)


# Process-wide state is kept one way: the session's settings in reporting.records.SETTINGS, per-test
# state in ContextVars or on the plugin objects (isolation.per_test.scopes, reporting.session). Only state that
# mirrors transformers' own globals (interception.py, library_state.py) may be kept otherwise, named
# here as (module, name) with the reason; none needs to be today.
MIRROR_STATE: frozenset[tuple[str, str]] = frozenset()


def _mutable_cells(tree: ast.Module) -> list[tuple[str, int]]:
    """Module-level one-item lists (``_FLAG = [False]``) and ``global`` statements: state kept on the side."""
    found = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.List) and len(value.elts) == 1:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(ast.unparse(target), node.lineno) for target in targets]
    found += [(name, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names]
    return found


def test_process_wide_state_is_kept_one_way() -> None:
    wrong = [
        f"{module}:{line}: {name} (a one-item list or a global): put a session setting in reporting.records.SETTINGS, "
        "per-test state in a ContextVar or on the plugin object"
        for module, path in sorted(_modules().items())
        for name, line in _mutable_cells(ast.parse(path.read_text()))
        if (module, name) not in MIRROR_STATE
    ]
    assert not wrong, "\n".join(wrong)


def test_the_state_check_sees_a_one_item_list_and_a_global() -> None:
    source = "_VERBOSE: list[bool] = [False]\n_COUNT = [0]\n_OK = [1, 2]\ndef f():\n    global _sink\n"
    assert [name for name, _ in _mutable_cells(ast.parse(source))] == ["_VERBOSE", "_COUNT", "_sink"]


def test_the_architecture_page_names_every_module_of_the_package() -> None:
    page = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    unnamed = sorted(
        path.relative_to(PACKAGE).as_posix() for path in _modules().values()
        if path.name not in ("__init__.py", "__main__.py") and f"`{path.name}`" not in page
    )  # fmt: skip
    assert not unnamed, f"docs/architecture.md does not say what these modules hold: {unnamed}"


def test_the_package_has_one_room_per_capability() -> None:
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in ("__pycache__", "py.typed"))
    assert len(entries) <= 14, entries
    for room in SUBPACKAGES:
        init = PACKAGE / room / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{room}/__init__.py must say what the room owns"


def test_every_public_exception_and_warning_class_is_defined_in_errors() -> None:
    errors = _modules()[f"{NAME}.errors"]
    elsewhere = []
    for module, path in _modules().items():
        if path == errors:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # a private class is control flow inside one module (forward.properties._ExampleFailed), not API
            if (
                isinstance(node, ast.ClassDef)
                and not node.name.startswith("_")
                and any(re.search(r"(Error|Exception|Warning)$", ast.unparse(base)) for base in node.bases)
            ):
                elsewhere.append(f"{module}.{node.name}")
    assert not elsewhere, f"define these in errors.py: {elsewhere}"
    from pytest_modelpatch import errors as errors_module

    for name in pytest_modelpatch.__all__:
        if name.endswith(("Error", "Warning")):
            assert getattr(pytest_modelpatch, name).__module__ == errors_module.__name__, name


def _api_names(text: str) -> set[str]:
    """Leading identifiers of the backticked entries in the first column of a markdown table."""
    names = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            first = line.split(" | ")[0]
            names |= {m.group(1) for m in re.finditer(r"`([A-Za-z_]\w*)[(`]", first)}
    return names


def test_every_python_name_the_docs_list_resolves_from_the_package() -> None:
    reference = (REPO_ROOT / "docs" / "reference.md").read_text()
    api = _api_names(reference.split("## Python API", 1)[1])
    imported = set()
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"^\s*from pytest_modelpatch import (?:\(([^)]*)\)|([^\n]+))", doc.read_text(), re.M):
            names = (match.group(1) or match.group(2)).split("#")[0]
            imported |= {n.strip() for n in names.split(",") if n.strip()}
    assert len(api) > 20, api
    missing = sorted(
        n for n in api | imported if n not in pytest_modelpatch.__all__ or not hasattr(pytest_modelpatch, n)
    )
    assert not missing, f"listed in the docs but not exported by pytest_modelpatch: {missing}"


GATE_PROBE = """
import json, sys
from pytest_modelpatch.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "loaded": sorted(m for m in ("pytest", "torch", "transformers") if m in sys.modules)}))
"""


@pytest.mark.parametrize("report", ["missing", "written"])
def test_modelpatch_gate_imports_neither_pytest_nor_torch(tmp_path: Path, report: str) -> None:
    path = tmp_path / "r.json"
    if report == "written":
        row = {"nodeid": "t.py::test_a", "check": "equivalence#1", "kind": "equivalence", "outcome": "passed",
               "max_abs_error": 1e-7, "max_rel_error": 1e-6, "model": "LlamaForCausalLM"}  # fmt: skip
        path.write_text('{"header": {}, "rows": [' + __import__("json").dumps(row) + "]}")
    probe = subprocess.run(
        [sys.executable, "-c", GATE_PROBE, "gate", str(path)], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    result = __import__("json").loads(probe.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], probe.stderr
    assert result["code"] == (2 if report == "missing" else 0), probe.stderr
    if report == "missing":
        assert "no such report" in probe.stderr


def test_the_wheel_ships_every_subpackage(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO_ROOT)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("pytest_modelpatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in _modules().values():
        assert path.relative_to(REPO_ROOT).as_posix() in names, f"{path} is not in the wheel"
    assert f"{NAME}/py.typed" in names
    assert f"{NAME}/reporting/report.schema.json" in names  # reports are validated against it
