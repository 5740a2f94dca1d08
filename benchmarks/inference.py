"""Decode throughput and time to first token: our engine against `transformers` `generate` on the
same weights, in one run; plus the engine's in-flight weight-swap latency.

    .venv/bin/python benchmarks/inference.py [--rounds 3] [--new 32] [--prompt 64]   # writes "inference"

Two models: SmolLM2-135M (the embedded default) and the `small-moe` DeepSeek-V3-family preset
(random weights). For batch sizes 1, 8 and 32, B distinct random prompts of the same length are
decoded greedily for exactly `--new` tokens (no early stop) by each implementation; throughput is
B x new tokens / wall time, prefill included. Time to first token: one request of 4 x `--prompt`
tokens, one new token. Rounds alternate between implementations; the table quotes medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from corpus import write_section

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32)


def ours(model, prompts: torch.Tensor, new: int) -> float:
    from opencomposer.inference.engine import Engine, EngineConfig
    from opencomposer.inference.sampling import SamplingParams

    engine = Engine(model, config=EngineConfig(slots=prompts.shape[0], max_len=prompts.shape[1] + new + 1))
    t = time.perf_counter()
    seqs = [engine.submit(p.tolist(), SamplingParams(temperature=0.0, max_tokens=new))[0] for p in prompts]
    while engine.has_work():
        engine.step()
    secs = time.perf_counter() - t
    assert all(len(s.tokens) == new for s in seqs)
    return secs


def hf(model, prompts: torch.Tensor, new: int) -> float:
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    secs = time.perf_counter() - t
    assert out.shape[1] == prompts.shape[1] + new
    return secs


def swap_seconds(model) -> float:
    from opencomposer.inference.engine import Engine, EngineConfig

    engine = Engine(model, config=EngineConfig(slots=1, max_len=64))
    state = {k: v.clone() for k, v in model.to_hf_state().items()}
    engine.update_weights(state, 1)
    return engine.stats["last_swap_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    import transformers

    from opencomposer.model.deepseek import DeepseekModel, preset
    from opencomposer.model.hf import load_model, save_model
    from opencomposer.model.interop import import_default

    transformers.logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    rows, swaps = {}, {}
    with tempfile.TemporaryDirectory(prefix="oc-bench-inf-") as tmp:
        torch.manual_seed(0)
        moe = save_model(DeepseekModel(preset("small-moe", num_nextn_predict_layers=0)), Path(tmp) / "moe")
        smol = import_default(Path(tmp) / "smol")
        for name, folder in (("SmolLM2-135M", smol), ("small-moe", moe)):
            mine = load_model(folder).eval()
            ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            vocab = mine.config.vocab_size
            res = {(impl, b): [] for impl in ("ours", "transformers") for b in (*BATCHES, "ttft")}
            for r in range(args.rounds):
                g = torch.Generator().manual_seed(r)
                for b in BATCHES:
                    prompts = torch.randint(0, vocab, (b, args.prompt), generator=g)
                    order = (("ours", mine, ours), ("transformers", ref, hf))
                    for impl, model, fn in order if r % 2 == 0 else order[::-1]:
                        res[(impl, b)].append(fn(model, prompts, args.new))
                        print(name, impl, b, f"{res[(impl, b)][-1]:.2f}s", flush=True)
                long = torch.randint(0, vocab, (1, 4 * args.prompt), generator=g)
                res[("ours", "ttft")].append(ours(mine, long, 1))
                res[("transformers", "ttft")].append(hf(ref, long, 1))
            rows[name] = {k: statistics.median(v) for k, v in res.items()}
            swaps[name] = statistics.median(swap_seconds(mine) for _ in range(3))
    cmd = " ".join(["benchmarks/inference.py", *sys.argv[1:]])
    lines = ["## Inference engine decode throughput (`benchmarks/inference.py`)", "",
             f"Reproduce: `.venv/bin/python {cmd}` — greedy, {args.prompt}-token prompts, exactly {args.new} new "
             f"tokens, float32, {args.rounds} alternating rounds, medians; ours = the engine (continuous batching, "
             "slot KV cache), transformers = `generate` with its default cache.", "",
             "| model | batch | ours tok/s | transformers tok/s | ratio |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        for b in BATCHES:
            o, h = b * args.new / r[("ours", b)], b * args.new / r[("transformers", b)]
            lines.append(f"| {name} | {b} | {o:.1f} | {h:.1f} | **{o / h:.2f}x** |")
        lines.append(f"| {name} | time to first token ({4 * args.prompt}-token prompt) | "
                     f"{r[('ours', 'ttft')] * 1e3:.0f} ms | {r[('transformers', 'ttft')] * 1e3:.0f} ms | "
                     f"{r[('transformers', 'ttft')] / r[('ours', 'ttft')]:.2f}x |")
    lines += ["", "In-flight weight swap (all tensors, in place, between two decode steps): " +
              ", ".join(f"{n} {s * 1e3:.0f} ms" for n, s in swaps.items()) + "."]
    md = "\n".join(lines)
    print(md)
    write_section(ROOT / "docs" / "benchmarks.md", "inference", md)


if __name__ == "__main__":
    main()
