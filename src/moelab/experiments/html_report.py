"""The HTML of ``moelab report --html FILE`` (:func:`moelab.experiments.report.write_html` says what
goes into the page): inline SVG figures drawn here — line charts with ± sd bands and heat maps — and
one self-contained page (no plotting library, no network at view time).  Hovering a point or a cell
shows its value, the mouse wheel zooms a figure and a double click resets it.  When the page has
drawn, ``<body data-figures="n/m">`` says how many of its ``m`` figures have a visible extent (what
the browser test reads).
"""

from __future__ import annotations

import html
import math
from typing import Any

__all__ = ["escape", "heat_map", "line_chart", "page", "table"]

#: matplotlib's tab10, the colours of the PNG figures
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
_W, _H, _PAD = 560, 300, (54, 16, 40, 30)  # width, height, padding left, right, bottom, top


def escape(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ticks(low: float, high: float, n: int = 5) -> list[float]:
    """About ``n`` round numbers spanning ``[low, high]``."""
    if high <= low:
        return [low]
    raw = (high - low) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _number(x: float) -> str:
    return f"{x:.4g}"


def line_chart(title: str, xlabel: str, ylabel: str, series: list[dict[str, Any]]) -> str:
    """An SVG chart of ``series`` (each ``label``, ``x``, ``y`` and optionally ``sd``: a band ± one sd),
    a point's value in its tooltip; ``""`` when no series has a point."""
    series = [s for s in series if s["x"]]
    if not series:
        return ""
    left, right, bottom, top = _PAD
    xs = [x for s in series for x in s["x"]]
    lows = [y - (d or 0.0) for s in series for y, d in zip(s["y"], s.get("sd") or [None] * len(s["y"]))]
    highs = [y + (d or 0.0) for s in series for y, d in zip(s["y"], s.get("sd") or [None] * len(s["y"]))]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(lows), max(highs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - abs(y0) * 0.05 - 1e-9, y1 + abs(y1) * 0.05 + 1e-9
    px = lambda x: left + (x - x0) / (x1 - x0) * (_W - left - right)
    py = lambda y: _H - bottom - (y - y0) / (y1 - y0) * (_H - top - bottom)
    parts = [f'<text x="{_W / 2}" y="18" text-anchor="middle" class="title">{escape(title)}</text>']
    for t in _ticks(y0, y1):
        parts.append(f'<line x1="{left}" x2="{_W - right}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{_number(t)}</text>')
    for t in _ticks(x0, x1):
        parts.append(f'<text x="{px(t):.1f}" y="{_H - bottom + 14}" text-anchor="middle">{_number(t)}</text>')
    parts.append(f'<text x="{_W / 2}" y="{_H - 6}" text-anchor="middle">{escape(xlabel)}</text>')
    parts.append(
        f'<text x="12" y="{_H / 2}" text-anchor="middle" transform="rotate(-90 12 {_H / 2})">{escape(ylabel)}</text>'
    )
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        points = list(zip(s["x"], s["y"]))
        sd = s.get("sd")
        if sd and any(d for d in sd):
            upper = [f"{px(x):.1f},{py(y + (d or 0.0)):.1f}" for (x, y), d in zip(points, sd)]
            lower = [f"{px(x):.1f},{py(y - (d or 0.0)):.1f}" for (x, y), d in zip(points, sd)][::-1]
            parts.append(f'<polygon points="{" ".join(upper + lower)}" fill="{colour}" opacity="0.2"/>')
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for (x, y), d in zip(points, sd or [None] * len(points)):
            spread = "" if d is None else f" ± {_number(d)}"
            parts.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}">'
                f"<title>{escape(s['label'])}: {escape(xlabel)} {_number(x)}, {_number(y)}{spread}</title></circle>"
            )
        parts.append(
            f'<text x="{left + 8}" y="{top + 14 + 13 * i}" fill="{colour}" class="legend">{escape(s["label"])}</text>'
        )
    return _figure(parts, _W, _H)


def heat_map(title: str, rows: list[str], columns: list[Any], values: list[list[float | None]]) -> str:
    """An SVG heat map, a row per ``rows`` entry and a column per ``columns`` entry, shaded from the
    lowest value (light) to the highest (dark); a cell's value in its tooltip."""
    cells = [v for row in values for v in row if v is not None]
    if not cells:
        return ""
    low, high = min(cells), max(cells)
    cw, ch, left, top = max(8, min(40, 480 // max(1, len(columns)))), 18, 70, 30
    width = max(left + cw * len(columns) + 16, 7 * len(title) + 20)  # room for the title (12 px bold)
    height = top + ch * len(rows) + 30
    parts = [f'<text x="{width / 2}" y="18" text-anchor="middle" class="title">{escape(title)}</text>']
    for r, (name, row) in enumerate(zip(rows, values)):
        parts.append(f'<text x="{left - 4}" y="{top + r * ch + 13}" text-anchor="end">{escape(name)}</text>')
        for c, (column, v) in enumerate(zip(columns, row)):
            if v is None:
                continue
            t = 0.5 if high == low else (v - low) / (high - low)
            shade = f"rgb({int(247 - 200 * t)},{int(251 - 150 * t)},{int(255 - 90 * t)})"
            parts.append(
                f'<rect x="{left + c * cw}" y="{top + r * ch}" width="{cw}" height="{ch}" fill="{shade}">'
                f"<title>{escape(name)}, step {escape(column)}: {_number(v)}</title></rect>"
            )
    parts.append(
        f'<text x="{left}" y="{height - 8}">step {escape(columns[0])} … {escape(columns[-1])}; '
        f"light {_number(low)}, dark {_number(high)}</text>"
    )
    return _figure(parts, width, height)


def _figure(parts: list[str], width: float, height: float) -> str:
    return (
        f'<svg class="figure" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
    )


def table(rows: list[dict[str, Any]], missing: str = "—") -> str:
    """An HTML table of ``rows`` (a column per key, numbers to 4 significant digits)."""
    if not rows:
        return ""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)

    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return missing
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    body = "".join(
        "<tr>" + "".join(f"<td>{escape(cell(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { border: 1px solid #ccc; padding: 3px 6px; }
th { background: #f3f3f3; } td { text-align: right; } td:first-child { text-align: left; }
svg.figure { margin: 6px; font-size: 10px; border: 1px solid #eee; cursor: zoom-in; }
svg .title { font-size: 12px; font-weight: 600; } svg .grid { stroke: #e5e5e5; } svg .legend { font-size: 10px; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 0.8em; } .note { color: #666; }
"""
#: zoom (wheel), reset (double click), and the rendered-figure count the browser test reads
_SCRIPT = """
(function () {
  var figures = document.querySelectorAll("svg.figure"), drawn = 0;
  figures.forEach(function (svg) {
    var home = svg.getAttribute("viewBox");
    var box = svg.getBBox();
    if (box.width > 0 && box.height > 0) { drawn += 1; }
    svg.addEventListener("wheel", function (e) {
      e.preventDefault();
      var v = svg.viewBox.baseVal, r = svg.getBoundingClientRect();
      var k = e.deltaY < 0 ? 0.8 : 1.25;
      var cx = v.x + (e.clientX - r.left) / r.width * v.width, cy = v.y + (e.clientY - r.top) / r.height * v.height;
      svg.setAttribute("viewBox", [cx - (cx - v.x) * k, cy - (cy - v.y) * k, v.width * k, v.height * k].join(" "));
    });
    svg.addEventListener("dblclick", function () { svg.setAttribute("viewBox", home); });
  });
  document.body.setAttribute("data-figures", drawn + "/" + figures.length);
})();
"""


def page(title: str, subtitle: str, sections: list[str]) -> str:
    """The self-contained HTML page of ``sections`` (HTML fragments; empty ones left out)."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head>"
        f'<body><h1>moelab report</h1><p class="note">{escape(subtitle)}</p>'
        + "\n".join(s for s in sections if s)
        + f"<script>{_SCRIPT}</script></body></html>\n"
    )
