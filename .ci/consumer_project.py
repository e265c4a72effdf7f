"""A user's project made from a docs page, and the judgement of its run (the consumer lane, .ci/consumer).

    python3 .ci/consumer_project.py write docs/quickstart.md OUT   # OUT: the page's files, as a reader saves them
    python3 .ci/consumer_project.py check OUT                      # after pytest ran in OUT: was it what the page says?

The page's Python blocks, read as tests/test_docs.py reads them (the comment line right before a block):

- ``<!-- doc: file: NAME.py -->``: a module the reader saves as NAME.py;
- a block with tests (``def test_``, ``@pytest.mark``): a test file; with ``<!-- doc: expect-fail: TEXT -->``
  it plants a bug, and gets a strict xfail mark: the run must report it xfailed, its check's report row
  meant to fail and saying TEXT;
- any other block: a script, run with ``python SCRIPT`` in OUT (``expected.json`` lists them), which must
  run without raising;
- ``<!-- doc: skip: REASON -->``: left out (shell commands, what needs a GPU).

Standard library only: it runs with whatever python3 the CI machine has, outside the venv under test.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc:\s*(?P<name>[\w-]+)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")
_TEST_MODULE = re.compile(r"^(\s*(async\s+)?def test_|class Test|\s*@pytest\.mark\.|pytestmark\s*=)", re.M)


def python_blocks(page: Path) -> list[tuple[int, str, str, str]]:
    """``(line of the opening fence, code, directive, its argument)`` for each Python block of ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = len(opening["indent"])
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        directive = _DIRECTIVE.match(previous)
        if opening["lang"].lower() in ("python", "py"):
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            name, arg = (directive["name"], directive["arg"] or "") if directive else ("", "")
            # a pytest-args comment sets the page's pytest arguments, not the block's directive
            blocks.append((i + 1, code, "" if name == "pytest-args" else name, arg))
        i = end + 1
    return blocks


def xfail_mark(text: str) -> str:
    """What a planted-bug block gets appended: it must fail (strict), with an AssertionError."""
    reason = f"planted bug: {text}"
    return f"\n\npytestmark = pytest.mark.xfail(strict=True, raises=AssertionError, reason={reason!r})\n"


def write_project(page: Path, out: Path) -> dict[str, Any]:
    """Write ``page``'s files into ``out`` and ``out/expected.json``; returns what the run must show."""
    out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"\W", "_", page.stem.lower())
    expected: dict[str, Any] = {"tests": {}, "scripts": []}
    for line, code, directive, arg in python_blocks(page):
        if directive == "skip":
            continue
        if directive == "file":
            if not re.fullmatch(r"\w+\.py", arg):
                raise SystemExit(f"{page}:{line}: <!-- doc: file: NAME.py --> needs a module name, not {arg!r}")
            (out / arg).write_text(code)
        elif _TEST_MODULE.search(code):
            name = f"test_{stem}_L{line}"
            if directive == "expect-fail":
                if "pytestmark" in code or not re.search(r"^import pytest$", code, re.M):
                    raise SystemExit(f"{page}:{line}: a planted-bug block must `import pytest` and set no pytestmark")
                code += xfail_mark(arg)
            (out / f"{name}.py").write_text(code)
            expected["tests"][name] = {"outcome": "xfailed" if directive == "expect-fail" else "passed", "text": arg}
        else:
            if directive == "expect-fail":
                raise SystemExit(f"{page}:{line}: a script that must fail is not one a reader runs; make it a test")
            name = f"script_{stem}_L{line}.py"
            (out / name).write_text(code)
            expected["scripts"].append(name)
    (out / "expected.json").write_text(json.dumps(expected, indent=2))
    return expected


def check_run(out: Path) -> list[str]:
    """What in ``out``'s run (junit.xml, report.json from pytest) differs from ``expected.json``; [] when nothing."""
    expected = json.loads((out / "expected.json").read_text())["tests"]
    problems = []
    outcomes: dict[str, list[str]] = {}
    junit = out / "junit.xml"
    for case in ET.parse(junit).getroot().iter("testcase") if junit.exists() else []:
        module = (case.get("classname") or "").split(".")[0]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else child.tag
        outcomes.setdefault(module, []).append(outcome)
    rows = json.loads((out / "report.json").read_text())["rows"] if (out / "report.json").exists() else []
    for module, want in expected.items():
        got = outcomes.get(module)
        if not got:
            problems.append(f"{module}: no test ran (a collection error?)")
            continue
        if set(got) != {want["outcome"]}:
            problems.append(f"{module}: {', '.join(got)}, where the page says {want['outcome']}")
        if want["outcome"] == "xfailed":
            caught = [r for r in rows if r["nodeid"].startswith(f"{module}.py::") and r.get("expected_failure")]
            if not any(want["text"] in (r.get("detail") or "") for r in caught):
                problems.append(f"{module}: no check of it failed saying {want['text']!r}, as the page says it does")
    problems += [f"{module}: ran, and the page has no such block" for module in sorted(set(outcomes) - set(expected))]
    return problems


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "write":
        expected = write_project(Path(argv[1]), Path(argv[2]))
        print(f"{argv[2]}: {len(expected['tests'])} test files, {len(expected['scripts'])} scripts from {argv[1]}")
        return 0
    if len(argv) == 2 and argv[0] == "check":
        problems = check_run(Path(argv[1]))
        for problem in problems:
            print(f"consumer project: {problem}", file=sys.stderr)
        if not problems:
            print("consumer project: every test file ran as the page says (tests pass, planted bugs strict xfails)")
        return 1 if problems else 0
    print("usage: consumer_project.py write PAGE OUT | check OUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
