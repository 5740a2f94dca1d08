"""Small inline-SVG charts for run folders and report cards; no plotting dependency.

One function, `chart`: several named series of (x, y) points on shared axes, drawn as lines or as
labelled dots, with an optional log x axis and a legend. Non-finite points are left out.
"""

from __future__ import annotations

import math
from html import escape

COLOURS = ("#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477")


def chart(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, *, log_x: bool = False,
          lines: bool = True, labels: bool = False, width: int = 480, height: int = 300) -> str:
    pad = 52
    tx = (lambda x: math.log10(max(x, 1e-12))) if log_x else float
    pts = {name: [(tx(x), y) for x, y in ps if math.isfinite(x) and math.isfinite(y)] for name, ps in series.items()}
    xs = [x for ps in pts.values() for x, _ in ps] or [0.0]
    ys = [y for ps in pts.values() for _, y in ps] or [0.0]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def px(x: float, y: float) -> tuple[float, float]:
        return (pad + (x - x0) / (x1 - x0) * (width - 2 * pad),
                height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad))

    body = []
    for i, (name, ps) in enumerate(pts.items()):
        colour = COLOURS[i % len(COLOURS)]
        coords = [px(x, y) for x, y in ps]
        if lines and len(coords) > 1:
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b in coords)
            body.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        else:
            body += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="4" fill="{colour}"/>' for a, b in coords]
        if labels:
            body += [f'<text x="{a + 6:.1f}" y="{b - 6:.1f}" font-size="10">{y:.3f}</text>'
                     for (a, b), (_, y) in zip(coords, ps)]
        if len(pts) > 1:
            body.append(f'<text x="{width - pad + 4}" y="{pad + 14 * i}" font-size="10" fill="{colour}">'
                        f"{escape(name)}</text>")
    ticks = [f'<text x="{pad - 4}" y="{height - pad:.1f}" font-size="9" text-anchor="end">{y0:.3g}</text>',
             f'<text x="{pad - 4}" y="{pad + 4}" font-size="9" text-anchor="end">{y1:.3g}</text>']
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 60}" height="{height}">'
            f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>{"".join(ticks + body)}'
            f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle" font-size="12">{escape(xlabel)}</text>'
            f'<text x="14" y="{height / 2}" font-size="12" transform="rotate(-90 14 {height / 2})" '
            f'text-anchor="middle">{escape(ylabel)}</text></svg>')
