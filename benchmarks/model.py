"""Model forward+backward throughput and peak memory on CPU: our implementation against the
`transformers` implementation of the same configuration and weights, in one run.

    .venv/bin/python benchmarks/model.py [--rounds 3] [--batch 4] [--seq 256]   # writes the "model" section

Two models: the `small-moe` DeepSeek-V3-family preset (random weights, no MTP, saved once and loaded
by both implementations) and SmolLM2-135M-Instruct (the embedded default, imported from its GGUF).
Each measurement runs in a fresh process (so peak RSS is its own): load, one warm-up step, then timed
training steps — each implementation's standard loss path (ours: `causal_lm_loss`, chunked over the
vocabulary; transformers: `model(ids, labels=ids).loss`), backward included. Rounds alternate
between the implementations; the table quotes medians over all timed steps.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus import write_section

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker(impl: str, folder: str, batch: int, seq: int, steps: int) -> None:
    import torch

    torch.manual_seed(0)
    if impl == "ours":
        from opencomposer.model.hf import load_model
        from opencomposer.model.loss import causal_lm_loss

        model = load_model(folder)
        vocab = model.config.vocab_size

        def step(ids):
            causal_lm_loss(model, ids).backward()
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        vocab = model.config.vocab_size

        def step(ids):
            model(ids, labels=ids).loss.backward()
    model.train()
    ids = torch.randint(0, vocab, (batch, seq))
    base = rss_mb()
    step(ids)
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"times": times, "peak_mb": peak - base, "tokens": batch * seq}))


def prepare(tmp: Path) -> dict[str, str]:
    import torch

    from opencomposer.model.deepseek import DeepseekModel, preset
    from opencomposer.model.hf import save_model
    from opencomposer.model.interop import import_default

    torch.manual_seed(0)
    moe = tmp / "small-moe"
    save_model(DeepseekModel(preset("small-moe", num_nextn_predict_layers=0)), moe)
    smol = tmp / "smollm2"
    import_default(smol)
    return {"small-moe (DeepSeek-V3 family, 90M, 49M active)": str(moe), "SmolLM2-135M (Llama family)": str(smol)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.batch, args.seq, args.steps)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="oc-bench-model-") as tmp:
        for name, folder in prepare(Path(tmp)).items():
            res = {"ours": {"times": [], "peak": []}, "transformers": {"times": [], "peak": []}}
            for r in range(args.rounds):
                for impl in ("ours", "transformers") if r % 2 == 0 else ("transformers", "ours"):
                    out = subprocess.run([sys.executable, __file__, "--worker", impl, folder, "--batch",
                                          str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)],
                                         capture_output=True, text=True, timeout=1800, check=True)
                    d = json.loads(out.stdout.strip().splitlines()[-1])
                    res[impl]["times"] += d["times"]
                    res[impl]["peak"].append(d["peak_mb"])
                    print(name, impl, [round(t, 2) for t in d["times"]], f"{d['peak_mb']:.0f} MB", flush=True)
            tokens = args.batch * args.seq
            rows[name] = {impl: (tokens / statistics.median(v["times"]), statistics.median(v["peak"]))
                          for impl, v in res.items()}
    cmd = " ".join(["benchmarks/model.py", *sys.argv[1:]])
    lines = ["## Model forward+backward (`benchmarks/model.py`)", "",
             f"Reproduce: `.venv/bin/python {cmd}` — batch {args.batch} x {args.seq} tokens, float32, "
             f"{args.rounds} alternating rounds x {args.steps} timed steps, medians; peak = the process's RSS "
             "high-water mark above its RSS after loading.", "",
             "| model | ours tok/s | transformers tok/s | ratio | ours peak MB | transformers peak MB | ratio |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        (ot, om), (ht, hm) = r["ours"], r["transformers"]
        lines.append(f"| {name} | {ot:.0f} | {ht:.0f} | **{ot / ht:.2f}x** | {om:.0f} | {hm:.0f} | {om / hm:.2f}x |")
    md = "\n".join(lines)
    print(md)
    write_section(ROOT / "docs" / "benchmarks.md", "model", md)


if __name__ == "__main__":
    main()
