"""RL throughput, measured side by side in one run:

    .venv/bin/python benchmarks/rl.py [--part all|train,sync,pipeline,threads] [--steps 12] [--rounds 3]
                                      # writes "rl-<part>" sections in docs/benchmarks.md

- train: one trainer step of SmolLM2-135M on a group of G=4 rollouts sharing a harness prompt (the
  system prompt with the tool schemas of the recipe's four tools and a task, rendered by our chat
  renderer; 600 completion tokens each, random ids: a recorded `renames-small` group's rollouts
  add 588-836 tokens to their shared prompt), the shared prompt computed once against
  every rollout computing it (TrainerConfig.share_prompt), with the KL reference forward on; the
  shared-prompt step once more with the products on aten's `F.linear` instead of oneDNN
  (`model/linear.py`); and once more with each rollout's attention over the shared prompt run on
  zero-padded queries (the aligned causal kernel) instead of SDPA's fused kernel with the mask.
- sync: publishing a new version to the weight store and loading it on a replica (an XOR-delta
  zstd frame after one real Adam step at lr 1e-6, checksums verified) against a full safetensors
  save and load of the same state, and the bytes each writes.
- pipeline: samples trained per minute by the asynchronous loop (2 groups in flight) against the
  same code run synchronously (`sync = true`), on the RL tests' tiny task family (a real colorsys
  bug, the real harness, sandboxes and server). Rollout times here are short and even, so a
  long tail is added: before each rollout, a sleep drawn from a Pareto distribution (alpha 1.5,
  scale 1 s, capped at 30 s), seeded by the sample's id so both modes see the same delays. This
  stands in for the long tail of real agent episodes; the sleep is the only thing added. Both
  modes train at the RL test's learning rate for `--steps` steps (12, the test's: the tiny model
  learns in them), `--rounds` times, alternating. Final reward: the held-out pass rate (16
  samples) of each run's last policy, to compare at equal reward.
- threads: the trainer (forward + backward of a G = 4 group) and the engine (prefill + decode of 8
  sequences) in two processes, as the RL loop runs them: each alone with every core, then side by
  side with every core each (torch's default) against the cores split between them
  (`RLConfig.trainer_threads` / `replica_threads`), `--seconds` each way a round.
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


def harness_group(folder: Path, g: int = 4, completion: int = 600):
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
    out = {"prompt_tokens": prompt_len, "completion_tokens": len(group[0].sequences[0].ids) - prompt_len,
           "group_size": len(group)}
    from opencomposer.model import cache, linear

    # (share the prompt, products' backend, a suffix's attention on SDPA's fused kernel with its mask)
    variants = {"shared prompt": (True, "onednn", True), "every rollout": (False, "onednn", True),
                "shared prompt, products on aten": (True, "aten", True),
                "shared prompt, suffix attention over padded queries": (True, "onednn", False)}
    trainers = {name: RLTrainer(load_model(folder), ObjectiveConfig(group_size=4, kl_coef=0.001),
                                TrainerConfig(lr=0.0, share_prompt=share))
                for name, (share, _, _) in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    out["backend"] = linear.backend()
    fused = cache._fused_with_mask
    for _ in range(rounds):  # alternate, so the machine's noise falls on all
        for name, tr in trainers.items():
            _, backend, masked = variants[name]
            before = linear.set_backend(backend)
            cache._fused_with_mask = fused if masked else (lambda *a: False)
            try:
                t = time.perf_counter()
                tr.step([group])
                times[name].append(time.perf_counter() - t)
            finally:
                linear.set_backend(before)
                cache._fused_with_mask = fused
    out["seconds"] = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = out["seconds"]["every rollout"] / out["seconds"]["shared prompt"]
    out["ratio_backend"] = out["seconds"]["shared prompt, products on aten"] / out["seconds"]["shared prompt"]
    out["ratio_mask"] = (out["seconds"]["shared prompt, suffix attention over padded queries"]
                         / out["seconds"]["shared prompt"])
    return out


def _threads_worker(role: str, threads: int, seconds: float, folder: Path, sync: Path) -> None:
    """One side of `part_threads`, in its own process: load, say ready, wait for the go, then run
    for `seconds` and print its rate as JSON."""
    torch.set_num_threads(threads)
    from opencomposer.model.hf import load_model

    if role == "train":
        from opencomposer.rl.objective import ObjectiveConfig
        from opencomposer.rl.trainer import RLTrainer, TrainerConfig

        group, prompt_len = harness_group(folder, completion=600)  # about a real rollout's length here
        trainer = RLTrainer(load_model(folder), ObjectiveConfig(group_size=4), TrainerConfig(lr=0.0))
        tokens = prompt_len + 4 * 600

        def work() -> int:
            trainer.step([group])
            return tokens
    else:
        from opencomposer.inference.engine import Engine, EngineConfig
        from opencomposer.inference.sampling import SamplingParams

        engine = Engine(load_model(folder).eval(), config=EngineConfig(slots=8, max_len=1100, prefix_cache_mb=0))
        gen = torch.Generator().manual_seed(0)

        def work() -> int:
            prompts = torch.randint(100, 40000, (8, 1000), generator=gen)
            for p in prompts:
                engine.submit(p.tolist(), SamplingParams(temperature=0.0, max_tokens=64))
            while engine.has_work():
                engine.step()
            return 8 * 64
    (sync / f"{role}.ready").touch()
    while not (sync / "go").exists():
        time.sleep(0.05)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        n += work()
    print(json.dumps({"tokens_per_s": n / (time.perf_counter() - t)}), flush=True)


def part_threads(tmp: Path, rounds: int, seconds: float = 60.0) -> dict:
    """A trainer step's forward+backward and the engine's prefill+decode, each in its own process
    as in the RL loop (`services = "processes"`): alone with every core, then side by side with
    every core each (torch's default) and with the cores split (`RLConfig.trainer_threads`,
    `replica_threads`)."""
    import os
    import subprocess

    folder = smollm2(tmp)
    cpus = len(os.sched_getaffinity(0))
    half = max(1, cpus // 2)

    def run(sides: dict[str, int]) -> dict[str, float]:
        sync = Path(tempfile.mkdtemp(dir=tmp))
        procs = {role: subprocess.Popen([sys.executable, __file__, "--worker", role, "--threads", str(n),
                                         "--seconds", str(seconds), "--folder", str(folder), "--sync", str(sync)],
                                        stdout=subprocess.PIPE, text=True) for role, n in sides.items()}
        deadline = time.monotonic() + 600
        while not all((sync / f"{r}.ready").exists() for r in sides):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), "a worker died"
            time.sleep(0.1)
        (sync / "go").touch()
        return {r: json.loads(p.communicate(timeout=seconds + 600)[0].strip().splitlines()[-1])["tokens_per_s"]
                for r, p in procs.items()}

    variants = {"alone": None, f"side by side, {cpus} + {cpus} threads": (cpus, cpus),
                f"side by side, {half} + {max(1, cpus - half)} threads": (half, max(1, cpus - half))}
    res: dict[str, dict[str, list[float]]] = {v: {"train": [], "decode": []} for v in variants}
    for _ in range(rounds):
        for v, split in variants.items():
            if split is None:
                for role in ("train", "decode"):
                    res[v][role] += [run({role: cpus})[role]]
            else:
                r = run({"train": split[0], "decode": split[1]})
                for role in r:
                    res[v][role].append(r[role])
    out = {"cpus": cpus, "seconds": seconds, "rounds": rounds,
           "tokens_per_s": {v: {r: statistics.median(x) for r, x in d.items()} for v, d in res.items()},
           "per_round": res}
    over, split = list(variants)[1:]
    out["ratio"] = {r: out["tokens_per_s"][split][r] / out["tokens_per_s"][over][r] for r in ("train", "decode")}
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


def part_pipeline(tmp: Path, steps: int, rounds: int) -> dict:
    from opencomposer.core.metrics import read_jsonl
    from opencomposer.rl import loop
    from opencomposer.rl.events import read_events
    from opencomposer.rl.stage import staleness
    from tests.integration.rl_family import build_family
    from tests.integration.test_rl_loop import LR, config

    family = build_family(tmp / "family")
    real = loop.run_rollout

    def delayed(task, sample, *a, **kw):
        time.sleep(pareto_delay(sample.id, sample.index))
        return real(task, sample, *a, **kw)

    loop.run_rollout = delayed
    runs: dict[str, list[dict]] = {"async": [], "sync": []}
    try:
        for r in range(rounds):  # the two modes alternate, so the machine's drift falls on both
            for name, kw in (("async", {"max_inflight_groups": 2, "sync": False}), ("sync", {"sync": True})):
                # threads: the Pareto delay is patched into this process's rollout function. The RL
                # test's learning rate and seeds: at it the tiny model learns in the test's 12 steps
                cfg = dataclasses.replace(config(family, lr=LR, steps=steps), workers=8, eval_every=0,
                                          services="threads", **kw)
                d = tmp / f"{name}-{r}"
                summary = loop.Run(cfg, d).run()
                ev = read_events(d / "events.jsonl")
                start = next(e["t"] for e in ev if e["kind"] == "queued")  # after the held-out eval at the start
                last = max(e["t"] for e in ev if e["kind"] == "step")
                trained = sum(1 for e in ev if e["kind"] == "trained")
                runs[name].append({"samples_per_min": trained / ((last - start) / 60), "seconds": last - start,
                                   "trained": trained, "final_pass_rate": summary["eval_end"]["accuracy"],
                                   "start_pass_rate": summary["eval_start"]["accuracy"],
                                   "staleness": staleness(list(read_jsonl(d / "metrics.jsonl")))})
                print(name, r, json.dumps(runs[name][-1], default=str), flush=True)
    finally:
        loop.run_rollout = real
    out: dict = {"steps": steps, "rounds": rounds, "runs": runs}
    for name, rs in runs.items():
        out[name] = {k: statistics.median(x[k] for x in rs)
                     for k in ("samples_per_min", "seconds", "start_pass_rate", "final_pass_rate")}
        out[name]["staleness"] = {v: sum(x["staleness"].get(v, 0) for x in rs)
                                  for v in sorted({v for x in rs for v in x["staleness"]}, key=int)}
    out["ratios"] = [a["samples_per_min"] / s["samples_per_min"] for a, s in zip(runs["async"], runs["sync"],
                                                                                   strict=True)]
    out["ratio"] = statistics.median(out["ratios"])
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
                  f"| shared prompt once, each suffix's attention over zero-padded queries | "
                  f"{s['shared prompt, suffix attention over padded queries']:.1f} |",
                  "", f"Shared prompt against every rollout: **{t['ratio']:.2f}x** (exact: tests/unit/"
                  f"test_shared_prompt.py). Products on {t['backend']} (`model/linear.py`) against aten: "
                  f"**{t['ratio_backend']:.2f}x**. A suffix's attention on SDPA's fused kernel with its "
                  f"lower-right mask (`model/cache.py`) against padding its queries to a causal square: "
                  f"**{t['ratio_mask']:.2f}x**.", ""]
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
        lines += [(f"**Asynchronous against synchronous** (tiny task family, Pareto-delayed rollouts, {p['steps']} "
                   f"steps a run, {p['rounds']} rounds alternating the two modes; medians; see the script):"),
                  "", ("| | samples trained / min | seconds | held-out pass rate start -> end | staleness "
                       "(versions: tokens, all rounds) |"), "|---|---|---|---|---|"]
        for k in ("async", "sync"):
            r = p[k]
            st = ", ".join(f"{a}: {b}" for a, b in r["staleness"].items())
            lines.append(f"| {k} | {r['samples_per_min']:.1f} | {r['seconds']:.0f} | {r['start_pass_rate']:.0%} -> "
                         f"{r['final_pass_rate']:.0%} | {st} |")
        per_round = "; ".join(
            f"{ra:.2f}x ({a['start_pass_rate']:.0%} -> {a['final_pass_rate']:.0%} against "
            f"{s['start_pass_rate']:.0%} -> {s['final_pass_rate']:.0%})"
            for ra, a, s in zip(p["ratios"], p["runs"]["async"], p["runs"]["sync"], strict=True))
        moved = any(x["final_pass_rate"] != x["start_pass_rate"] for rs in p["runs"].values() for x in rs)
        reward = ("" if moved else " The reward did not move in any run, so equal final reward is only trivial here.")
        lines += ["", (f"Ratio: **{p['ratio']:.2f}x** samples per minute, median of the rounds (goal 1.5x at equal "
                       f"final reward; the held-out pass rates are of 16 samples each). Per round, the ratio and the "
                       f"held-out start -> end, async against sync: {per_round}.{reward}"), ""]
    if "threads" in res:
        t = res["threads"]
        tps = t["tokens_per_s"]
        lines += [f"**Trainer and replica on the same {t['cpus']} cores** (SmolLM2-135M, two processes as in the RL "
                  f"loop, {t['seconds']:.0f} s each way a round, {t['rounds']} rounds): the trainer steps on a G = 4 "
                  "group of 600-token rollouts after the harness prompt (forward + backward, tokens per second of prompt and "
                  "completions); the engine prefills 8 prompts of 1,000 random tokens and decodes 64 tokens "
                  "each (generated tokens per second, prefill time included).", "",
                  "| | trainer tokens / s | engine tokens / s |", "|---|---|---|"]
        lines += [f"| {v} | {d['train']:.0f} | {d['decode']:.1f} |" for v, d in tps.items()]
        rounds = "; ".join(f"{v}: " + ", ".join(f"{a:.0f}/{b:.1f}" for a, b in zip(d["train"], d["decode"],
                                                                                  strict=True))
                           for v, d in t["per_round"].items())
        lines += ["", f"Cores split against every core each: trainer **{t['ratio']['train']:.2f}x**, engine "
                  f"**{t['ratio']['decode']:.2f}x** (medians). The split is what `RLConfig.trainer_threads` and "
                  "`replica_threads` default to with `services = \"processes\"`. Per round (trainer/engine): "
                  f"{rounds}.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", help="all, or a comma-separated list of train, sync, pipeline, threads")
    ap.add_argument("--steps", type=int, default=12, help="pipeline: steps a run (the RL test's 12)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the record")
    ap.add_argument("--seconds", type=float, default=60.0, help="threads: seconds each side runs a round")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # part_threads' own processes
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--sync", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _threads_worker(args.worker, args.threads, args.seconds, args.folder, args.sync)
        return 0
    parts = ["train", "sync", "pipeline", "threads"] if args.part == "all" else args.part.split(",")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in parts:
            d = Path(tmp) / p
            d.mkdir()
            res[p] = {"train": lambda: part_train(d, args.rounds), "sync": lambda: part_sync(d, args.rounds),
                      "pipeline": lambda: part_pipeline(d, args.steps, args.rounds),
                      "threads": lambda: part_threads(d, args.rounds, args.seconds)}[p]()
            print(json.dumps(res[p], indent=1, default=str), flush=True)
    for p in parts:  # one section per part, so parts can be measured in separate invocations
        md = markdown({p: res[p]}, f"benchmarks/rl.py --part {p}" + f" --rounds {args.rounds}"
                      + (f" --steps {args.steps}" if p == "pipeline" else "")
                      + (f" --seconds {args.seconds:g}" if p == "threads" else ""), args.note)
        write_section(ROOT / "docs" / "benchmarks.md", f"rl-{p}", md)
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
