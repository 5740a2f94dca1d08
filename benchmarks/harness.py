"""Tool round-trip latency through the sandbox RPC against the same operation on the host, in one run.

    .venv/bin/python benchmarks/harness.py           # writes the "harness" section of docs/benchmarks.md
    .venv/bin/python benchmarks/harness.py --quick   # prints only

Operations (repository: ~4,000 real files, ~50 MB; see corpus.py):
  read_file  the agent's tool (RPC + line numbering) and the raw RPC read, vs `open().read()` on the host
  grep       the agent's tool (`rg --sort=path` inside the sandbox, via RPC) vs the same `rg` run on the host
  shell      `run_terminal_cmd "echo hi"` in the persistent shell vs `bash -c "echo hi"` on the host
Goals (issue: harness): read_file p50 under 5 ms; grep within 2x of direct ripgrep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus import make_tree, write_section
from opencomposer.harness.tools import ToolContext, build_toolset
from opencomposer.sandbox.local import Workspace

ROOT = Path(__file__).resolve().parents[1]


def measure(fn, n: int, rounds: int) -> dict:
    p50s, p95s = [], []
    for _ in range(rounds):
        for _ in range(3):
            fn()
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t) * 1000)
        xs.sort()
        p50s.append(statistics.median(xs))
        p95s.append(xs[int(0.95 * (len(xs) - 1))])
    return {"p50": statistics.median(p50s), "p95": statistics.median(p95s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n, rounds = (10, 2) if args.quick else (40, 5)
    rg = shutil.which("rg", path=os.path.dirname(sys.executable)) or shutil.which("rg")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="oc-bench-h-") as tmp:
        tree = Path(tmp) / "repo"
        files, size = make_tree(tree)
        target = sorted(tree.rglob("*.py"), key=lambda p: abs(p.stat().st_size - 10_000))[0]
        rel = str(target.relative_to(tree))
        with Workspace(tree) as ws, ws.sandbox() as sb:
            sb.start_server()
            ctx = ToolContext(sb)
            ts = build_toolset()

            def tool(name, **kw):
                r = ts.call(ctx, name, json.dumps(kw))
                assert r.ok, r.content
                return r

            pattern = "def __init__"
            rows["read_file: agent tool (RPC)"] = measure(lambda: tool("read_file", target_file=rel), n, rounds)
            rows["read_file: raw RPC read"] = measure(lambda: sb.read_file(rel), n, rounds)
            rows["read_file: host open().read()"] = measure(lambda: target.read_bytes(), n, rounds)
            g = max(3, n // 4)
            rows["grep: agent tool (rg in sandbox, sorted)"] = measure(lambda: tool("grep", pattern=pattern), g, rounds)
            host_rg = [rg, "--color=never", "--hidden", "-g", "!.git", "--sort=path", "--no-heading",
                       "--line-number", "--max-columns=500", "--max-columns-preview", "-e", pattern]
            rows["grep: host rg, same flags"] = measure(
                lambda: subprocess.run(host_rg, cwd=tree, capture_output=True), g, rounds)
            rows["grep: host rg, unsorted (parallel)"] = measure(
                lambda: subprocess.run([rg, "--no-heading", "-n", "-e", pattern], cwd=tree, capture_output=True),
                g, rounds)
            rows["shell: run_terminal_cmd echo (session)"] = measure(
                lambda: tool("run_terminal_cmd", command="echo hi"), n, rounds)
            rows["shell: host bash -c echo"] = measure(
                lambda: subprocess.run(["bash", "-c", "echo hi"], capture_output=True), n, rounds)
    md = render(rows, files, size, " ".join(["benchmarks/harness.py", *sys.argv[1:]]))
    print(md)
    if not args.quick:
        write_section(ROOT / "docs" / "benchmarks.md", "harness", md)


def render(rows: dict, files: int, size: int, cmd: str) -> str:
    read = rows["read_file: agent tool (RPC)"]["p50"]
    ratio = rows["grep: agent tool (rg in sandbox, sorted)"]["p50"] / rows["grep: host rg, same flags"]["p50"]
    lines = [
        "## Harness tools (`benchmarks/harness.py`)", "",
        f"Reproduce: `.venv/bin/python {cmd}` — a {size / 2**20:.0f} MB, {files}-file repository; medians over rounds.",
        "", "| operation | p50 ms | p95 ms |", "|---|---|---|",
    ]
    lines += [f"| {k} | {v['p50']:.2f} | {v['p95']:.2f} |" for k, v in rows.items()]
    lines += ["",
              f"read_file tool p50 **{read:.2f} ms** (goal: under 5 ms); grep tool / host ripgrep with the same flags "
              f"= **{ratio:.2f}x** (goal: within 2x).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OPENCOMPOSER_STATE", tempfile.mkdtemp(prefix="oc-bench-state-"))
    main()
