"""The docs cannot rot: every ```python block in docs/*.md and README.md runs here.

A block that defines ``test_`` functions, a ``Test`` class or uses ``@pytest.mark`` is a
test module: all such blocks of one markdown file are written as separate test files and
run in one pytester run (with ``docs/conftest.py`` as the conftest); each must pass. Any
other block is a snippet: the snippets of one file are exec'd one by one, each in a fresh
namespace and inside ``isolated_patch_state()``, in one subprocess with the repo root on
``PYTHONPATH``; each must run without raising. The comment line right before a block
changes that:

- ``<!-- doc: expect-fail -->`` or ``<!-- doc: expect-fail: TEXT -->``: the block must fail
  (a test fails or errors, a snippet raises), with TEXT in the failure when given;
- ``<!-- doc: skip: REASON -->``: not run (only for what cannot run here, e.g. needs a GPU);
- ``<!-- doc: file: NAME.py -->``: a module the page asks the reader to save as NAME.py; it runs as a
  snippet, and is written as NAME.py beside the page's test modules and snippets, which import it.

``<!-- doc: pytest-args: -n 2 -->`` anywhere in a file adds arguments to its pytester run.
Output blocks (```text, ```console, ```bash) are not run. A ```text block marked
``<!-- doc: output -->`` quotes the failure of the expect-fail block above it (``<!-- doc: output:
NAME -->``: of ``QUOTE_SOURCES[NAME]``): each line it quotes must be in the real failure, its
figures up to CPU round-off (``_support/quoted_output.py``). So must quickstart's quote of the main job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _support.quoted_output import same_line, same_lines
from _support.runs import keep_the_lint_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [*sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "README.md"]
REFERENCE = REPO_ROOT / "docs" / "reference.md"

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc:\s*(?P<name>[\w-]+)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")
_PYTEST_ARGS = re.compile(r"<!--\s*doc:\s*pytest-args:\s*(?P<args>.*?)\s*-->")
_TEST_MODULE = re.compile(r"^(\s*(async\s+)?def test_|class Test|\s*@pytest\.mark\.|pytestmark\s*=)", re.M)
_DIRECTIVES = ("expect-fail", "skip", "file")  # on python blocks; "output" marks a text block (a quoted failure)


@dataclass(frozen=True)
class CodeBlock:
    """One fenced code block of a markdown file, with the directive comment right before it."""

    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    directive: str = ""
    directive_arg: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"

    @property
    def is_test_module(self) -> bool:
        return bool(_TEST_MODULE.search(self.code))

    @property
    def module_name(self) -> str:
        """The test file this block becomes in its pytester run, e.g. ``test_quickstart_L12``."""
        stem = re.sub(r"\W", "_", self.path.stem.lower())
        return f"test_{stem}_L{self.line}"

    def __str__(self) -> str:
        return f"{self.id} ({self.language}{', ' + self.directive if self.directive else ''})"


def code_blocks(path: Path, text: str | None = None) -> list[CodeBlock]:
    """Every fenced block of a markdown file, in order."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = len(opening["indent"])
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        body = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        directive = _DIRECTIVE.match(previous)
        name, arg = (directive["name"], directive["arg"] or "") if directive else ("", "")
        blocks.append(CodeBlock(path, i + 1, opening["lang"].lower(), body, "" if name == "pytest-args" else name, arg))
        i = end + 1
    return blocks


def python_blocks() -> list[CodeBlock]:
    return [b for path in DOC_FILES for b in code_blocks(path) if b.language in ("python", "py")]


def write_page_files(path: Path, folder: Path) -> None:
    """The modules ``path`` asks its reader to save (``<!-- doc: file: NAME.py -->``), written into ``folder``."""
    for block in python_blocks():
        if block.path == path and block.directive == "file":
            (folder / block.directive_arg).write_text(block.code)


# ---------------------------------------------------------------------------
# running a file's blocks: once per file per process, shared by its blocks' tests
# ---------------------------------------------------------------------------


@dataclass
class FileRun:
    """What happened to each block of one markdown file (keyed by line)."""

    outcomes: dict[int, list[tuple[str, str]]] = field(default_factory=dict)  # line -> [(outcome, message)]
    output: str = ""


_RUNS: dict[tuple[Path, str], FileRun] = {}


def run_test_modules(path: Path, pytester: pytest.Pytester) -> FileRun:
    """All test-module blocks of ``path`` in one pytester run; outcomes per block from its JUnit XML."""
    key = (path, "tests")
    if key in _RUNS:
        return _RUNS[key]
    blocks = [b for b in python_blocks() if b.path == path and b.is_test_module and b.directive != "skip"]
    pytester.makeconftest((REPO_ROOT / "docs" / "conftest.py").read_text())
    pytester.makepyfile(**{b.module_name: b.code for b in blocks})
    write_page_files(path, pytester.path)
    extra = _PYTEST_ARGS.search(path.read_text())
    args = extra["args"].split() if extra else []
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider", "--junitxml=junit.xml", "-rA", *args)
    run = FileRun(output=str(result.stdout) + str(result.stderr))
    by_module = {b.module_name: b.line for b in blocks}
    junit = pytester.path / "junit.xml"
    cases = ET.parse(junit).getroot().iter("testcase") if junit.exists() else []
    for case in cases:
        module = (case.get("classname") or case.get("name") or "").split(".")[0]
        if module not in by_module:
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else child.tag
                message = f"{child.get('message', '')}\n{child.text or ''}"
        run.outcomes.setdefault(by_module[module], []).append((outcome, message))
    _RUNS[key] = run
    return run


_SNIPPET_RUNNER = """
import contextlib, io, json, sys, traceback
from pytest_modelpatch.isolation.guard import isolated_patch_state
blocks, results = json.load(open(sys.argv[1])), {}
for block in blocks:
    out = io.StringIO()
    try:
        with isolated_patch_state(), contextlib.redirect_stdout(out):
            exec(compile(block["code"], block["id"], "exec"), {"__name__": "__main__"})
        results[block["line"]] = [["passed", out.getvalue()]]
    except BaseException:
        results[block["line"]] = [["failure", traceback.format_exc()]]
json.dump(results, open(sys.argv[2], "w"))
"""


def run_snippets(path: Path, tmp_path: Path) -> FileRun:
    """All snippet blocks of ``path``, each in a fresh namespace, in one subprocess."""
    key = (path, "snippets")
    if key in _RUNS:
        return _RUNS[key]
    blocks = [b for b in python_blocks() if b.path == path and not b.is_test_module and b.directive != "skip"]
    source, results = tmp_path / "snippets.json", tmp_path / "results.json"
    write_page_files(path, tmp_path)  # snippets run with tmp_path as their cwd, first on sys.path
    source.write_text(json.dumps([{"id": b.id, "line": b.line, "code": b.code} for b in blocks]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _SNIPPET_RUNNER, str(source), str(results)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    outcomes = json.loads(results.read_text()) if results.exists() else {}
    run = FileRun({int(line): [tuple(o) for o in found] for line, found in outcomes.items()}, done.stdout + done.stderr)
    _RUNS[key] = run
    return run


def check_outcomes(block: CodeBlock, run: FileRun) -> None:
    """The block ran as its directive says; otherwise fail with what happened."""
    __tracebackhide__ = True
    found = run.outcomes.get(block.line)
    if not found:
        pytest.fail(f"{block}: nothing ran (a collection error?). Output:\n{run.output[-6000:]}", pytrace=False)
    bad = [message for outcome, message in found if outcome in ("failure", "error")]
    if block.directive == "expect-fail":
        if not bad:
            pytest.fail(f"{block} is marked expect-fail but passed: {[o for o, _ in found]}", pytrace=False)
        if block.directive_arg and not any(block.directive_arg in message for message in bad):
            pytest.fail(
                f"{block} failed without {block.directive_arg!r} in the failure:\n{bad[0][-4000:]}", pytrace=False
            )
    elif bad:
        pytest.fail(f"{block} failed:\n{bad[0][-6000:]}", pytrace=False)


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.id)
def test_python_block_runs_as_documented(
    block: CodeBlock, pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block.directive and block.directive not in _DIRECTIVES:
        pytest.fail(f"{block}: unknown directive {block.directive!r}; use one of {_DIRECTIVES}", pytrace=False)
    if block.directive == "skip":
        assert block.directive_arg, f"{block}: <!-- doc: skip: REASON --> needs the reason it cannot run here"
        pytest.skip(f"{block.id}: {block.directive_arg}")
    if block.directive == "file":
        assert re.fullmatch(r"\w+\.py", block.directive_arg), f"{block}: <!-- doc: file: NAME.py --> needs a module"
    keep_the_lint_cache(monkeypatch)
    run = run_test_modules(block.path, pytester) if block.is_test_module else run_snippets(block.path, tmp_path)
    check_outcomes(block, run)


# ---------------------------------------------------------------------------
# the block collector itself
# ---------------------------------------------------------------------------


def test_code_blocks_reads_language_line_and_directive() -> None:
    text = "intro\n\n<!-- doc: expect-fail: AssertionError -->\n```python\nassert False\n```\n\n```text\nout\n```\n"
    blocks = code_blocks(REPO_ROOT / "docs" / "x.md", text)
    assert [(b.language, b.line, b.directive, b.directive_arg) for b in blocks] == [
        ("python", 4, "expect-fail", "AssertionError"),
        ("text", 8, "", ""),
    ]
    assert blocks[0].code == "assert False\n" and not blocks[0].is_test_module


def test_blocks_with_tests_or_marks_are_test_modules() -> None:
    text = "```python\nimport pytest\n\n@pytest.mark.model('llama')\ndef test_x(): ...\n```\n```python\nprint(1)\n```\n"
    assert [b.is_test_module for b in code_blocks(REPO_ROOT / "docs" / "x.md", text)] == [True, False]


def test_every_doc_file_has_its_python_blocks_collected() -> None:
    files = {b.path.name for b in python_blocks()}
    assert {"README.md", "quickstart.md", "troubleshooting.md", "reference.md"} <= files


def test_readme_is_for_users_first_installing_then_a_test_that_needs_nothing_of_the_repository() -> None:
    readme = REPO_ROOT / "README.md"
    headings = re.findall(r"^## (.+)$", readme.read_text(), re.M)
    users = ["What it catches", "Install", "A first test", "What each check adds", "Links"]
    assert headings[: len(users)] == users, headings
    install = next(b for b in code_blocks(readme) if b.language == "bash")
    assert install.code.splitlines() == [
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",  # the CPU build, not GBs of CUDA
        "pip install pytest-modelpatch",
    ]
    first = next(b for b in python_blocks() if b.path == readme)
    # the kernel it checks is defined in the test file itself: the test runs where the plugin is pip-installed
    assert first.is_test_module and not first.directive and re.search(r"^class \w+\(nn\.Module\):", first.code, re.M)
    assert not re.search(r"^\s*(from|import) (fixtures|tests|docs)\b", first.code, re.M)


# ---------------------------------------------------------------------------
# docs/reference.md against pytest --markers / --help / --fixtures
# ---------------------------------------------------------------------------


def _our_markers() -> list[str]:
    from pytest_modelpatch.plugin import MARKERS

    return list(MARKERS)


def test_reference_has_every_marker_line_of_pytest_markers_verbatim(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    ours = [
        line
        for line in result.stdout.lines
        if any(line.startswith((f"@pytest.mark.{name}:", f"@pytest.mark.{name}(")) for name in _our_markers())
    ]
    assert len(ours) == len(_our_markers()), f"not every marker is registered: {ours}"
    reference = REFERENCE.read_text()
    missing = [line for line in ours if line not in reference]
    assert not missing, "docs/reference.md lacks these `pytest --markers` lines (paste them verbatim):\n" + "\n".join(
        missing
    )


def test_reference_documents_every_option_and_ini_key_of_pytest_help(pytester: pytest.Pytester) -> None:
    help_text = str(pytester.runpytest("--help").stdout)
    options = set(re.findall(r"(--modelpatch-[\w-]+)", help_text))
    ini_keys = set(re.findall(r"^\s+(modelpatch_\w+) \(", help_text, re.M))
    assert options and ini_keys
    reference = REFERENCE.read_text()
    missing = sorted(name for name in options | ini_keys if f"`{name}" not in reference)
    assert not missing, f"docs/reference.md does not document {missing} (shown by pytest --help)"
    stale = sorted(set(re.findall(r"`(--modelpatch-[\w-]+)", reference)) - options)
    assert not stale, f"docs/reference.md documents {stale}, which pytest --help does not show"


def test_reference_documents_every_fixture_of_the_plugin(pytester: pytest.Pytester) -> None:
    output = str(pytester.runpytest("--fixtures").stdout)
    section = output.split("fixtures defined from pytest_modelpatch.fixtures", 1)[1].split("\n---", 1)[0]
    fixtures = re.findall(r"^(\w+)(?: \[\w+ scope\])? -- ", section, re.M)
    assert {"reference_model", "patched_model", "patch_registry"} <= set(fixtures)
    reference = REFERENCE.read_text()
    missing = [name for name in fixtures if f"### `{name}`" not in reference]
    assert not missing, f"docs/reference.md has no '### `name`' section for fixtures {missing}"


def _documented_signature(name: str, value: object) -> str:
    """``name(params)`` as docs/reference.md writes it: defaults as literals, a function default by name."""
    import inspect

    parts: list[str] = []
    keyword_only = False
    for parameter in inspect.signature(value).parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            parts.append(f"*{parameter.name}")
            keyword_only = True
            continue
        if parameter.kind is parameter.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        if parameter.kind is parameter.VAR_KEYWORD:
            parts.append(f"**{parameter.name}")
            continue
        default = parameter.default
        if default is parameter.empty:
            parts.append(parameter.name)
        elif default is os.environ:
            parts.append(f"{parameter.name}=os.environ")
        elif callable(default):
            parts.append(f"{parameter.name}={default.__name__}")
        elif isinstance(default, str):
            parts.append(f'{parameter.name}="{default}"')
        else:
            parts.append(f"{parameter.name}={default!r}")
    return f"{name}({', '.join(parts)})"


# the face and its documented submodules, each with its own __all__, as docs/reference.md's Python API lists them
FACE = "pytest_modelpatch"
SUBMODULES = ("strategies", "models", "isolation", "lint", "report", "roundtrip", "errors")
PUBLIC_MODULES = (FACE, *(f"{FACE}.{name}" for name in SUBMODULES))


def _python_api_entries() -> dict[str, dict[str, str]]:
    """docs/reference.md's Python API tables, by the module whose heading they are under (the face's
    when none is named): module -> {name: the signature written, or '' for a bare name}."""
    section = REFERENCE.read_text().split("## Python API", 1)[1]
    by_module: dict[str, dict[str, str]] = {}
    for part in re.split(r"^### ", section, flags=re.M)[1:]:
        heading = re.match(r"`(pytest_modelpatch\.\w+)`", part)
        module = heading.group(1) if heading else FACE
        entries = by_module.setdefault(module, {})
        for row in re.findall(r"^\| (.+?) \| .+ \|$", part, re.M):
            for entry in re.findall(r"`([^`]+)`", row):
                name = re.match(r"[A-Za-z_]\w*", entry)
                assert name, f"docs/reference.md: {entry!r} in the Python API table is not a name"
                if name.group(0) in ("name",):
                    continue
                assert name.group(0) not in entries, f"docs/reference.md lists {name.group(0)} twice under {module}"
                entries[name.group(0)] = entry if "(" in entry else ""
    return by_module


def test_reference_python_api_is_each_modules_all_and_the_real_signatures() -> None:
    import importlib
    import inspect

    documented = _python_api_entries()
    assert set(documented) == set(PUBLIC_MODULES), f"docs/reference.md's Python API headings: {sorted(documented)}"
    wrong: dict[str, str] = {}
    for module_name, entries in documented.items():
        module = importlib.import_module(module_name)
        public = set(module.__all__) - {"__version__"}
        missing = sorted(public - set(entries))
        assert not missing, f"docs/reference.md lacks these names of {module_name}.__all__: {missing}"
        stale = sorted(set(entries) - public)
        assert not stale, f"docs/reference.md lists {stale} under {module_name}, whose __all__ does not export them"
        for name, written in entries.items():
            value = getattr(module, name)
            if inspect.isfunction(value) and written != (real := _documented_signature(name, value)):
                wrong[f"{module_name}.{name}"] = real
    assert not wrong, "docs/reference.md writes other signatures; the real ones:\n" + "\n".join(wrong.values())


def test_the_face_is_learnt_in_a_sitting_and_the_rest_is_in_submodules() -> None:
    import importlib

    import pytest_modelpatch

    assert len(pytest_modelpatch.__all__) <= 35, sorted(pytest_modelpatch.__all__)
    checks = {n for n in pytest_modelpatch.__all__ if n.startswith(("assert_", "check_"))}
    assert len(checks) == 12, checks  # every check is on the face
    for name in SUBMODULES:
        module = importlib.import_module(f"{FACE}.{name}")
        assert module.__doc__, f"{FACE}.{name} must say what it holds"
        assert not set(module.__all__) & set(pytest_modelpatch.__all__) - {"ModelPatchError", "PatchUsageError"}
        assert all(hasattr(module, n) for n in module.__all__), name


# The checks that run the patched model, and so can tell a replacement that never ran; a module replay, a
# round-trip's checkpoint and a set of conversions run no patched model.
RUN_THE_PATCHED_MODEL = {
    "assert_equivalent", "check_equivalent", "assert_backward_equivalent", "check_backward_equivalent",
    "assert_decodes_equivalent", "check_decodes_equivalent", "assert_trains_equivalent",
    "assert_exports_equivalent", "assert_compiles_equivalent",
}  # fmt: skip
ONE_SUBJECT = {"assert_roundtrip": ["source"], "assert_reversible": ["conversions"]}


def test_every_check_in_the_reference_follows_the_naming_rule() -> None:
    """docs/reference.md's naming rule, held for every check its tables list."""
    import inspect

    import pytest_modelpatch

    listed = _python_api_entries()[FACE]
    checks = {n: getattr(pytest_modelpatch, n) for n in listed if n.startswith(("assert_", "check_"))}
    assert set(RUN_THE_PATCHED_MODEL) <= set(checks)
    broken = []
    for name, function in sorted(checks.items()):
        parameters = inspect.signature(function).parameters
        positional = [p.name for p in parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        shape = ONE_SUBJECT.get(name, ["reference", "patched"])
        if positional[: len(shape)] != shape:
            broken.append(f"{name}{inspect.signature(function)}: takes {shape} first")
        if name.startswith("check_"):
            option = parameters.get("inputs")
            if option is None or option.kind is not option.KEYWORD_ONLY or option.default is not None:
                broken.append(f"{name}: inputs= (a strategy, keyword-only, default drawn from the config)")
            if not {"max_examples", "seed"} <= set(parameters):
                broken.append(f"{name}: max_examples= and seed=, a property's budget")
            if not any(f"assert_{name.removeprefix('check_')}" == other for other in checks):
                broken.append(f"{name}: no assert_ with the comparison it runs over drawn inputs")
        if (name in RUN_THE_PATCHED_MODEL) != ("allow_unused" in parameters):
            broken.append(f"{name}: allow_unused= is for exactly the checks that run the patched model")
        if name not in ONE_SUBJECT and not {"atol", "rtol", "policy"} <= set(parameters):
            broken.append(f"{name}: atol=, rtol=, policy= for the tolerance")
    assert not broken, "\n".join(broken)


def test_no_doc_imports_a_module_of_the_package() -> None:
    """Everything the docs, README and the main job import comes from ``pytest_modelpatch`` or a documented submodule."""
    faces = "|".join(SUBMODULES)
    internal = re.compile(
        rf"^\s*(from pytest_modelpatch\.(?!(?:{faces}) import)[\w.]+ import|import pytest_modelpatch\.(?!(?:{faces})\b))",
        re.M,
    )
    sources = [*DOC_FILES, *sorted((REPO_ROOT / "docs").rglob("*.py"))]
    found = [f"{path.relative_to(REPO_ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
             for path in sources for text in [path.read_text(encoding="utf-8")] for m in internal.finditer(text)]  # fmt: skip
    assert not found, (
        "import these from pytest_modelpatch or a documented submodule (export them there):\n" + "\n".join(found)
    )


# ---------------------------------------------------------------------------
# output the docs quote: run the command, compare
# ---------------------------------------------------------------------------

QUICKSTART = REPO_ROOT / "docs" / "quickstart.md"
# README's main job, as .ci/run runs it (-p no:randomly: the order the docs show)
MAIN_JOB = ["-m", "pytest", "docs/examples", "-rxX", "-p", "no:cacheprovider", "-p", "no:randomly"]


def comparable_output(text: str) -> list[str]:
    """pytest output from the progress line on, without the time (and its padding) and the separators' rules.

    What is left is compared line by line with :func:`quoted_output.same_line`: figures up to CPU
    round-off, everything else (counts, outcomes, ids, the order of rows) exactly.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("docs/examples/")), len(lines))
    kept = []
    for line in lines[start:]:
        line = re.sub(r" in [\d.]+s\b", " in Ns", line.rstrip())
        kept.append(line.strip("=- ") if re.fullmatch(r"[=-]+ .* [=-]+", line) else line)
    return [line for line in kept if line]


def test_comparable_output_drops_only_the_time_and_the_rules() -> None:
    quoted = "intro\ndocs/examples/t.py ..x  [100%]\n\n==== 2 passed, 1 xfailed in 11.10s ====\n"
    assert comparable_output(quoted) == ["docs/examples/t.py ..x  [100%]", "2 passed, 1 xfailed in Ns"]
    assert not same_lines(comparable_output(quoted), comparable_output(quoted.replace("1 xfailed", "2 xfailed")))
    row = "passed   4.71e-06  0.00459   equivalence#1  Qwen3VLModel  float32@cpu   t.py::test_a"
    other = "xfailed  1.37      700       equivalence#1  LlamaForCausalLM  float32@cpu   t.py::test_b"
    table = comparable_output(f"docs/examples/t.py\n{row}\n{other}")
    assert same_lines(
        table,
        comparable_output(f"docs/examples/t.py\n{row.replace('0.00459', '0.0247')}\n{other.replace('700', '699')}"),
    )
    assert not same_lines(table, comparable_output(f"docs/examples/t.py\n{other}\n{row}"))  # the order of rows is exact


def test_quickstart_quotes_what_the_main_job_prints() -> None:
    (quoted,) = [b for b in code_blocks(QUICKSTART) if b.language == "text" and "short test summary info" in b.code]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, *MAIN_JOB], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert same_lines(comparable_output(quoted.code), comparable_output(done.stdout)), (
        f"{quoted.id} no longer shows what `pytest {' '.join(MAIN_JOB[2:])}` prints; paste the real output:\n"
        + done.stdout[done.stdout.find("docs/examples/") :]
    )


# ---------------------------------------------------------------------------
# failures the docs quote: every ```text block marked <!-- doc: output --> is in a real failure
# ---------------------------------------------------------------------------

# Failures quoted where no block of the page raises them: <!-- doc: output: NAME --> runs QUOTE_SOURCES[NAME]
QUOTE_SOURCES = {
    "noncausal fused qkv": """
import pytest
from fixtures.patches import llama_fused_qkv_noncausal as broken
from pytest_modelpatch import assert_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(broken.MAPPING, conversions=broken.CONVERSIONS)
def test_quoted(reference_model, patched_model):
    assert_equivalent(reference_model, patched_model)
""",
    "noncausal fused qkv, property": """
import pytest
from fixtures.patches import llama_fused_qkv_noncausal as broken
from pytest_modelpatch import check_equivalent


@pytest.mark.model("llama")
@pytest.mark.patch(broken.MAPPING, conversions=broken.CONVERSIONS)
def test_quoted(reference_model, patched_model):
    check_equivalent(reference_model, patched_model, max_examples=50, seed=0)
""",
}


def quoted_outputs() -> list[CodeBlock]:
    """The text blocks that quote a failure (``<!-- doc: output -->``)."""
    return [b for path in DOC_FILES for b in code_blocks(path) if b.language == "text" and b.directive == "output"]


_SECTION = re.compile(r"^_{3,} .* _{3,}$")  # pytest's "____ ERROR at setup of test_x ____": terminal only
_RAISED = re.compile(r'^(?:failed on \w+ with ")?(?:[\w.]*(?:Error|Exception|Failed|Warning): )+')
_TEST_FILE = re.compile(r"\btest_\w+\.py\b")  # the page's name for its example file, the doc run's for its module


def quoted_lines(text: str) -> list[str]:
    """What a quote claims: its ``E`` lines when it has any, else every line, without pytest's ``E``, section rules and elisions."""
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and line.strip() != "..." and not _SECTION.match(line.strip())
    ]
    errors = [line for line in lines if line.startswith("E ")]
    return [_TEST_FILE.sub("test_*.py", line.removeprefix("E").strip()) for line in errors or lines]


def real_lines(message: str) -> list[str]:
    """A failure's lines as a quote may show them: with and without the exception's name in front."""
    lines = [_TEST_FILE.sub("test_*.py", line.strip().removeprefix("E ").strip()) for line in message.splitlines()]
    return lines + [_RAISED.sub("", line) for line in lines if _RAISED.match(line)]


def quoted_failure(quote: CodeBlock, pytester: pytest.Pytester, tmp_path: Path) -> str:
    """The real failure ``quote`` quotes: of the ``output: NAME`` source, or of the expect-fail block above it."""
    if quote.directive_arg:
        assert quote.directive_arg in QUOTE_SOURCES, f"{quote.id}: no QUOTE_SOURCES entry {quote.directive_arg!r}"
        pytester.makeconftest((REPO_ROOT / "docs" / "conftest.py").read_text())
        pytester.makepyfile(test_quoted=QUOTE_SOURCES[quote.directive_arg])
        result = pytester.runpytest("-p", "no:cacheprovider")
        result.assert_outcomes(failed=1)
        return "\n".join(result.outlines)
    above = [b for b in code_blocks(quote.path) if b.language in ("python", "py") and b.line < quote.line]
    assert above and above[-1].directive == "expect-fail", (
        f"{quote.id}: <!-- doc: output --> quotes the expect-fail block above it; there is none"
    )
    block = above[-1]
    run = run_test_modules(block.path, pytester) if block.is_test_module else run_snippets(block.path, tmp_path)
    failures = [message for outcome, message in run.outcomes.get(block.line, []) if outcome in ("failure", "error")]
    assert failures, f"{block} did not fail: {run.outcomes.get(block.line)}"
    return failures[0]


@pytest.mark.parametrize("quote", quoted_outputs(), ids=lambda b: b.id)
def test_quoted_failure_is_what_the_code_raises(
    quote: CodeBlock, pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep_the_lint_cache(monkeypatch)
    message = quoted_failure(quote, pytester, tmp_path)
    real = real_lines(message)
    stale = [line for line in quoted_lines(quote.code) if not any(same_line(line, r) for r in real)]
    assert not stale, (
        f"{quote.id} quotes lines the failure no longer has:\n" + "\n".join(stale) + f"\n\nreal:\n{message[-6000:]}"
    )


def test_the_docs_quote_failures_and_each_quote_is_checked() -> None:
    quotes = {b.id for b in quoted_outputs()}
    assert {"docs/quickstart.md", "docs/equivalence.md", "docs/decoding.md"} <= {i.rpartition(":")[0] for i in quotes}
    assert set(QUOTE_SOURCES) <= {b.directive_arg for b in quoted_outputs()}, "a QUOTE_SOURCES entry no quote uses"
