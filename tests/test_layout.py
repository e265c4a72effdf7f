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

# room -> the rooms its modules may import (the wiring modules plugin, fixtures, item_markers and cli may import
# anything; the faces import nothing at module level and load their names lazily). errors and settings are
# the bottom: every room may import them, and they import no room. reporting.session, the pytest side of
# reporting, keeps to its room. The data flow of docs/architecture.md, lowest room first
BOTTOM = {"errors", "settings"}
ALLOWED = {
    "errors": set(),
    "settings": set(),
    "families": BOTTOM,
    "lint": BOTTOM | {"families"},  # the contract lint's tiny structures: each family's tiny config
    "reporting": BOTTOM,
    "isolation": BOTTOM | {"lint"},
    "models": BOTTOM | {"families", "isolation", "lint"},
    "compare": BOTTOM | {"families", "isolation", "models", "reporting"},
    "roundtrip": BOTTOM | {"families", "isolation", "models", "compare", "reporting"},
    "parallel": BOTTOM | {"reporting"},
}
WIRING = {f"{NAME}.plugin", f"{NAME}.fixtures", f"{NAME}.item_markers", f"{NAME}.cli", f"{NAME}.__main__", NAME}
# the documented submodules that are not a room of their own: each re-exports names of the rooms, lazily
FACES = {f"{NAME}.strategies", f"{NAME}.report"}


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
        if module in WIRING or module in FACES:
            continue
        room = _room(module)
        for target in targets:
            other = _room(target)
            if other != room and other not in ALLOWED[room]:
                wrong.append(f"{module} imports {target}: {room}/ may import only {sorted(ALLOWED[room]) or 'nothing'}")
    assert not wrong, "\n".join(wrong)


# Process-wide state is kept one way: the session's settings in settings.SETTINGS, per-test
# state in ContextVars or on the plugin objects (isolation.per_test.scopes, reporting.session). Two kinds
# may be kept otherwise, each named here with its reason: state that mirrors transformers' own globals,
# which are process-wide themselves, and caches of what a key alone determines (read, never a flag).
KEPT_STATE: dict[tuple[str, str], str] = {
    (f"{NAME}.isolation.interception", "ACTIVE"): "the snapshots whose wrappers are in transformers' modules now",
    (f"{NAME}.isolation.interception", "_ORIGINALS"): "transformers' functions the wrappers replaced, put back after",
    (f"{NAME}.isolation.interception", "_HELD"): "whether the session holds those wrappers in transformers' modules",
    (f"{NAME}.isolation.library_state", "_IMPORTED"): "each transformers module's state right after it executed",
    (f"{NAME}.isolation.registries", "_WALKED"): "a cache: the registries each loaded transformers module holds",
    (f"{NAME}.isolation.registries", "_IMPORT_WRITES"): "what transformers' imports wrote into its registries",
    (f"{NAME}.isolation.registries", "_AS_IMPORTED"): "transformers' registries as importing built them",
    (f"{NAME}.isolation.library_state", "_MODELING_NAMES"): "the transformers modeling modules loaded so far",
    (f"{NAME}.isolation.library_state", "_CLASS_KEYS"): "which of a transformers module's names hold classes",
    (f"{NAME}.isolation.snapshot", "_BUILTIN_CONVERSIONS"): "transformers' checkpoint conversions as built in",
    (f"{NAME}.lint.contract.cache", "_CACHES"): "a cache: the facts file of one transformers install",
    (f"{NAME}.lint.scan_index", "_LOADED"): "a cache: the scan index of one transformers install",
    (f"{NAME}.models.checkpoints", "_SESSION_CHECKPOINTS"): "a cache: the checkpoint directory one key names",
}
_MUTATORS = frozenset(
    {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard", "clear"}
)


def _is_empty_container(value: ast.expr | None) -> bool:
    """``[]``, ``{}``, ``list()``, ``dict()`` or ``set()``: a container a module starts empty and fills."""
    if isinstance(value, ast.List | ast.Set):
        return not value.elts
    if isinstance(value, ast.Dict):
        return not value.keys
    return (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("list", "dict", "set")
        and not value.args and not value.keywords
    )  # fmt: skip


def _mutated_names(tree: ast.Module) -> set[str]:
    """Names whose value is changed in place anywhere in the module: ``X.append(...)``, ``X[k] = v``, ``del X[k]``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            target = node.func.value
            found |= {target.id} if isinstance(target, ast.Name) else set()
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            found |= {t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
    return found


def _mutable_cells(tree: ast.Module) -> list[tuple[str, int]]:
    """State kept on the side: module-level one-item lists (``_FLAG = [False]``), ``global`` statements, and
    module-level empty lists, dicts and sets the module fills later (``_HELD: list[bool] = []`` then ``.append``).
    """
    found = []
    mutated = _mutated_names(tree)
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if isinstance(value, ast.List) and len(value.elts) == 1:
            found += [(ast.unparse(target), node.lineno) for target in targets]
        elif _is_empty_container(value):
            found += [(t.id, node.lineno) for t in targets if isinstance(t, ast.Name) and t.id in mutated]
    found += [(name, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names]
    return found


def test_process_wide_state_is_kept_one_way() -> None:
    wrong = [
        f"{module}:{line}: {name} (a one-item list, a global, or a module-level container filled later): put a "
        "session setting in settings.SETTINGS, per-test state in a ContextVar or on the plugin object; "
        "a mirror of transformers' globals or a cache goes in KEPT_STATE with its reason"
        for module, path in sorted(_modules().items())
        for name, line in _mutable_cells(ast.parse(path.read_text()))
        if (module, name) not in KEPT_STATE
    ]
    assert not wrong, "\n".join(wrong)


def test_every_kept_state_is_still_there() -> None:
    found = {
        (module, name) for module, path in _modules().items() for name, _ in _mutable_cells(ast.parse(path.read_text()))
    }
    assert not set(KEPT_STATE) - found, f"KEPT_STATE names state that is gone: {sorted(set(KEPT_STATE) - found)}"


def test_the_state_check_sees_a_one_item_list_and_a_global() -> None:
    source = "_VERBOSE: list[bool] = [False]\n_COUNT = [0]\n_OK = [1, 2]\ndef f():\n    global _sink\n"
    assert [name for name, _ in _mutable_cells(ast.parse(source))] == ["_VERBOSE", "_COUNT", "_sink"]


def test_the_state_check_sees_a_module_level_container_filled_later() -> None:
    source = (
        "_HELD: list[bool] = []\n_SEEN = set()\n_BY_NAME: dict[str, int] = {}\n_DONE = dict()\n"
        "_CONSTANT: list[str] = []\n_READ_ONLY = {}\n"
        "def hold():\n    _HELD.append(True)\n    _SEEN.add(1)\n    _BY_NAME['a'] = 1\n    del _DONE['b']\n"
        "def read():\n    return _READ_ONLY.get('a'), list(_CONSTANT)\n"
    )
    assert [name for name, _ in _mutable_cells(ast.parse(source))] == ["_HELD", "_SEEN", "_BY_NAME", "_DONE"]


def test_the_state_check_sees_the_session_hold_of_interception() -> None:
    path = _modules()[f"{NAME}.isolation.interception"]
    assert "_HELD" in {name for name, _ in _mutable_cells(ast.parse(path.read_text()))}


def _rooms() -> list[str]:
    """Every subpackage of the package, as a path below it: ``compare``, ``compare/forward``, ``families/shrink``."""
    return sorted(
        init.parent.relative_to(PACKAGE).as_posix() for init in PACKAGE.rglob("__init__.py") if init.parent != PACKAGE
    )


def test_the_architecture_page_describes_every_room() -> None:
    page = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    undescribed = [room for room in _rooms() if f"`{room}/`" not in page]
    assert not undescribed, f"docs/architecture.md does not say what these rooms hold: {undescribed}"


def test_every_module_the_architecture_page_names_exists() -> None:
    page = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w/]+\.py)`", page))
    files = {path.relative_to(PACKAGE).as_posix() for path in _modules().values()}
    missing = sorted(
        n for n in named
        if n not in files and not any(f.endswith("/" + n) for f in files) and not (REPO_ROOT / n).is_file()
    )  # fmt: skip
    assert not missing, f"docs/architecture.md names modules the package does not have: {missing}"


# compare/ is cut as docs/ is, one room a capability, on the private engine they share. The engine
# imports no capability; a capability imports the engine and the capabilities it builds on.
COMPARE_ROOMS: dict[str, set[str]] = {
    "_engine": set(),
    "backward": {"_engine"},
    "forward": {"_engine", "backward"},  # check_backward_equivalent runs the property check's loop on a training step
    "training": {"_engine", "backward"},  # optimizer steps start from one backward step's run
    "decoding": {"_engine"},
    "graph": {"_engine"},
}


def test_compare_is_cut_by_capability_on_one_engine() -> None:
    compare = PACKAGE / "compare"
    top = sorted(p.name for p in compare.glob("*.py"))
    assert len(top) <= 8, f"compare/ holds {len(top)} modules at its top; put them in a capability room: {top}"
    rooms = sorted(p.name for p in compare.iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(COMPARE_ROOMS), rooms
    for room in rooms:
        assert ast.get_docstring(ast.parse((compare / room / "__init__.py").read_text())), (
            f"compare/{room}/ must say what it holds"
        )
    wrong = []
    for module, targets in _graph().items():
        parts = module.split(".")
        if parts[:2] != [NAME, "compare"] or len(parts) < 4:
            continue
        for target in targets:
            other = target.split(".")
            if other[:2] == [NAME, "compare"] and len(other) > 2 and other[2] != parts[2]:
                if other[2] not in COMPARE_ROOMS[parts[2]]:
                    wrong.append(
                        f"{module} imports {target}: compare/{parts[2]}/ may import only {sorted(COMPARE_ROOMS[parts[2]])}"
                    )
    assert not wrong, "\n".join(wrong)


def test_the_package_has_one_room_per_capability() -> None:
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in ("__pycache__", "py.typed"))
    # the rooms, the wiring (plugin, fixtures, item_markers, cli, __main__), the bottom (errors, settings), the faces
    assert len(entries) <= 18, entries
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
    import importlib

    api = re.split(r"^### ", (REPO_ROOT / "docs" / "reference.md").read_text().split("## Python API", 1)[1], flags=re.M)
    listed: dict[str, set[str]] = {}
    for part in api[1:]:
        heading = re.match(r"`(pytest_modelpatch\.\w+)`", part)
        listed.setdefault(heading.group(1) if heading else NAME, set()).update(_api_names(part))
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        pattern = r"^\s*from (pytest_modelpatch(?:\.\w+)?) import (?:\(([^)]*)\)|([^\n]+))"
        for match in re.finditer(pattern, doc.read_text(), re.M):
            names = (match.group(2) or match.group(3)).split("#")[0]
            listed.setdefault(match.group(1), set()).update(n.strip() for n in names.split(",") if n.strip())
    assert len(listed[NAME]) > 20, listed
    missing = sorted(
        f"{module}.{n}" for module, names in listed.items() for n in names
        if n not in getattr(importlib.import_module(module), "__all__", ())
        or not hasattr(importlib.import_module(module), n)
    )  # fmt: skip
    assert not missing, f"listed in the docs but not exported by their module: {missing}"


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
