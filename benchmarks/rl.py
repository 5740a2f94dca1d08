"""RL throughput, measured side by side in one run:

    .venv/bin/python benchmarks/rl.py [--part all|train,sync,pipeline] [--steps 8] [--rounds 3]
                                      # writes "rl-<part>" sections in docs/benchmarks.md

- train: one trainer step of SmolLM2-135M on a group of G=4 rollouts sharing a harness prompt (the
  system prompt with the tool schemas of the recipe's four tools and a task, rendered by our chat
  renderer; 150 completion tokens each, random ids), the shared prompt computed once against
  every rollout computing it (TrainerConfig.share_prompt), with the KL reference forward on; and
  the shared-prompt step once more with the products on aten's `F.linear` instead of oneDNN
  (`model/linear.py`).
- sync: publishing a new version to the weight store and loading it on a replica (an XOR-delta
  zstd frame after one real Adam step at lr 1e-6, checksums verified) against a full safetensors
  save and load of the same state, and the bytes each writes.
- pipeline: samples trained per minute by the asynchronous loop (2 groups in flight) against the
  same code run synchronously (`sync = true`), on the RL tests' tiny task family (a real colorsys
  bug, the real harness, sandboxes and server). Rollout times here are short and even, so a
  long tail is added: before each rollout, a sleep drawn from a Pareto distribution (alpha 1.5,
  scale 1 s, capped at 30 s), seeded by the sample's id so both modes see the same delays. This
  stands in for the long tail of real agent episodes; the sleep is the only thing added. Final
  reward: the held-out pass rate (16 samples) of each run's last policy, to compare at equal reward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from corpus import write_section

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the RL tests' task family (tests/integration/rl_family.py)


def smollm2(tmp: Path) -> Path:
    from opencomposer.model.interop import import_default

    folder = tmp / "smollm2"
    import_default(folder)
    return folder


def harness_group(folder: Path, g: int = 4, completion: int = 150):
    from opencomposer.harness import prompt
    from opencomposer.harness.tools import ALL_TOOLS, ToolConfig, build_toolset
    from opencomposer.rl.rollout import Sample
    from opencomposer.rl.sequences import RLSequence
    from opencomposer.tokenizer.bpe import Tokenizer
    from opencomposer.tokenizer.chat import ChatRenderer

    keep = ("grep", "read_file", "search_replace", "run_terminal_cmd")
    tools = build_toolset(ToolConfig(disabled=tuple(t.name for t in ALL_TOOLS if t.name not in keep))).schemas()
    tok = Tokenizer.load(folder)
    msgs = [prompt.system_message("/workspace", ""),
            prompt.task_message("colorsys.rgb_to_hls returns the wrong lightness for grey; fix it.")]
    ids = ChatRenderer(tok).encode(msgs, tools, add_generation_prompt=True).ids
    rng = random.Random(0)
    samples = []
    for i in range(g):
        comp = [rng.randrange(100, tok.vocab_size) for _ in range(completion)]
        seq = RLSequence(ids=ids + comp, loss_mask=[0] * len(ids) + [1] * completion,
                         logprobs=[0.0] * len(ids) + [-2.0] * completion, versions=[-1] * len(ids) + [0] * completion,
                         sampling={"temperature": 1.0})
        samples.append(Sample(id=f"g0.{i}", group=0, index=i, task="t", reward=float(i % 2), sequences=[seq],
                              trained_tokens=completion))
    return samples, len(ids)


def part_train(tmp: Path, rounds: int) -> dict:
    from opencomposer.model.hf import load_model
    from opencomposer.rl.objective import ObjectiveConfig
    from opencomposer.rl.trainer import RLTrainer, TrainerConfig

    folder = smollm2(tmp)
    group, prompt_len = harness_group(folder)
    out = {"prompt_tokens": prompt_len, "completion_tokens": 150, "group_size": len(group)}
    from opencomposer.model import linear

    variants = {"shared prompt": (True, "onednn"), "every rollout": (False, "onednn"),
                "shared prompt, products on aten": (True, "aten")}
    trainers = {name: RLTrainer(load_model(folder), ObjectiveConfig(group_size=4, kl_coef=0.001),
                                TrainerConfig(lr=0.0, share_prompt=share))
                for name, (share, _) in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    out["backend"] = linear.backend()
    for _ in range(rounds):  # alternate, so the machine's noise falls on all
        for name, tr in trainers.items():
            before = linear.set_backend(variants[name][1])
            try:
                t = time.perf_counter()
                tr.step([group])
                times[name].append(time.perf_counter() - t)
            finally:
                linear.set_backend(before)
    out["seconds"] = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = out["seconds"]["every rollout"] / out["seconds"]["shared prompt"]
    out["ratio_backend"] = out["seconds"]["shared prompt, products on aten"] / out["seconds"]["shared prompt"]
    return out


def part_sync(tmp: Path, rounds: int) -> dict:
    from safetensors.torch import load_file, save_file

    from opencomposer.inference.weight_store import WeightStore, WeightStoreConfig
    from opencomposer.model.hf import load_model

    model = load_model(smollm2(tmp))
    v0 = {k: v.clone() for k, v in model.to_hf_state().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    loss = model(torch.randint(0, 1000, (1, 64))).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()  # one real update: every weight moves in its low bits
    v1 = {k: v.clone() for k, v in model.to_hf_state().items()}
    delta, full = [], []
    nbytes = {}
    for r in range(rounds):
        store = WeightStore(WeightStoreConfig(url=str(tmp / f"store{r}"), full_every=100))
        store.publish(v0, 0)
        t = time.perf_counter()
        m = store.publish(v1, 1)
        got = store.load(1, v0, 0)
        delta.append(time.perf_counter() - t)
        assert all(torch.equal(got[k], v1[k]) for k in v1)
        nbytes["delta"] = m["bytes"]
        t = time.perf_counter()
        path = tmp / f"full{r}.safetensors"
        save_file(v1, str(path))
        back = load_file(str(path))
        full.append(time.perf_counter() - t)
        assert all(torch.equal(back[k], v1[k]) for k in v1)
        nbytes["full"] = path.stat().st_size
    return {"delta_seconds": statistics.median(delta), "full_seconds": statistics.median(full),
            "delta_bytes": nbytes["delta"], "full_bytes": nbytes["full"],
            "ratio_seconds": statistics.median(full) / statistics.median(delta),
            "ratio_bytes": nbytes["full"] / nbytes["delta"]}


def pareto_delay(sample_id: str, index: int) -> float:
    rng = random.Random(f"{sample_id}/{index}")
    return min(30.0, rng.paretovariate(1.5))


def part_pipeline(tmp: Path, steps: int) -> dict:
    from opencomposer.core.metrics import read_jsonl
    from opencomposer.rl import loop
    from opencomposer.rl.events import read_events
    from opencomposer.rl.stage import staleness
    from tests.integration.rl_family import build_family
    from tests.integration.test_rl_loop import config

    family = build_family(tmp / "family")
    real = loop.run_rollout

    def delayed(task, sample, *a, **kw):
        time.sleep(pareto_delay(sample.id, sample.index))
        return real(task, sample, *a, **kw)

    loop.run_rollout = delayed
    out = {}
    try:
        for name, kw in (("async", {"max_inflight_groups": 2, "sync": False}), ("sync", {"sync": True})):
            # threads: the Pareto delay is patched into this process's rollout function
            cfg = dataclasses.replace(config(family, lr=2e-4, steps=steps), workers=8, eval_every=0,
                                      services="threads", **kw)
            d = tmp / name
            summary = loop.Run(cfg, d).run()
            ev = read_events(d / "events.jsonl")
            start = next(e["t"] for e in ev if e["kind"] == "queued")  # after the held-out eval at the start
            last = max(e["t"] for e in ev if e["kind"] == "step")
            trained = sum(1 for e in ev if e["kind"] == "trained")
            stale = staleness(list(read_jsonl(d / "metrics.jsonl")))
            out[name] = {"samples_per_min": trained / ((last - start) / 60), "seconds": last - start,
                         "trained": trained, "final_pass_rate": summary["eval_end"]["accuracy"],
                         "start_pass_rate": summary["eval_start"]["accuracy"], "staleness": stale}
    finally:
        loop.run_rollout = real
    out["ratio"] = out["async"]["samples_per_min"] / out["sync"]["samples_per_min"]
    return out


def markdown(res: dict, cmd: str, note: str = "") -> str:
    lines = [f"## rl: {', '.join(res)}", "", f"`{cmd}`; medians where rounds repeat. CPU, 2 cores, noisy VM. {note}",
             ""]
    if "train" in res:
        t = res["train"]
        s = t["seconds"]
        lines += [f"**Trainer step** (SmolLM2-135M, G = {t['group_size']} rollouts of {t['completion_tokens']} "
                  f"tokens after a {t['prompt_tokens']}-token harness prompt, KL reference on):", "",
                  "| | seconds per step |", "|---|---|",
                  f"| shared prompt once | {s['shared prompt']:.1f} |", f"| every rollout recomputes it | "
                  f"{s['every rollout']:.1f} |",
                  f"| shared prompt once, products on aten's `F.linear` | {s['shared prompt, products on aten']:.1f} |",
                  "", f"Shared prompt against every rollout: **{t['ratio']:.2f}x** (exact: tests/unit/"
                  f"test_shared_prompt.py). Products on {t['backend']} (`model/linear.py`) against aten: "
                  f"**{t['ratio_backend']:.2f}x**.", ""]
    if "sync" in res:
        w = res["sync"]
        lines += ["**Weight sync** (SmolLM2-135M, one Adam step at lr 1e-6 between the versions):", "",
                  "| | seconds (write + read) | bytes |", "|---|---|---|",
                  f"| weight store: XOR delta, zstd, sha256 verified | {w['delta_seconds']:.2f} | "
                  f"{w['delta_bytes'] / 1e6:.0f} MB |",
                  f"| full safetensors save + load | {w['full_seconds']:.2f} | {w['full_bytes'] / 1e6:.0f} MB |", "",
                  f"Delta against full: {w['ratio_seconds']:.2f}x the speed, {w['ratio_bytes']:.1f}x fewer bytes.",
                  ""]
    if "pipeline" in res:
        p = res["pipeline"]
        lines += ["**Asynchronous against synchronous** (tiny task family, Pareto-delayed rollouts; see the script):",
                  "", "| | samples trained / min | seconds | held-out pass rate start -> end | staleness "
                  "(versions: tokens) |", "|---|---|---|---|---|"]
        for k in ("async", "sync"):
            r = p[k]
            st = ", ".join(f"{a}: {b}" for a, b in sorted(r["staleness"].items(), key=lambda kv: int(kv[0])))
            lines.append(f"| {k} | {r['samples_per_min']:.1f} | {r['seconds']:.0f} | {r['start_pass_rate']:.0%} -> "
                         f"{r['final_pass_rate']:.0%} | {st} |")
        a, s = p["async"], p["sync"]
        if a["final_pass_rate"] == s["final_pass_rate"] == a["start_pass_rate"] == s["start_pass_rate"]:
            reward = (f"The final reward is equal only trivially: both runs started and ended at "
                      f"{a['final_pass_rate']:.0%} held out, so the comparison at a reward that moves is not shown.")
        else:
            reward = (f"Final held-out pass rate: async {a['final_pass_rate']:.0%}, sync {s['final_pass_rate']:.0%} "
                      f"(16 samples each).")
        lines += ["", f"Ratio: **{p['ratio']:.2f}x** samples per minute (goal 1.5x at equal final reward). One run "
                  f"each, not a median. {reward}", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", help="all, or a comma-separated list of train, sync, pipeline")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the record")
    args = ap.parse_args()
    parts = ["train", "sync", "pipeline"] if args.part == "all" else args.part.split(",")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in parts:
            d = Path(tmp) / p
            d.mkdir()
            res[p] = {"train": lambda: part_train(d, args.rounds), "sync": lambda: part_sync(d, args.rounds),
                      "pipeline": lambda: part_pipeline(d, args.steps)}[p]()
            print(json.dumps(res[p], indent=1, default=str), flush=True)
    for p in parts:  # one section per part, so parts can be measured in separate invocations
        md = markdown({p: res[p]}, f"benchmarks/rl.py --part {p}" + (f" --steps {args.steps}" if p == "pipeline"
                                                                       else f" --rounds {args.rounds}"), args.note)
        write_section(ROOT / "docs" / "benchmarks.md", f"rl-{p}", md)
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
