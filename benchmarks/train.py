"""Training throughput on CPU: our trainer against a plain `transformers` training loop (same model,
weights, batches and optimiser), in one run; plus the data pipeline's throughput and padding waste.

    .venv/bin/python benchmarks/train.py [--steps 3] [--batch 4] [--seq 256]   # writes the "train" section

Models: SmolLM2-135M (the embedded default) and the `small-moe` preset (random weights). Both
loops see the same packed batches from `PackedSampler` and step AdamW (lr 1e-5, clipping at 1.0).
Ours: `Trainer` (document-masked attention, chunked loss); transformers: `model(ids,
labels=ids).loss`, backward, clip, step. Ours also runs under CPU bf16 autocast (`OptimConfig.bf16`),
the speedrun SFT stage's `bf16` setting. Rounds alternate; medians of the timed steps.
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


def hf_steps(model, batches, n: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    times = []
    for ids, _ in batches[:n]:
        t = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return times


def our_steps(model, batches, n: int, tmp: Path, bf16: bool = False) -> list[float]:
    from opencomposer.model.loss import IGNORE
    from opencomposer.train.trainer import OptimConfig, PhaseConfig, Trainer

    it = iter(batches[:n])

    def batch(pi, phase):
        ids, seg = next(it)
        return ids, seg, ids[:, 1:].masked_fill(seg[:, 1:] != seg[:, :-1], IGNORE)

    phase = PhaseConfig(steps=n, seq_len=batches[0][0].shape[1] - 1, lr=1e-5, warmup=0, schedule="constant")
    hist = Trainer(model, OptimConfig(ckpt_every=10**9, bf16=bf16), (phase,), tmp / "ck").run(batch, lambda: {})
    return [h["tokens"] / h["tokens_per_second"] for h in hist]  # the step's seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    import transformers

    from opencomposer.model.deepseek import DeepseekModel, preset
    from opencomposer.model.hf import load_model, save_model
    from opencomposer.model.interop import import_default
    from opencomposer.tokenizer.bpe import Tokenizer
    from opencomposer.train.data import MixConfig, PackedSampler, SourceConfig, build

    transformers.logging.set_verbosity_error()
    rows, data = {}, {}
    with tempfile.TemporaryDirectory(prefix="oc-bench-train-") as tmp:
        tmp = Path(tmp)
        smol = import_default(tmp / "smol")
        tok = Tokenizer.load(smol)
        mix = MixConfig(sources=(SourceConfig(name="stdlib", path="stdlib", include=("email/*.py", "json/*.py",
                                                                                       "http/*.py", "*.py"),
                                              max_docs=300, weight=1.0),), heldout_fraction=0.0)
        t = time.perf_counter()
        rep = build(mix, tok, tmp / "ds")
        build_s = time.perf_counter() - t
        total = rep.tokens["stdlib"]["train"]
        sampler = PackedSampler(tmp / "ds", seq_len=args.seq, seed=0)
        t = time.perf_counter()
        nb = 200
        for _ in range(nb):
            sampler.batch(args.batch)
        sample_s = time.perf_counter() - t
        starts = sampler.starts["stdlib"]
        lengths = list(starts[1:] - starts[:-1]) + [total - int(starts[-1])]
        padded = sum(-(-n // args.seq) * args.seq for n in lengths)  # each document padded to whole sequences
        data = {"documents": rep.documents["stdlib"], "tokens": total, "build_tok_s": total / build_s,
                "sample_tok_s": nb * args.batch * (args.seq + 1) / sample_s, "pad_waste_naive": 1 - total / padded}
        torch.manual_seed(0)
        moe = save_model(DeepseekModel(preset("small-moe", num_nextn_predict_layers=0)), tmp / "moe")
        sampler = PackedSampler(tmp / "ds", seq_len=args.seq, seed=1)
        batches = [sampler.batch(args.batch) for _ in range(args.steps + 1)]
        for name, folder in (("SmolLM2-135M", smol), ("small-moe", moe)):
            res = {"ours": [], "ours bf16": [], "transformers": []}
            for r in range(args.rounds):
                order = ("ours", "ours bf16", "transformers") if r % 2 == 0 else ("transformers", "ours bf16", "ours")
                for impl in order:
                    if impl.startswith("ours"):
                        times = our_steps(load_model(folder), batches, args.steps + 1, tmp / f"o{r}{impl[-1]}",
                                          bf16=impl == "ours bf16")
                    else:
                        m = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
                        times = hf_steps(m, batches, args.steps + 1)
                    res[impl] += times[1:]  # the first step warms up
                    print(name, impl, [round(x, 2) for x in times], flush=True)
            tokens = args.batch * args.seq
            rows[name] = {k: tokens / statistics.median(v) for k, v in res.items()}
    cmd = " ".join(["benchmarks/train.py", *sys.argv[1:]])
    lines = ["## Training throughput (`benchmarks/train.py`)", "",
             f"Reproduce: `.venv/bin/python {cmd}` — batch {args.batch} x {args.seq} packed tokens, AdamW, clipping, "
             f"float32 weights, {args.rounds} alternating rounds x {args.steps} timed steps, medians; `ours bf16` is "
             "the same trainer under CPU bf16 autocast (`OptimConfig.bf16`: products and attention in bfloat16, "
             f"float32 weights, optimiser and loss). {torch.get_num_threads()} torch threads.", "",
             "| model | ours tok/s | ours bf16 tok/s | plain transformers loop tok/s | ours / transformers | "
             "ours bf16 / ours |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['ours']:.0f} | {r['ours bf16']:.0f} | {r['transformers']:.0f} | "
                     f"**{r['ours'] / r['transformers']:.2f}x** | **{r['ours bf16'] / r['ours']:.2f}x** |")
    lines += ["", f"Data pipeline ({data['documents']} stdlib files, {data['tokens']:,} tokens): building the mix "
              f"(read, filter, dedup, tokenise, write) {data['build_tok_s']:,.0f} tokens/s; packed sampling "
              f"{data['sample_tok_s']:,.0f} tokens/s; padding waste 0% with packing vs "
              f"{data['pad_waste_naive']:.0%} if each document were padded to whole {args.seq}-token sequences."]
    md = "\n".join(lines)
    print(md)
    write_section(ROOT / "docs" / "benchmarks.md", "train", md)


if __name__ == "__main__":
    main()
