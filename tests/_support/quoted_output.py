"""Output the docs quote, compared with what the command prints now, each part as what it is.

The figures a check prints (max abs, max rel, the values in a failure's lines) come out of float
kernels that torch picks per CPU (``ATEN_CPU_CAPABILITY``: default, avx2, avx512), so they differ
in round-off from machine to machine. Everything else is exact: counts, outcomes, ids, shapes,
positions and the order of rows. So:

- a row of the modelpatch table (``outcome  max abs  max rel  [speedup]  check  model  dtype@device
  test``) matches when its outcome and every text cell are equal and its figures agree: a passing
  check's figures are round-off under its tolerance, any value matches (but ``-`` stays ``-``); a
  failing (or xfailed) check's max abs within :data:`FIGURE_RTOL`, its max rel within
  :data:`MAX_REL_RTOL`, or one unit of the last printed digit; a speedup is a measured time, any
  value matches;
- a failing training check in bfloat16 or float16 (a ``training#N`` row at ``bfloat16@...``) is
  compounded round-off: 16 bf16 optimizer steps cross the tolerance at step 2, 6 or 11 under
  avx2, default and avx512 for the same broken loss (max abs 0.938, 2.38, 0.969), so its figures
  match any value, as a passing check's do, and its row is found by its text cells wherever the
  figures sort it (:func:`same_lines`); every other row keeps its place;
- any other line matches when its text is equal and each number in it is: a figure (a number with
  a fraction or an exponent, or after a label such as ``max rel``) within :data:`FIGURE_RTOL` (a max
  rel within :data:`MAX_REL_RTOL`) or one unit of its last digit; any other number (a count, a
  shape, a position) exactly.
"""

from __future__ import annotations

import math
import re

# Round-off between CPUs in a failing check's figures: a few parts in a thousand (measured on one
# Xeon under ATEN_CPU_CAPABILITY=default, avx2 and avx512: max abs 0.000273 to 0.000275; 700 vs 699)
FIGURE_RTOL = 5e-3
# A max rel is a ratio to the reference's smallest elements, whose round-off it magnifies: up to 2%
# between kernel sets (5.04e+03 vs 5.12e+03, 1.55e+04 vs 1.58e+04 for the same failing check)
MAX_REL_RTOL = 5e-2

NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_FIGURE = re.compile(r"^(?:[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf)$")
_ROW = re.compile(r"^(failed|xfailed|xpassed|passed) {2,}\S")
_SPEEDUP = re.compile(r"^(?:~?\d+\.\d+x|-)$")


def table_cells(line: str) -> list[str] | None:
    """The cells of a modelpatch table row (``None`` for any other line): columns are two or more spaces apart."""
    if not _ROW.match(line):
        return None
    cells = re.split(r" {2,}", line.strip())
    return cells if len(cells) >= 7 and (_FIGURE.match(cells[1]) or cells[1] == "-") else None


def same_line(quoted: str, real: str) -> bool:
    """``real`` says what ``quoted`` says, up to the round-off of the figures in it (see the module's rules)."""
    if quoted == real:
        return True
    quoted_row, real_row = table_cells(quoted), table_cells(real)
    if quoted_row is not None and real_row is not None:
        return same_row(quoted_row, real_row)
    return same_text_up_to_round_off(quoted, real)


def same_lines(quoted: list[str], real: list[str]) -> bool:
    """The same lines, each :func:`same_line`, in the same order but for compounded rows (:func:`compounded`),
    which are matched wherever they stand."""
    loose = [i for i, line in enumerate(quoted) if compounded(table_cells(line))]
    placed = [i for i, line in enumerate(real) if compounded(table_cells(line))]
    if len(quoted) != len(real) or len(loose) != len(placed):
        return False
    unmatched = [real[i] for i in placed]
    for line in (quoted[i] for i in loose):
        match = next((other for other in unmatched if same_line(line, other)), None)
        if match is None:
            return False
        unmatched.remove(match)
    rest = lambda lines, skip: [line for i, line in enumerate(lines) if i not in skip]  # noqa: E731
    return all(map(same_line, rest(quoted, set(loose)), rest(real, set(placed))))


def compounded(cells: list[str] | None) -> bool:
    """A failing training check in a 16-bit dtype: its figures are compounded round-off (see the module's rules)."""
    return (cells is not None and cells[0] != "passed" and cells[-4].startswith("training#")
            and cells[-2].split("@")[0] in ("bfloat16", "float16"))  # fmt: skip


def same_row(quoted: list[str], real: list[str]) -> bool:
    """Two table rows: the same outcome, text cells, and figures that agree as the outcome allows."""
    if len(quoted) != len(real) or quoted[0] != real[0]:
        return False
    timed = len(quoted) == 8  # a speedup column after max rel
    passed = quoted[0] == "passed" or compounded(quoted)
    for index, (a, b) in enumerate(zip(quoted, real)):
        if index in (1, 2):
            if not same_figure(a, b, passed=passed, rtol=FIGURE_RTOL if index == 1 else MAX_REL_RTOL):
                return False
        elif timed and index == 3:
            if not (_SPEEDUP.match(a) and _SPEEDUP.match(b) and (a == "-") == (b == "-")):
                return False
        elif a != b:
            return False
    return True


def same_figure(quoted: str, real: str, *, passed: bool, rtol: float = FIGURE_RTOL) -> bool:
    """A table figure (``%.3g``, ``-`` when there is none): any number under a passing check, else close."""
    if quoted == real:
        return True
    if "-" in (quoted, real) or not (_FIGURE.match(quoted) and _FIGURE.match(real)):
        return False
    a, b = float(quoted), float(real)
    if not (math.isfinite(a) and math.isfinite(b)):
        return False  # nan and inf are outcomes of their own, never round-off
    return passed or close(quoted, real, rtol)


# what precedes a figure in a failure's lines: %g-printed floats, which print without a point when whole
_FIGURE_LABELS = ("max abs ", "max rel ", "reference ", "patched ", "allowed ", "difference ", "gap ", "margin ")


def same_text_up_to_round_off(quoted: str, real: str) -> bool:
    """Equal text around the numbers; figures (a fraction, an exponent or a figure's label before them)
    :func:`close`, a max rel within :data:`MAX_REL_RTOL`; every other number (counts, shapes, positions) equal."""
    texts = NUMBER.split(quoted)
    if texts != NUMBER.split(real):
        return False
    for before, a, b in zip(texts, NUMBER.findall(quoted), NUMBER.findall(real), strict=False):
        if a == b:
            continue
        figure = any(c in a + b for c in ".eE") or before.endswith(_FIGURE_LABELS)
        if not (figure and close(a, b, MAX_REL_RTOL if before.endswith("max rel ") else FIGURE_RTOL)):
            return False
    return True


def close(a: str, b: str, rtol: float = FIGURE_RTOL) -> bool:
    """Two printed floats within ``rtol`` of each other, or one unit of the last digit printed."""
    x, y = float(a), float(b)
    if (x < 0) != (y < 0) and x != 0 and y != 0:
        return False
    return abs(x - y) <= rtol * max(abs(x), abs(y)) + 1.01 * max(last_place(a), last_place(b))


def last_place(number: str) -> float:
    """The value of one unit in the last printed digit: ``0.01`` for ``3.14``, ``100`` for ``1.2e+03``, ``1`` for ``700``."""
    mantissa, _, exponent = number.lower().lstrip("+-").partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)
