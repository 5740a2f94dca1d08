"""SFT on agent demonstrations: the shared-prefix batch against the padded batch of the same rows and
against one row a step (the speedrun's SFT before the shared prefix), in one run (same model, rows,
optimiser; rounds alternate; medians of the timed steps, per demonstration).

    .venv/bin/python benchmarks/sft.py --data RUN/sft/demonstrations [--batch 4] [--steps 3] [--rounds 2]

`--data`: trajectories as SFT reads them (a speedrun's `sft/demonstrations/` after its `sft` stage).
The rows are rendered with the tools each trajectory records, as the `sft` stage renders them; `--model`
defaults to the embedded default (SmolLM2-135M-Instruct). Writes the "sft" section of
docs/benchmarks.md.
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


def steps(folder: Path, batches: list, tmp: Path, seq_len: int) -> list[float]:
    from opencomposer.model.hf import load_model
    from opencomposer.train.trainer import OptimConfig, PhaseConfig, Trainer

    it = iter(batches)
    phase = PhaseConfig(name="sft", steps=len(batches), seq_len=seq_len, lr=1e-5, warmup=0, schedule="constant")
    trainer = Trainer(load_model(folder), OptimConfig(batch_size=1, ckpt_every=10**9, checkpoint_at_end=False),
                      (phase,), tmp)
    times = []
    for _ in batches:
        t = time.perf_counter()
        trainer.run(lambda pi, ph: next(it), dict, stop_at=trainer.step + 1)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2304)
    args = ap.parse_args()

    from opencomposer.model.interop import import_default
    from opencomposer.tokenizer.bpe import Tokenizer
    from opencomposer.tokenizer.chat import ChatRenderer
    from opencomposer.train.sft import collate, conversations, default_tool_schemas, encode
    from opencomposer.train.shared_prefix import SharedPrefixBatch

    with tempfile.TemporaryDirectory(prefix="oc-bench-sft-") as tmp:
        tmp = Path(tmp)
        folder = args.model or import_default(tmp / "smol")
        tok = Tokenizer.load(folder)
        renderer = ChatRenderer(tok)  # each trajectory carries the tool schemas it was run with
        examples = [encode(renderer, m, t, args.seq) for m, t in conversations((str(args.data),), default_tool_schemas())]
        n = args.steps + 1  # the first step warms up
        if len(examples) < n * args.batch:
            raise SystemExit(f"{len(examples)} demonstrations; {n * args.batch} needed")
        rows = [examples[i * args.batch:(i + 1) * args.batch] for i in range(n)]
        pad = tok.eos_id or 0
        kinds = {"one row a step": [collate([e], pad) for e in rows[0] + rows[1]][: n],
                 f"padded, {args.batch} rows": [collate(r, pad) for r in rows],
                 f"shared prefix, {args.batch} rows": [SharedPrefixBatch.of([(e.ids, e.labels) for e in r]) for r in rows]}
        per_step = {k: (1 if k == "one row a step" else args.batch) for k in kinds}
        shared = kinds[f"shared prefix, {args.batch} rows"]
        lengths = [len(e.ids) for r in rows for e in r]
        res: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                times = steps(folder, kinds[kind], tmp / f"{kind}{r}", args.seq)
                res[kind] += [t / per_step[kind] for t in times[1:]]  # seconds a demonstration
                print(kind, [round(x, 2) for x in times], flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    prefix = statistics.median(b.prefix for b in shared)
    computed = statistics.median(b.tokens() for b in shared)
    cmd = " ".join(["benchmarks/sft.py", *sys.argv[1:]])
    lines = ["## SFT on demonstrations (`benchmarks/sft.py`)", "",
             (f"Reproduce: `.venv/bin/python {cmd}` — SmolLM2-135M float32, {args.batch} demonstrations a step "
             f"(rows of {min(lengths)}-{max(lengths)} tokens, median {statistics.median(lengths):.0f}; a shared prefix "
             f"of {prefix:.0f} tokens, the system prompt and the four tools' schemas), AdamW, {args.rounds} "
             f"alternating rounds x {args.steps} timed steps, medians; {torch.get_num_threads()} torch threads. "
             "The padded and the shared-prefix batch compute the same loss and gradients "
                                       "(`tests/unit/test_sft_shared_prefix.py`)."), "",
             "| batch | seconds a demonstration | positions computed a demonstration |", "|---|---|---|"]
    positions = {"one row a step": statistics.median(lengths),
                 f"padded, {args.batch} rows": statistics.median(max(len(e.ids) for e in r) for r in rows),
                 f"shared prefix, {args.batch} rows": computed / args.batch}
    for kind in kinds:
        lines.append(f"| {kind} | {med[kind]:.2f} | {positions[kind]:,.0f} |")
    one, sh = med["one row a step"], med[f"shared prefix, {args.batch} rows"]
    lines += ["", (f"Shared prefix against one row a step: **{one / sh:.2f}x** the demonstrations a second; "
                   f"against the padded batch: **{med[f'padded, {args.batch} rows'] / sh:.2f}x**.")]
    md = "\n".join(lines)
    print(md)
    write_section(ROOT / "docs" / "benchmarks.md", "sft", md)


if __name__ == "__main__":
    main()
