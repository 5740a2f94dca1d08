"""Server overhead under concurrency: the FastAPI/uvicorn server against the previous
ThreadingHTTPServer (taken from git history, commit LEGACY), side by side in one run.

    .venv/bin/python benchmarks/server.py [--repeats 3] [--quick]

A tiny model (1 layer, 32 wide) and one generated token per request, so the time is the server's:
parsing, rendering, admission, the engine round trip and the response. Each server runs in its
own process; the clients (threads, one connection per request) in this one. For 1, 16, 64 and
256 concurrent clients: requests per second and p50/p99 latency of successful requests, and how
many requests failed (a reset or a 5xx; a deliberate 429/503 is counted apart). Then the most
concurrent streams (64 tokens each) held without an error. Medians of R runs.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from corpus import write_section

ROOT = Path(__file__).resolve().parents[1]
LEGACY = "71013eb"
"""The last commit with the hand-rolled ThreadingHTTPServer."""
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "def add(a, b):"}],
                   "max_tokens": 1, "temperature": 0}).encode()


def make_model(folder: Path) -> None:
    import torch

    from opencomposer.model.hf import save_model
    from opencomposer.model.llama import LlamaConfig, LlamaModel
    from opencomposer.tokenizer.bpe import train_bpe

    tok = train_bpe([Path(json.__file__).read_text()] * 2, vocab_size=400)
    torch.manual_seed(0)
    save_model(LlamaModel(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=512)), folder)
    tok.save(folder / "tokenizer.json")


def legacy_module(tmp: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{LEGACY}:src/opencomposer/inference/server.py"],
                         capture_output=True, text=True, check=True).stdout
    path = tmp / "legacy_server.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("legacy_server", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["legacy_server"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def serve(kind: str, folder: str, tmp: str, ports) -> None:
    import torch

    torch.set_num_threads(1)
    if kind == "legacy":
        mod = legacy_module(Path(tmp))
    else:
        import opencomposer.inference.server as mod
    engine, tok = mod.load_served(Path(folder), slots=32)
    srv = mod.Server(engine, tok, "tiny", mod.ServeConfig(port=0, default_max_tokens=1)).start()
    host, port = (srv.httpd.server_address[:2] if kind == "legacy" else srv.address)
    ports.put(port)
    threading.Event().wait()


def one(port: int, body: bytes = BODY, timeout: float = 120.0) -> tuple[int, float]:
    t = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, time.perf_counter() - t
    except (OSError, http.client.HTTPException):
        return -1, time.perf_counter() - t
    finally:
        c.close()


def load(port: int, conc: int, n: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        res = list(ex.map(lambda _: one(port), range(n)))
    wall = time.perf_counter() - t0
    ok = sorted(d for s, d in res if s == 200)
    q = (lambda p: ok[min(len(ok) - 1, int(p * len(ok)))] * 1000) if ok else (lambda p: float("nan"))
    return {"rps": len(ok) / wall, "p50": q(0.5), "p99": q(0.99), "errors": sum(s == -1 or s >= 500 for s, _ in res),
            "busy": sum(s in (429, 503) for s, _ in res)}


def streams_held(port: int, counts=(32, 64, 128, 256)) -> int:
    body = json.loads(BODY)
    body.update(max_tokens=64, stream=True)
    raw = json.dumps(body).encode()
    best = 0
    for k in counts:
        with ThreadPoolExecutor(k) as ex:
            res = list(ex.map(lambda _: one(port, raw, timeout=300), range(k)))
        if any(s != 200 for s, _ in res):
            break
        best = k
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="print only, do not write docs/benchmarks.md")
    args = ap.parse_args()
    levels = (1, 16, 64, 256)
    rows: dict = {}
    held = {}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="oc-bench-srv-") as tmp:
        folder = Path(tmp) / "tiny"
        make_model(folder)
        for kind in ("legacy", "asgi"):
            ports = ctx.Queue()
            p = ctx.Process(target=serve, args=(kind, str(folder), tmp, ports), daemon=True)
            p.start()
            try:
                port = ports.get(timeout=120)
                one(port)  # warm up
                for conc in levels:
                    runs = [load(port, conc, max(64, 2 * conc)) for _ in range(args.repeats)]
                    rows[(kind, conc)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                held[kind] = streams_held(port)
            finally:
                p.terminate()
                p.join(10)
    cmd = " ".join(["benchmarks/server.py", *sys.argv[1:]])
    lines = ["## Server under concurrency (`benchmarks/server.py`)", "",
             f"Reproduce: `.venv/bin/python {cmd}` — medians of {args.repeats} runs; a tiny model, one token per "
             f"request (server overhead, not model time); the previous server is commit {LEGACY}'s "
             "ThreadingHTTPServer, run in the same script.", "",
             "| clients | server | requests/s | p50 ms | p99 ms | errors (reset/5xx) | 429/503 |", "|---|---|---|---|---|---|---|"]
    for conc in levels:
        for kind in ("legacy", "asgi"):
            r = rows[(kind, conc)]
            lines.append(f"| {conc} | {'ThreadingHTTPServer' if kind == 'legacy' else 'FastAPI/uvicorn'} | "
                         f"{r['rps']:.0f} | {r['p50']:.0f} | {r['p99']:.0f} | {r['errors']:.0f} | {r['busy']:.0f} |")
    lines += ["", "| | ThreadingHTTPServer | FastAPI/uvicorn |", "|---|---|---|",
              f"| most concurrent 64-token streams held without an error (of 32/64/128/256) | {held['legacy']} | "
              f"{held['asgi']} |"]
    ratio = {c: rows[("asgi", c)]["rps"] / rows[("legacy", c)]["rps"] if rows[("legacy", c)]["rps"] else float("inf")
             for c in levels}
    lines += ["", "Throughput ratio, FastAPI/uvicorn over ThreadingHTTPServer: "
              + ", ".join(f"{c} clients {ratio[c]:.2f}x" for c in levels) + ".", ""]
    md = "\n".join(lines)
    print(md)
    if not args.quick:
        write_section(ROOT / "docs" / "benchmarks.md", "server", md)


if __name__ == "__main__":
    main()
