"""Sandbox benchmark (issue: foundation and sandbox runtime), side by side in one run.

    .venv/bin/python benchmarks/sandbox.py            # full run, writes the section in docs/benchmarks.md
    .venv/bin/python benchmarks/sandbox.py --quick    # smaller, prints only

Measures, against the named peers:
  1. create + exec `true` + close latency (p50, p95): ours vs raw `bwrap` with the same isolation
     flags, raw minimal `bwrap --unshare-all --ro-bind / / true`, and plain `subprocess`;
  2. fork of a ~50 MB / ~4,000-file workspace vs `cp -a` of the same tree;
  3. sustained sandbox starts per second with N concurrent;
  4. memory per idle sandbox (without and with its tool server running);
  5. the most concurrent live sandboxes (each with a running tool server) held without a failure.
Each latency figure is the median over rounds of the median of a round (this machine is noisy).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from corpus import make_tree, write_section
from opencomposer.sandbox import isolation
from opencomposer.sandbox.base import SandboxConfig
from opencomposer.sandbox.local import Workspace

ROOT = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def timed(fn, n: int, warm: int = 3) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def latency(ws: Workspace, n: int, rounds: int) -> dict:
    cfg = ws.config
    probe = ws.sandbox()  # the same argv our one-shot path runs, minus our own launcher
    same_flags = isolation.bwrap_argv(cfg, probe._mount_args(), env=probe.env, seccomp_fd=None,
                                      die_with_parent=True) + ["--", "true"]
    bare = [isolation.bwrap_path(), "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--tmpfs", "/tmp",
            "true"]

    def ours():
        with ws.sandbox() as sb:
            sb.exec("true")

    cases = {
        "opencomposer create+exec+close": ours,
        "raw bwrap, same isolation flags": lambda: subprocess.run(same_flags, check=True),
        "raw bwrap, minimal": lambda: subprocess.run(bare, check=True),
        "plain subprocess": lambda: subprocess.run(["true"], check=True),
    }
    rows = {k: {"p50": [], "p95": []} for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():  # interleaved, so drift hits every case alike
            xs = timed(fn, n)
            rows[name]["p50"].append(statistics.median(xs))
            rows[name]["p95"].append(pct(xs, 0.95))
    probe.close()
    return {k: {"p50": statistics.median(v["p50"]), "p95": statistics.median(v["p95"])} for k, v in rows.items()}


def fork_vs_copy(tree: Path, rounds: int) -> dict:
    ours, cp = [], []
    with Workspace(tree) as ws, ws.sandbox() as parent:
        parent.exec("for f in $(ls | head -20); do test -f $f && echo '# edit' >> $f; done; true")
        for i in range(rounds):
            t = time.perf_counter()
            (child,) = parent.fork(1)
            ours.append((time.perf_counter() - t) * 1000)
            child.exec("true")
            child.close()
            dst = Path(tempfile.mkdtemp(prefix="oc-bench-cp-"))
            t = time.perf_counter()
            subprocess.run(["cp", "-a", f"{tree}/.", str(dst)], check=True)
            cp.append((time.perf_counter() - t) * 1000)
            shutil.rmtree(dst)
    return {"fork_ms": statistics.median(ours), "cp_a_ms": statistics.median(cp)}


def starts_per_second(ws: Workspace, workers: int, seconds: float) -> dict:
    count = [0]
    fails = [0]
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop():
        while time.monotonic() < end:
            try:
                with ws.sandbox() as sb:
                    ok = sb.exec("true").ok
            except Exception:  # noqa: BLE001 - a failure is a data point here
                ok = False
            with lock:
                count[0] += ok
                fails[0] += not ok

    t0 = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"per_s": count[0] / (time.monotonic() - t0), "failures": fails[0]}


def rss_mb(pids) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def avail_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_and_capacity(ws: Workspace, idle_n: int, max_n: int) -> dict:
    before = avail_mb()
    idle = [ws.sandbox() for _ in range(idle_n)]
    no_server = (before - avail_mb()) / idle_n
    for sb in idle:
        sb.start_server()
    time.sleep(0.5)
    with_server_rss = statistics.median(rss_mb(sb.cgroup.pids()) for sb in idle)
    for sb in idle:
        sb.close()
    live, failure = [], None
    t = time.perf_counter()
    try:
        for i in range(max_n):
            sb = ws.sandbox()
            live.append(sb)
            sb.start_server()
        for sb in live:  # every one must still answer
            if sb.exec("echo ok").stdout != "ok\n":
                failure = f"{sb.id} did not answer"
                break
    except Exception as e:  # noqa: BLE001
        failure = f"after {len(live)}: {type(e).__name__}: {e}"
    held = len(live) if failure is None else len(live) - 1
    elapsed = time.perf_counter() - t
    for sb in live:
        sb.close()
    return {"idle_no_server_mb": max(no_server, 0.0), "idle_with_server_rss_mb": with_server_rss,
            "max_live": held, "max_tried": max_n, "failure": failure, "open_all_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    n, rounds = (10, 2) if args.quick else (30, 5)
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="oc-bench-") as tmp:
        empty = Path(tmp) / "empty"
        empty.mkdir()
        (empty / "a.txt").write_text("x")
        with Workspace(empty, SandboxConfig()) as ws:
            res["latency"] = latency(ws, n, rounds)
            res["starts"] = {w: starts_per_second(ws, w, 3.0 if args.quick else 8.0) for w in (1, 2, 4, 8)}
            res["memory"] = memory_and_capacity(ws, 10 if args.quick else 20, 40 if args.quick else 256)
        tree = Path(tmp) / "tree"
        files, size = make_tree(tree)
        res["tree"] = {"files": files, "mb": size / 2**20}
        res["fork"] = fork_vs_copy(tree, 3 if args.quick else 7)
    md = render(res, " ".join(["benchmarks/sandbox.py", *sys.argv[1:]]))
    print(md)
    if not args.quick:
        write_section(Path(args.write), "sandbox", md)


def render(r: dict, cmd: str) -> str:
    lat = r["latency"]
    ours = lat["opencomposer create+exec+close"]
    same = lat["raw bwrap, same isolation flags"]
    bare = lat["raw bwrap, minimal"]
    lines = [
        "## Sandbox (`benchmarks/sandbox.py`)",
        "",
        f"Reproduce: `.venv/bin/python {cmd}` (2-core VM; medians over rounds).",
        "",
        "| create + exec `true` | p50 ms | p95 ms |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v['p50']:.2f} | {v['p95']:.2f} |" for k, v in lat.items()]
    f = r["fork"]
    starts = r["starts"]
    m = r["memory"]
    lines += [
        "",
        f"Ratios: ours / raw bwrap with the same flags = **{ours['p50'] / same['p50']:.2f}x** (p50); "
        f"ours / minimal raw bwrap = **{ours['p50'] / bare['p50']:.2f}x** (goal: within 3x).",
        "",
        f"Fork of a {r['tree']['mb']:.0f} MB, {r['tree']['files']}-file workspace: **{f['fork_ms']:.1f} ms** vs "
        f"`cp -a` {f['cp_a_ms']:.1f} ms = **{f['fork_ms'] / f['cp_a_ms']:.3f}x** (goal: under 0.1x).",
        "",
        "| concurrent workers | sandbox starts per second (create+exec+close) | failures |",
        "|---|---|---|",
    ]
    lines += [f"| {w} | {v['per_s']:.0f} | {v['failures']} |" for w, v in starts.items()]
    lines += [
        "",
        f"Memory per idle sandbox: {m['idle_no_server_mb']:.2f} MiB without a tool server (no process at all), "
        f"{m['idle_with_server_rss_mb']:.1f} MiB RSS with its tool server running.",
        "",
        f"Most concurrent live sandboxes held, each with a running tool server, all answering: "
        f"**{m['max_live']}** of {m['max_tried']} tried ({m['open_all_s']:.1f} s to open and check all)"
        + (f"; first failure: {m['failure']}" if m["failure"] else "; no failure") + " (goal: at least 200).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OPENCOMPOSER_STATE", tempfile.mkdtemp(prefix="oc-bench-state-"))
    main()
