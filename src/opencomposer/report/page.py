"""The report card as one self-contained HTML page: no network, no external script or style.

Every number that comes from a stage's files is printed with `data-src="<file>#<key path>"` and its
raw value in `data-value`, so a test (or a reader) can check the page against the run folder. Charts
are inline SVG (`core/plot.py`); a small script at the end checks that each one has marks and says
on the console when one does not. The system checks reuse the Markdown sections, converted here.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from opencomposer.core.metrics import read_jsonl
from opencomposer.core.plot import COLOURS, chart
from opencomposer.core.rundir import RunDir
from opencomposer.report import AGENT_STAGES, CHECK_SECTIONS, stage_status

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
figure.chart{display:inline-block;margin:.5em 1em .5em 0;vertical-align:top}figcaption{font-size:12px;color:#555}
pre{background:#f6f8fa;padding:.6em;overflow-x:auto;font-size:12px;max-height:420px}
details{margin:.3em 0}summary{cursor:pointer}.fail{color:#b00;font-weight:bold}
.pass{color:#080;font-weight:bold}.msg{border-left:3px solid #ddd;padding-left:.6em;margin:.4em 0}
.role{font-size:11px;color:#777;text-transform:uppercase}
"""

CHECK_SCRIPT = """
(function(){let n=0;document.querySelectorAll('figure.chart').forEach(function(f){
 if(f.querySelector('svg polyline, svg circle, svg rect.bar')){n++;}else{console.error('chart not drawn: '+f.id);}});
 document.body.dataset.chartsDrawn=String(n);})();
"""

def num(src: str, key: str, value, fmt: str = "{:.3g}") -> str:
    """A number with where it came from (for checking the page against the run folder)."""
    if value is None:
        return "–"
    shown = fmt.format(value) if isinstance(value, (int, float)) else html.escape(str(value))
    return (f'<span data-src="{html.escape(src)}#{html.escape(key)}" data-value="{html.escape(json.dumps(value))}">'
            f"{shown}</span>")


def figure(fid: str, caption: str, svg: str) -> str:
    return f'<figure class="chart" id="{fid}">{svg}<figcaption>{html.escape(caption)}</figcaption></figure>'


def bars(rows: list[tuple[str, float, list[float] | None]], ylabel: str, width: int = 420, height: int = 240,
         unit: str = "%") -> str:
    """Vertical bars with optional [lo, hi] whiskers (the 95% interval), values in [0, 1] for %."""
    pad, n = 48, max(1, len(rows))
    top = 1.0 if unit == "%" else (max((r[1] for r in rows), default=0.0) or 1.0)
    bw = (width - 2 * pad) / n
    body = []
    for i, (label, v, ci) in enumerate(rows):
        x = pad + i * bw + bw * 0.15
        h = (height - 2 * pad) * (v / top)
        y = height - pad - h
        body.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bw * 0.7:.1f}" height="{max(h, 0.5):.1f}" '
                    f'fill="{COLOURS[i % len(COLOURS)]}"/>')
        if ci:
            cx = x + bw * 0.35
            lo, hi = (height - pad - (height - 2 * pad) * (c / top) for c in ci)
            body.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{lo:.1f}" y2="{hi:.1f}" stroke="black"/>'
                        f'<line x1="{cx - 5:.1f}" x2="{cx + 5:.1f}" y1="{hi:.1f}" y2="{hi:.1f}" stroke="black"/>'
                        f'<line x1="{cx - 5:.1f}" x2="{cx + 5:.1f}" y1="{lo:.1f}" y2="{lo:.1f}" stroke="black"/>')
        text = f"{v:.0%}" if unit == "%" else f"{v:.3g}"
        body.append(f'<text x="{x + bw * 0.35:.1f}" y="{y - 4:.1f}" font-size="11" text-anchor="middle">{text}</text>'
                    f'<text x="{x + bw * 0.35:.1f}" y="{height - pad + 14}" font-size="11" text-anchor="middle">'
                    f"{html.escape(label)}</text>")
    axis = (f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>'
            f'<text x="12" y="{height / 2}" font-size="12" transform="rotate(-90 12 {height / 2})" '
            f'text-anchor="middle">{html.escape(ylabel)}</text>')
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">{axis}{"".join(body)}</svg>'


def curve(path: Path, key: str = "loss") -> list[tuple[float, float]]:
    return [(float(r["step"]), float(r[key])) for r in read_jsonl(path)
            if r.get("step") is not None and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def recipe(run: dict) -> str:
    rows = [k for k in AGENT_STAGES if k in run]
    if not rows:
        return "<p>No agent eval ran.</p>"
    out = ["<table id='passrate'><tr><th>model</th><th>pass rate</th><th>95% interval</th><th>best-of-K</th>"
           "<th>pass@1</th><th>turns</th><th>completion tokens</th><th>tool calls</th><th>cost (USD)</th>"
           "<th>episodes</th><th>trajectories</th></tr>"]
    for k in rows:
        s, src = run[k], f"{k}/summary.json"
        ci = s.get("accuracy_ci95")
        out.append(
            f"<tr><td>{AGENT_STAGES[k]}</td><td>{num(src, 'accuracy', s['accuracy'], '{:.0%}')}</td>"
            f"<td>{'–' if not ci else num(src, 'accuracy_ci95.0', ci[0], '{:.0%}') + ' – ' + num(src, 'accuracy_ci95.1', ci[1], '{:.0%}')}</td>"  # noqa: E501
            f"<td>{num(src, 'best_of_k', s['best_of_k'], '{:.0%}')}</td>"
            f"<td>{num(src, 'pass@1', s['pass@1'], '{:.0%}')}</td>"
            f"<td>{num(src, 'mean_turns', s['mean_turns'], '{:.1f}')}</td>"
            f"<td>{num(src, 'mean_completion_tokens', s['mean_completion_tokens'], '{:.0f}')}</td>"
            f"<td>{num(src, 'mean_tool_calls', s['mean_tool_calls'], '{:.1f}')}</td>"
            f"<td>{num(src, 'mean_cost_usd', s['mean_cost_usd'], '{:.4f}')}</td>"
            f"<td>{num(src, 'episodes', s['episodes'], '{}')}</td><td><a href='#traj-{k}'>view</a></td></tr>")
    out.append("</table>")
    first = run[rows[0]]
    out.append(f"<p>{first['tasks']} held-out tasks x {first['samples']} samples each; K = {first['samples']}. "
               "The interval is Wilson's, over episodes (samples of one task are correlated, so it is optimistic "
               "with few tasks). Cost is priced from the policy's per-token prices, zero for a model served here.</p>")
    out.append(figure("chart-passrate", "held-out pass rate with its 95% interval",
                      bars([(AGENT_STAGES[k], run[k]["accuracy"] or 0.0, run[k].get("accuracy_ci95")) for k in rows],
                           "pass rate")))
    out.append(figure("chart-best-of-k", "best-of-K (a task passes if any of its K samples does)",
                      bars([(AGENT_STAGES[k], run[k]["best_of_k"] or 0.0, None) for k in rows], "best-of-K")))
    tools = sorted({t for k in rows for t in run[k].get("tool_mix", {})})
    if tools:
        out.append("<h3>Tool use (calls per episode)</h3><table><tr><th>model</th>"
                   + "".join(f"<th>{html.escape(t)}</th>" for t in tools) + "</tr>")
        for k in rows:
            mix = run[k].get("tool_mix", {})
            out.append(f"<tr><td>{AGENT_STAGES[k]}</td>" + "".join(
                f"<td>{num(f'{k}/summary.json', f'tool_mix.{t}', mix[t], '{:.2f}') if t in mix else '0'}</td>"
                for t in tools) + "</tr>")
        out.append("</table>")
    out.append("<h3>Per task</h3><table><tr><th>task</th>" + "".join(
        f"<th>{AGENT_STAGES[k]}: passed</th><th>tokens</th><th>turns</th><th>cost (USD)</th>" for k in rows) + "</tr>")
    for t in sorted({t for k in rows for t in run[k].get("per_task", {})}):
        cells = []
        for k in rows:
            r = run[k].get("per_task", {}).get(t)
            src = f"{k}/summary.json"
            cells.append("<td>–</td><td>–</td><td>–</td><td>–</td>" if r is None else
                         f"<td>{num(src, f'per_task.{t}.passed', r['passed'], '{}')}/{r['episodes']}</td>"
                         f"<td>{num(src, f'per_task.{t}.completion_tokens', r['completion_tokens'], '{:.0f}')}</td>"
                         f"<td>{num(src, f'per_task.{t}.turns', r['turns'], '{:.1f}')}</td>"
                         f"<td>{num(src, f'per_task.{t}.cost_usd', r['cost_usd'], '{:.4f}')}</td>")
        out.append(f"<tr><td>{html.escape(t)}</td>{''.join(cells)}</tr>")
    return "".join(out) + "</table>"


def training(run: dict, root: Path) -> str:
    out = []
    if "cpt" in run:
        s = run["cpt"]
        out.append("<h3>Continued pretraining</h3><table><tr><th></th><th>codebase perplexity</th>"
                   "<th>state tracking</th></tr>"
                   f"<tr><td>before</td><td>{num('cpt/summary.json', 'perplexity_before', s['perplexity_before'], '{:.3f}')}</td>"  # noqa: E501
                   f"<td>{num('cpt/summary.json', 'base_evals_before.state_tracking.mean_similarity', s['base_evals_before']['state_tracking']['mean_similarity'], '{:.3f}')}</td></tr>"  # noqa: E501
                   f"<tr><td>after</td><td>{num('cpt/summary.json', 'perplexity_after', s['perplexity_after'], '{:.3f}')}</td>"  # noqa: E501
                   f"<td>{num('cpt/summary.json', 'base_evals_after.state_tracking.mean_similarity', s['base_evals_after']['state_tracking']['mean_similarity'], '{:.3f}')}</td></tr></table>")  # noqa: E501
        pts = curve(root / "cpt" / "metrics.jsonl")
        if pts:
            out.append(figure("chart-cpt-loss", "CPT training loss", chart({"loss": pts}, "step", "loss")))
    if "sft" in run:
        s = run["sft"]
        out.append(f"<h3>SFT</h3><p>{num('sft/summary.json', 'examples', s['examples'], '{}')} conversations, "
                   f"{num('sft/summary.json', 'steps', s['steps'], '{}')} steps; loss "
                   f"{num('sft/summary.json', 'loss_before', s['loss_before'], '{:.4f}')} → "
                   f"{num('sft/summary.json', 'loss_after', s['loss_after'], '{:.4f}')}.</p>")
        pts = curve(root / "sft" / "metrics.jsonl")
        if pts:
            out.append(figure("chart-sft-loss", "SFT training loss", chart({"loss": pts}, "step", "loss")))
    if "rl" in run and run["rl"]["curve"]:
        s = run["rl"]
        c = s["curve"]
        out.append(f"<h3>RL</h3><p>{num('rl/summary.json', 'version', s['version'], '{}')} policy versions, "
                   f"{num('rl/summary.json', 'trained_groups', s['trained_groups'], '{}')} groups through the trainer, "
                   f"{num('rl/summary.json', 'failed_groups', s['failed_groups'], '{}')} failed. Reward "
                   f"{num('rl/summary.json', 'curve.0.reward', c[0]['reward'], '{:.3f}')} → "
                   f"{num('rl/summary.json', f'curve.{len(c) - 1}.reward', c[-1]['reward'], '{:.3f}')}.</p>")
        out.append(figure("chart-rl-reward", "RL: mean reward and pass rate of each step's rollouts",
                          chart({"reward": [(r["step"], r["reward"]) for r in c],
                                 "pass rate": [(r["step"], r["pass_rate"]) for r in c]}, "step", "")))
        out.append(figure("chart-rl-kl", "RL: KL to the reference per token",
                          chart({"KL": [(r["step"], r["kl_per_token"]) for r in c]}, "step", "KL per token")))
        if s["staleness"]:
            total = sum(s["staleness"].values())
            out.append(figure("chart-staleness", "staleness of trained tokens (versions behind the trainer)",
                              bars([(k, v / total, None) for k, v in sorted(s["staleness"].items(),
                                                                             key=lambda kv: int(kv[0]))], "share")))
    return "".join(out) or "<p>No training stage ran.</p>"


def stages(run: dict) -> str:
    status = stage_status(run["events"])
    rows = ["<table><tr><th>stage</th><th>status</th><th>seconds</th></tr>"]
    timed = []
    for name, e in status.items():
        if e["event"] == "stage_end":
            timed.append((name, e["seconds"]))
            rows.append(f"<tr><td>{name}</td><td class='pass'>done</td><td>{e['seconds']:.1f}</td></tr>")
        else:
            what = {"stage_start": "unfinished", "stage_failed": "failed", "stage_skipped": "skipped"}[e["event"]]
            rows.append(f"<tr><td>{name}</td><td class='{'fail' if what != 'skipped' else ''}'>{what}</td>"
                        f"<td>{html.escape(e.get('error', ''))}</td></tr>")
    rows.append("</table>")
    if timed:
        rows.append(figure("chart-stage-time", "seconds per stage",
                           bars([(n[:10], s, None) for n, s in timed], "seconds", width=max(420, 60 * len(timed)),
                                unit="s")))
    return "".join(rows)


def trajectories(run: dict, root: Path, per_stage: int = 2) -> str:
    out = []
    for k in AGENT_STAGES:
        if k not in run:
            continue
        out.append(f"<h3 id='traj-{k}'>{AGENT_STAGES[k]}</h3>")
        records = {(r["task"], r["pass"]): r for r in read_jsonl(root / k / "results.jsonl")}
        chosen = sorted(records.values(), key=lambda r: (not r["passed"], r["task"], r["pass"]))[:per_stage]
        for r in chosen:
            path = root / k / "trajectories" / f"{r['task']}.{r['pass']}.json"
            if path.exists():
                out.append(episode(json.loads(path.read_text()), r))
    return "".join(out) or "<p>No trajectories.</p>"


def episode(traj: dict, rec: dict) -> str:
    mark = "<span class='pass'>passed</span>" if rec["passed"] else "<span class='fail'>failed</span>"
    parts = [f"<details><summary>{html.escape(rec['task'])} (sample {rec['pass']}): {mark}, {rec['turns']} turns, "
             f"{rec['tool_calls']} tool calls, stop: {html.escape(rec['stop_reason'])}</summary>"]
    for seg in traj.get("segments", []):
        for m in seg.get("messages", []):
            role = m.get("role", "")
            if role == "system":
                parts.append("<details><summary>system prompt</summary>"
                             f"<pre>{html.escape(str(m.get('content', '')))}</pre></details>")
                continue
            body = html.escape(str(m.get("content") or ""))
            calls = "".join(f"<details><summary>call <b>{html.escape(tc['function']['name'])}</b></summary><pre>"
                            f"{html.escape(str(tc['function'].get('arguments', '')))}</pre></details>"
                            for tc in m.get("tool_calls") or [])
            if role == "tool":
                parts.append(f"<div class='msg'><details><summary class='role'>tool output ({len(body)} chars)"
                             f"</summary><pre>{body}</pre></details></div>")
            else:
                parts.append(f"<div class='msg'><div class='role'>{html.escape(role)}</div>"
                             f"<pre>{body}</pre>{calls}</div>")
    diff = traj.get("diff") or ""
    parts.append(f"<div class='msg'><div class='role'>final diff</div><pre>{html.escape(diff) or '(no change)'}</pre>"
                 "</div></details>")
    return "".join(parts)


def markdown(lines: list[str]) -> str:
    """The subset the check sections use: headings, tables, code fences, images, paragraphs."""
    out, table, fence = [], False, False
    for line in lines:
        if line.startswith("````") or line.startswith("```"):
            out.append("</pre>" if fence else "<pre>")
            fence = not fence
            continue
        if fence:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= set("-: ") for c in cells):
                continue
            if not table:
                out.append("<table>")
                table = True
            out.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>")
            continue
        if table:
            out.append("</table>")
            table = False
        if line.startswith("#"):
            level = min(4, len(line) - len(line.lstrip("#")) + 1)
            out.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("!["):
            pass  # the kernels' loss chart is a separate SVG file: the page stays self-contained
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
    return "\n".join(out + (["</table>"] if table else []))


def _inline(text: str) -> str:
    import re

    t = html.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", t)


def render(run_dir: RunDir, run: dict) -> str:
    root = run_dir.root
    preset = run["config"].get("preset", "?")
    checks = []
    for name, section in CHECK_SECTIONS.items():
        if name in run:
            checks.append(markdown(section(run[name])))
    env = run.get("environment", {})
    body = [
        f"<h1>opencomposer report card: <code>{html.escape(root.name)}</code></h1>",
        f"<p>Preset <code>{html.escape(preset)}</code>: the base model, served and driven through the agent harness "
        "on held-out tasks, before and after training. Everything on this page is read from the run folder.</p>",
        "<h2>Agent pass rate on the held-out split</h2>", recipe(run),
        "<h2>Training</h2>", training(run, root),
        "<h2>Stages</h2>", stages(run),
        "<h2>Trajectories</h2>", trajectories(run, root),
        "<h2>System checks</h2>", "".join(checks) or "<p>None ran.</p>",
        "<h2>Recipe and environment</h2><table>" + "".join(
            f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in env.items())
        + "</table><details><summary>the resolved recipe (config.json)</summary><pre>"
        + html.escape(json.dumps(run["config"], indent=1)) + "</pre></details>",
    ]
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>opencomposer report: {html.escape(root.name)}</title><style>{STYLE}</style></head><body>"
            + "\n".join(body) + f"<script>{CHECK_SCRIPT}</script></body></html>\n")
