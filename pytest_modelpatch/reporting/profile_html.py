"""Divergence profiles drawn as a self-contained HTML page (inline SVG, no matplotlib, no script).

A failing equivalence check records its divergence profile (``divergence.py``: for
every module call in forward order, the largest absolute difference of its output)
on its report row. The page from ``write_profile_html`` shows, for each failing
check: the first diverging module as the check named it, the profile as a chart with
labelled axes and that module marked, a table of every module call in order with its
error, and the check's text. Everything a reader needs is printed on the page; nothing
hides in a hover tooltip.

Example::

    profile = divergence_profile(reference_model, patched_model, inputs)  # from pytest_modelpatch.compare._engine.divergence
    write_profile_html(Path("profile.html"), [{"nodeid": "t.py::t", "check": "equivalence#1", "profile": profile}])
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any

_FLOOR = 1e-12  # errors below this (and exact zeros) sit on the chart's floor
_PLOT_W, _PLOT_H = 760, 180  # the plotting area, in px
_LEFT, _TOP, _BOTTOM = 64, 28, 44  # room for the y ticks, the marker's label and the x axis's label
# the check's own text names the module it blames: "first diverging module: NAME (call N) (classes)"
_FIRST = re.compile(r"^\s*first diverging module: (?P<name>\S+)(?: \(call (?P<call>\d+)\))?", re.M)

_LEGEND = (
    "Grey: the call's output equals the reference's (drawn on the floor). Red: it differs. Dark red: the first "
    "diverging module, the first call whose inputs agree with the reference's and whose output does not; calls "
    "inside it finish before it, so they are listed before it and may differ already."
)
_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}"
    "h2{font-size:1.1em;word-break:break-all}"
    "pre{background:#f4f4f4;padding:1em;overflow:auto;font-size:.85em}"
    ".first{font-size:1.05em;background:#fdecea;border-left:4px solid #c0392b;padding:.5em .8em}"
    ".blamed{font-size:1.05em;background:#fff4e0;border-left:4px solid #d68910;padding:.5em .8em}"
    "table{border-collapse:collapse;font-size:.9em}"
    "th,td{padding:2px 10px;text-align:left;border-bottom:1px solid #eee}"
    "td.num{text-align:right;font-variant-numeric:tabular-nums}"
    "tr.agrees td{color:#888}tr.differs td{color:#222}"
    "tr.first-diverging td{background:#fdecea;font-weight:bold}"
    ".legend{font-size:.85em;color:#555;max-width:820px}"
    "svg text{font-family:system-ui,sans-serif;font-size:11px;fill:#333}"
)


def _first_diverging(row: dict[str, Any], profile: list[tuple[str, float]]) -> str | None:
    """The profile label of the module the check blamed; else the first call whose output differs."""
    found = _FIRST.search(row.get("detail") or "")
    if found is not None:
        call = int(found["call"] or 1) - 1
        label = found["name"] if not call else f"{found['name']}#{call}"
        if any(name == label for name, _ in profile):
            return label
    return next((name for name, error in profile if not error == 0), None)


def _height(error: float, bottom: float, top: float) -> float:
    """The bar's height in px for ``error`` on the log axis from 10**bottom to 10**top."""
    if not math.isfinite(error):
        return _PLOT_H  # inf or nan: off the scale, drawn full height
    if error <= _FLOOR:
        return 0.0
    return (math.log10(error) - bottom) / (top - bottom) * _PLOT_H


def _figure(error: float) -> str:
    if error == 0:
        return "0"
    return f"{error:.3g}"


def profile_svg(profile: list[tuple[str, float]], first: str | None = None) -> str:
    """The profile as a bar chart: x the module calls in forward order, y log10 of each call's max abs error.

    The axes carry their labels and decade ticks, and ``first`` (a profile label) is marked
    with a line and its name, so the picture reads without hovering.
    """
    finite = [e for _, e in profile if math.isfinite(e) and e > _FLOOR]
    top = math.ceil(math.log10(max(finite))) if finite else 0
    bottom = min(math.floor(math.log10(min(finite))) if finite else top - 1, top - 1)
    bottom = max(bottom, round(math.log10(_FLOOR)))
    top = max(top, bottom + 1)
    step = _PLOT_W / max(len(profile), 1)
    width, height = _LEFT + _PLOT_W + 16, _TOP + _PLOT_H + _BOTTOM
    parts = [f'<g transform="translate({_LEFT},{_TOP})">']
    for decade in range(bottom, top + 1):
        y = _PLOT_H - (decade - bottom) / (top - bottom) * _PLOT_H
        parts.append(f'<line x1="0" x2="{_PLOT_W}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        parts.append(f'<text class="y-tick" x="-6" y="{y + 4:.1f}" text-anchor="end">1e{decade}</text>')
    for i, (name, error) in enumerate(profile):
        h = _height(error, bottom, top)
        color = "#c0392b" if name == first else ("#e08e7f" if error != 0 else "#b0b7bb")
        parts.append(
            f'<rect x="{i * step:.1f}" y="{_PLOT_H - max(h, 1):.1f}" width="{max(step - 1, 1):.1f}" '
            f'height="{max(h, 1):.1f}" fill="{color}"><title>{html.escape(name)}: {_figure(error)}</title></rect>'
        )
    if first is not None:
        i = next(i for i, (name, _) in enumerate(profile) if name == first)
        x = (i + 0.5) * step
        anchor = "start" if x < _PLOT_W / 2 else "end"
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="-6" y2="{_PLOT_H}" stroke="#c0392b" stroke-dasharray="3,2"/>'
        )
        parts.append(
            f'<text class="first-label" x="{x + (4 if anchor == "start" else -4):.1f}" y="-10" '
            f'text-anchor="{anchor}" style="fill:#c0392b;font-weight:bold">'
            f"first diverging module: {html.escape(first)}</text>"
        )
    parts.append(f'<line x1="0" x2="{_PLOT_W}" y1="{_PLOT_H}" y2="{_PLOT_H}" stroke="#333"/>')
    parts.append(f'<line x1="0" x2="0" y1="0" y2="{_PLOT_H}" stroke="#333"/>')
    parts.append(
        f'<text class="x-label" x="{_PLOT_W / 2}" y="{_PLOT_H + 30}" text-anchor="middle">'
        f"module calls in forward order (1 to {len(profile)}, as the table below lists them)</text>"
    )
    parts.append(
        f'<text class="y-label" transform="translate(-50,{_PLOT_H / 2}) rotate(-90)" text-anchor="middle">'
        "max abs error (log scale)</text></g>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="max abs error of each module call in forward order, log scale">{"".join(parts)}</svg>'
    )


def profile_table(profile: list[tuple[str, float]], first: str | None = None) -> str:
    """Every module call in forward order with its max abs error; the first diverging one marked."""
    rows = []
    for i, (name, error) in enumerate(profile, 1):
        kind = "first-diverging" if name == first else ("agrees" if error == 0 else "differs")
        note = "first diverging module" if name == first else ("agrees" if error == 0 else "")
        rows.append(
            f'<tr class="{kind}"><td class="num">{i}</td><td><code>{html.escape(name)}</code></td>'
            f'<td class="num">{_figure(error)}</td><td>{note}</td></tr>'
        )
    return (
        '<table class="profile"><thead><tr><th>#</th><th>module call</th><th>max abs error</th><th></th></tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


def render_profile_html(rows: list[dict[str, Any]]) -> str:
    """The page: one section per failing equivalence/property check, with its profile and text."""
    failing = [r for r in rows if r.get("outcome") != "passed" and r.get("kind") in ("equivalence", "property")]
    sections = []
    for row in failing:
        profile = [(str(name), float(error)) for name, error in row.get("profile") or []]
        first = _first_diverging(row, profile)
        if profile:
            chart = (
                f"{_blamed(row)}"
                f'<p class="first">first diverging module: <code>{html.escape(first or "none found")}</code></p>'
                f"{profile_svg(profile, first)}<p class='legend'>{_LEGEND}</p>"
                f"<h3>Every module call, in forward order</h3>{profile_table(profile, first)}"
            )
        else:
            chart = "<p>(no per-module profile recorded for this check)</p>"
        sections.append(
            f"<section><h2>{html.escape(row['nodeid'])} {html.escape(row['check'])}</h2>"
            f"<p>max abs error {row.get('max_abs_error') or 0:.4g} on {html.escape(str(row.get('model') or '-'))}</p>"
            f"{chart}<h3>The check's report</h3><pre>{html.escape(row.get('detail') or '')}</pre></section>"
        )
    body = "".join(sections) or "<p>No equivalence check failed.</p>"
    title = f"{len(failing)} failing check{'s' if len(failing) != 1 else ''}"
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>modelpatch divergence profiles</title>"
        f"<style>{_STYLE}</style>"
        f"</head><body><h1>modelpatch: divergence profiles ({title})</h1>{body}</body></html>\n"
    )


def _blamed(row: dict[str, Any]) -> str:
    """The replaced modules the check's text blames, named before the first diverging module as the text names them."""
    # the first bar above zero is not it: a replacement's round-off shows first and may be within tolerance
    blamed = row.get("blamed") or []
    if not blamed:
        return ""
    return (
        f'<p class="blamed">replaced module whose own output differs: <code>{html.escape(", ".join(blamed))}</code></p>'
    )


def write_profile_html(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_profile_html(rows), encoding="utf-8")
