"""Divergence profiles drawn as a self-contained HTML page (inline SVG, no matplotlib).

A failing equivalence check records its divergence profile (``divergence.py``: for
every module call in forward order, the largest absolute difference of its output)
on its report row. The page from ``write_profile_html`` shows, for each failing
check, that profile as a bar chart on a log scale and the check's text.

Example::

    profile = divergence_profile(reference_model, patched_model, inputs)  # from pytest_modelpatch.compare.divergence
    write_profile_html(Path("profile.html"), [{"nodeid": "t.py::t", "check": "equivalence#1", "profile": profile}])
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

_BAR_W, _HEIGHT, _FLOOR = 6, 160, 1e-12


def profile_svg(profile: list[tuple[str, float]]) -> str:
    """One bar per module call, height log10 of its max abs difference; hover shows the name and value."""
    top = max((math.log10(max(e, _FLOOR)) for _, e in profile), default=0.0) + 1
    span = top - math.log10(_FLOOR)
    bars = []
    for i, (name, error) in enumerate(profile):
        h = (math.log10(max(error, _FLOOR)) - math.log10(_FLOOR)) / span * _HEIGHT if error > 0 else 0.0
        color = "#c0392b" if error > 0 else "#95a5a6"
        bars.append(
            f'<rect x="{i * _BAR_W}" y="{_HEIGHT - h:.1f}" width="{_BAR_W - 1}" height="{max(h, 1):.1f}" fill="{color}">'
            f"<title>{html.escape(name)}: {error:.3g}</title></rect>"
        )
    width = max(len(profile) * _BAR_W, 100)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{_HEIGHT + 4}" '
        f'role="img" aria-label="max abs error per module, forward order, log scale">{"".join(bars)}</svg>'
    )


def render_profile_html(rows: list[dict[str, Any]]) -> str:
    """The page: one section per failing equivalence/property check, with its profile and text."""
    failing = [r for r in rows if r.get("outcome") != "passed" and r.get("kind") in ("equivalence", "property")]
    sections = []
    for row in failing:
        profile = row.get("profile") or []
        none = "<p>(no per-module profile recorded for this check)</p>"
        chart = f"{_located(row)}{profile_svg(profile)}" if profile else none
        sections.append(
            f"<section><h2>{html.escape(row['nodeid'])} {html.escape(row['check'])}</h2>"
            f"<p>max abs error {row.get('max_abs_error') or 0:.4g} on {html.escape(str(row.get('model') or '-'))}</p>"
            f"{chart}<pre>{html.escape(row.get('detail') or '')}</pre></section>"
        )
    body = "".join(sections) or "<p>No equivalence check failed.</p>"
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>modelpatch divergence profiles</title>"
        "<style>body{font-family:sans-serif;margin:2em}pre{background:#f4f4f4;padding:1em;overflow:auto}</style>"
        f"</head><body><h1>modelpatch: divergence profiles ({len(failing)} failing checks)</h1>{body}</body></html>\n"
    )


def _located(row: dict[str, Any]) -> str:
    """The modules the check's text names, in its order: the blamed replacement first, then the first diverging one."""
    # the first bar above zero is not it: a replacement's round-off shows first and may be within tolerance
    blamed = row.get("blamed") or []
    named = html.escape(", ".join(blamed))
    lines = [f"<p>replaced module whose own output differs: <code>{named}</code></p>"] if blamed else []
    first = row.get("first_diverging") or "-"
    lines.append(f"<p>first module whose output crossed the tolerance: <code>{html.escape(first)}</code></p>")
    return "".join(lines)


def write_profile_html(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_profile_html(rows), encoding="utf-8")
