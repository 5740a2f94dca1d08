"""The eval report as one self-contained HTML page: headline numbers, per-category and per-split
accuracy as bar charts (inline SVG, no plotting dependency), a token histogram, and every episode."""

from __future__ import annotations

import html
from pathlib import Path


def _bars(title: str, values: dict[str, float | None], width: int = 460) -> str:
    rows = [(k, v) for k, v in values.items() if v is not None]
    if not rows:
        return ""
    h = 22 * len(rows) + 30
    parts = [f'<svg width="{width}" height="{h}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="0" y="14" font-weight="bold">{html.escape(title)}</text>']
    for i, (k, v) in enumerate(rows):
        y = 24 + 22 * i
        w = int((width - 200) * v)
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{html.escape(k)}</text>'
                     f'<rect x="140" y="{y}" width="{w}" height="16" fill="#4a7bd0"/>'
                     f'<text x="{145 + w}" y="{y + 13}" font-size="12">{v:.0%}</text>')
    return "".join(parts) + "</svg>"


def _hist(title: str, xs: list[float], bins: int = 12, width: int = 460, height: int = 140) -> str:
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    span = (hi - lo) or 1.0
    counts = [0] * bins
    for x in xs:
        counts[min(bins - 1, int((x - lo) / span * bins))] += 1
    top = max(counts)
    bw = (width - 20) / bins
    parts = [f'<svg width="{width}" height="{height + 40}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="0" y="14" font-weight="bold">{html.escape(title)}</text>']
    for i, c in enumerate(counts):
        bh = height * c / top
        parts.append(f'<rect x="{10 + i * bw:.1f}" y="{24 + height - bh:.1f}" width="{bw - 2:.1f}" height="{bh:.1f}" '
                     f'fill="#8a5cc2"><title>{c}</title></rect>')
    parts.append(f'<text x="10" y="{height + 38}" font-size="11">{lo:.0f}</text>'
                 f'<text x="{width - 60}" y="{height + 38}" font-size="11">{hi:.0f}</text>')
    return "".join(parts) + "</svg>"


def write_report(path: Path, summary: dict, records: list[dict]) -> Path:
    def pct(v):
        return "–" if v is None else f"{v:.1%}"

    head = [("policy", summary.get("policy")), ("dataset", summary.get("dataset")), ("split", summary.get("split")),
            ("tasks", summary["tasks"]), ("episodes", summary["episodes"]), ("accuracy", pct(summary["accuracy"]))]
    head += [(k, pct(v)) for k, v in summary.items() if k.startswith(("pass@", "best_of_"))]
    head += [("infra errors", summary["infra_errors"]),
             ("median completion tokens", summary["median_completion_tokens"]),
             ("median latency (s)", None if summary["median_latency_s"] is None else f"{summary['median_latency_s']:.1f}"),
             ("mean cost (USD)", summary["mean_cost_usd"]), ("tool error rate", pct(summary["tool_error_rate"]))]
    rows = "".join(
        f"<tr><td>{html.escape(r['task'])}</td><td>{r['pass']}</td><td>{html.escape(str(r.get('split')))}</td>"
        f"<td>{html.escape(r['category'])}</td><td class='{r['status']}'>{r['status']}</td><td>{r['turns']}</td>"
        f"<td>{r['completion_tokens']}</td><td>{r['seconds']:.1f}</td><td>{html.escape(r['detail'][:160])}</td></tr>"
        for r in sorted(records, key=lambda r: (r["task"], r["pass"])))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>opencomposer eval</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 8px;text-align:left;border-bottom:1px solid #ddd}}
.passed{{color:#1a7f37}}.failed,.no_tests_ran{{color:#c62828}}.infra_error{{color:#a66b00}}</style></head><body>
<h1>opencomposer eval</h1>
<table>{''.join(f'<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>' for k, v in head)}</table>
<div>{_bars('accuracy by category', summary['accuracy_by_category'])}
{_bars('accuracy by split', summary['accuracy_by_split'])}
{_hist('completion tokens per episode', [r['completion_tokens'] for r in records])}</div>
<h2>Episodes</h2><table><tr><th>task</th><th>pass</th><th>split</th><th>category</th><th>status</th><th>turns</th>
<th>tokens</th><th>seconds</th><th>detail</th></tr>{rows}</table></body></html>"""
    path.write_text(page)
    return path
