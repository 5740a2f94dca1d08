"""Rollout throughput on real agent episodes: our server with the prefix cache on and off, against
plain `transformers` generate re-prefilling every turn; and raw decode against `transformers` and
against this machine's roofline, measured in the same run.

    .venv/bin/python benchmarks/rollouts.py [--part all|episodes|decode|context] [--rounds 3] [--episodes 8]
                                            [--concurrency 4] [--turn-tokens 32]
                                            # writes "rollouts" (episodes), "rollouts-decode" and
                                            # "rollouts-context" in docs/benchmarks.md

Episodes: the bundled benchmark's tasks (colorsys and graphlib bug fixes), the harness's default
tool set and system prompt, real sandboxes, graded at the end. The base model stops after a turn,
so each episode follows the task's demonstration (`evals/demonstration.py`: grep, read, edit,
compile, answer — five turns): every turn the harness sends the conversation so far to the policy
under test, which generates up to --turn-tokens tokens (greedy; measured, then discarded), and the
demonstration's turn is what the harness executes. What each policy sees is therefore exactly what
the harness sends, and the same for every policy (`no model` calls none):
- `cache on` / `cache off`: SmolLM2-135M behind our server (the official `openai` client through
  `OpenAIPolicy`), --concurrency episodes in flight, prefix cache on or off; `cache on, shared
  prefix off`: the cache on, but each decoding row reads the system prompt from its own slot
  (`EngineConfig.shared_prefix_attention` false);
- `transformers`: the same rendering (our ChatRenderer, so the same prompt ids) fed to
  `AutoModelForCausalLM.generate` one request at a time (what a user of plain transformers gets;
  its episodes still run --concurrency at a time, so sandbox work overlaps);
- `no model`: the demonstration's turns with no policy called: the harness, sandboxes and grading
  alone, the floor under every other row.
The engine's own clock (prefill and decode seconds, `Engine.stats`) says how much of a served
run's wall time the model took.

Decode: B prompts of 64 random tokens, 32 greedy tokens each; decode tok/s counts the tokens after
the first (prefill excluded) for our engine as it serves (decode steps of 1-32 rows one C++ call a
layer, `kernels/decode_layer.py`, its products on the decode kernel, `kernels/decode_products.py`,
in 16 lanes on a CPU with AVX-512, and at 9-32 rows on its AMX form, the head too, on a CPU with
AMX-BF16; the head otherwise and prefill on oneDNN; q/k/v and gate/up fused, weights packed:
`model/linear.py`), on a CPU with AMX-BF16 the same engine without the AMX form, on a CPU with
AVX-512 the same engine on the kernel's 8-lane (AVX2) form, the same engine with the eager layers
(each layer's ~130 torch calls; products still on the decode kernel up to 8 rows, 32 on the AMX
form), the same engine with every product on oneDNN, the same engine with plain
products (not fused, not packed, no decode kernel: oneDNN), the same engine on aten's `F.linear`
(MKL here), and transformers. The bound: a decode step must read every weight once plus the batch's KV, and do 2
FLOPs per weight per row; with the memory bandwidth (a float32 sum over 512 MB) and FLOP/s (the
faster of aten's and oneDNN's 2048^3 float32 product) measured here, bound = B / max(bytes /
bandwidth, flops / FLOP/s).

Context: decode where agent episodes decode, B rows of 1,600-token prompts whose first 1,200 tokens
are one shared prefix (the system prompt and tool schemas every request of an episode starts with;
random tokens here), cached by one request before the batch arrives, as the server has it after an
episode's first turn. Our engine with shared-prefix attention on (the prefix read once per step for
all rows: `EngineConfig.shared_prefix_attention`) and off (each row reads its own copy), shared on
without the fused layer's prefetch of the next attention task's keys and values, and transformers
on the same prompts (its cached one-token forwards timed directly: `hf_decode_cached`); the bound
as above with every row's KV read (the conventional decode bound; reading the shared prefix once
moves the true floor lower).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from corpus import cpu_summary, timed, write_section

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32)


def machine_bound() -> tuple[float, float]:
    """(bytes/s of a streaming read, float32 matmul FLOP/s) on the current torch threads; the
    FLOP/s of the faster of aten's (MKL) and oneDNN's product, since the bound is what the machine
    can do, not what one library does."""
    from opencomposer.model.linear import times_t

    x = torch.randn(128 * 1024 * 1024)
    bw = x.numel() * 4 / timed(lambda: x.sum(), 5)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    fl = 2 * 2048 ** 3 / min(timed(lambda: a @ b, 5), timed(lambda: times_t(a, b), 5))
    return bw, fl


# -- decode -------------------------------------------------------------------------------------------
def ours_decode(model, prompts: torch.Tensor, new: int, prepared: bool = True, shared: int = 0,
                share: bool = True, kernel: bool = True) -> float:
    """Decode seconds for the tokens after the first; with `shared`, one request of the prompts'
    first `shared` tokens is served first, so that the batch finds them in the prefix cache."""
    from opencomposer.inference.engine import Engine, EngineConfig
    from opencomposer.inference.sampling import SamplingParams

    engine = Engine(model, config=EngineConfig(slots=prompts.shape[0], max_len=prompts.shape[1] + new + 1,
                                               fuse_products=prepared, pack_weights=prepared,
                                               decode_kernel=prepared and kernel,
                                               shared_prefix_attention=share))
    if shared:
        engine.generate(prompts[0, :shared].tolist() + [0], SamplingParams(temperature=0.0, max_tokens=1))
    seqs = [engine.submit(p.tolist(), SamplingParams(temperature=0.0, max_tokens=new))[0] for p in prompts]
    engine.step()  # prefill + the first token
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    assert all(len(s.tokens) == new for s in seqs)
    return time.perf_counter() - t


def hf_decode(model, prompts: torch.Tensor, new: int) -> float:
    def gen(n):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t
    return max(gen(new) - gen(1), 1e-9)


def hf_decode_cached(model, prompts: torch.Tensor, new: int) -> float:
    """transformers' decode with its KV cache, timed directly: one prefill forward (not timed), then
    `new - 1` greedy one-token forwards over `past_key_values`, the loop `generate` runs. At a long
    context `hf_decode`'s difference of two `generate` calls is mostly prefill, and in a first run
    here it scattered by 2-3x between rounds."""
    with torch.no_grad():
        out = model(prompts, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(new - 1):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t


def decode_section(folder: Path, rounds: int, bw: float, fl: float) -> list[str]:
    import transformers

    from opencomposer.kernels import decode_layer
    from opencomposer.model import linear
    from opencomposer.model.hf import load_model

    mine = load_model(folder).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    cfg = mine.config
    params = sum(p.numel() for p in mine.parameters())  # tied head: the embedding is read once, as the head
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    new, plen = 32, 64
    from opencomposer.kernels import decode_products

    # On a CPU with AVX-512 the kernel runs in 16 lanes; `ours, 8 lanes` is the same engine on its AVX2 kernel
    # (without the AMX form, as on a CPU with AVX2 only). Where the AMX form runs (9-32 rows), `ours, no AMX` is
    # the same engine without it.
    wide, amx = decode_products.set_wide(), decode_products.set_amx()
    impls = ("ours",) + (("ours, no AMX",) if amx else ()) + (("ours, 8 lanes",) if wide else ()) + (
        "ours, eager layers", "ours on oneDNN", "ours plain", "ours on aten", "transformers")
    res = {(impl, b): [] for impl in impls for b in BATCHES}

    def ours(p, backend, prepared=True, kernel=True, fused=True, lanes16=True, tiles=True):
        before, fused_before = linear.set_backend(backend), decode_layer.set_enabled(fused)
        wide_before = decode_products.set_wide(lanes16 and wide)
        amx_before = decode_products.set_amx(tiles and amx)
        try:
            return ours_decode(mine, p, new, prepared, kernel=kernel)
        finally:
            linear.set_backend(before)
            decode_layer.set_enabled(fused_before)
            decode_products.set_wide(wide_before)
            decode_products.set_amx(amx_before)

    for r in range(rounds):
        g = torch.Generator().manual_seed(r)
        for b in BATCHES:
            prompts = torch.randint(0, cfg.vocab_size, (b, plen), generator=g)
            order = [("ours", lambda p=prompts: ours(p, "onednn")),
                     *([("ours, no AMX", lambda p=prompts: ours(p, "onednn", tiles=False))] if amx else []),
                     *([("ours, 8 lanes", lambda p=prompts: ours(p, "onednn", lanes16=False, tiles=False))]
                       if wide else []),
                     ("ours, eager layers", lambda p=prompts: ours(p, "onednn", fused=False)),
                     ("ours on oneDNN", lambda p=prompts: ours(p, "onednn", kernel=False)),
                     ("ours plain", lambda p=prompts: ours(p, "onednn", prepared=False)),
                     ("ours on aten", lambda p=prompts: ours(p, "aten", fused=False)),
                     ("transformers", lambda p=prompts: hf_decode(ref, p, new))]
            for impl, fn in order if r % 2 == 0 else order[::-1]:
                res[(impl, b)].append(b * (new - 1) / fn())
                print("decode", impl, b, f"{res[(impl, b)][-1]:.1f} tok/s", flush=True)
    form = "16 lanes (AVX-512)" if wide else "8 lanes (AVX2)"
    kernel = ("its decode steps one C++ call a layer (`kernels/decode_layer.py`, its products on the decode kernel "
              f"of `kernels/decode_products.py`, {form}"
              + (", at 9-32 rows its AMX form, the head too" if amx else "") + "), "
              + ("the head of 1-8 rows and prefill on oneDNN" if amx else "the head and prefill on oneDNN")
              if decode_layer.op() is not None else
              f"oneDNN: the decode kernel was unavailable ({decode_products.unavailable()})")
    lines = [f"`ours` ran {kernel}, q/k/v and gate/up fused and weights packed; "
             + ("`no AMX` is the same engine without the AMX form (`decode_products.set_amx(False)`: 9-32 rows on "
                f"{form}, the head on oneDNN); " if amx else "")
             + ("`8 lanes` is the same engine on the kernel's AVX2 form (`decode_products.set_wide(False)`, no AMX "
                "form); " if wide else "")
             + "`eager layers` is the same engine "
             "with each layer's torch calls (`OPENCOMPOSER_DECODE_LAYER=off`; products of up to 8 rows"
             + (" (32 on the AMX form)" if amx else "") + " still on the decode kernel); `on oneDNN` is "
             f"the same engine without the decode kernel (`EngineConfig.decode_kernel` false: every product on "
             f"{linear.backend()}); `plain` is the same engine with none of the three (`fuse_products`, "
             "`pack_weights` and `decode_kernel` false); `on aten` is the same engine on `F.linear` with eager "
             "layers (where none applies).", "",
             "| batch | " + " | ".join(f"{i} tok/s" for i in impls) + " | "
             + ("ours / no AMX | " if amx else "") + ("ours / 8 lanes | " if wide else "")
             + "ours / eager layers | ours / on oneDNN | ours / transformers | roofline bound tok/s | ours / bound |",
             "|---|" + "---|" * (len(impls) + 4 + int(wide) + int(amx) + 1)]
    for b in BATCHES:
        med = {i: statistics.median(res[(i, b)]) for i in impls}
        o = med["ours"]
        ctx = plen + new // 2
        step = max((params * 4 + b * ctx * kv_per_token) / bw, 2 * params * b / fl)
        bound = b / step
        lines.append(f"| {b} | " + " | ".join(f"{med[i]:.1f}" for i in impls) + " | "
                     + (f"**{o / med['ours, no AMX']:.2f}x** | " if amx else "")
                     + (f"**{o / med['ours, 8 lanes']:.2f}x** | " if wide else "")
                     + f"{o / med['ours, eager layers']:.2f}x | **{o / med['ours on oneDNN']:.2f}x** | "
                     f"**{o / med['transformers']:.2f}x** | {bound:.0f} | **{o / bound:.2f}** |")
    return lines


def context_section(folder: Path, rounds: int, bw: float, fl: float) -> list[str]:
    import transformers

    from opencomposer.kernels import decode_layer
    from opencomposer.model.cache import KVCache
    from opencomposer.model.hf import load_model

    mine = load_model(folder).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    cfg = mine.config
    params = sum(p.numel() for p in mine.parameters())
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    new, plen, shared = 64, 1600, 1200
    impls = ("shared on", "shared off", "shared on, no KV prefetch", "eager layers, shared on", "transformers")
    batches = (4, 8)
    res = {(impl, b): [] for impl in impls for b in batches}
    attn = {b: [] for b in batches}  # seconds in the eager layers' decode attention per step
    spent = [0.0]
    plain_attend = KVCache.decode_attend

    def timed_attend(self, *a, **k):
        t = time.perf_counter()
        try:
            return plain_attend(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    def ours(p, share, fused=True, kv=True):
        spent[0] = 0.0
        KVCache.decode_attend = timed_attend
        fused_before = decode_layer.set_enabled(fused)
        kv_before = decode_layer.set_kv_prefetch(None)
        decode_layer.set_kv_prefetch(kv)
        try:
            secs = ours_decode(mine, p, new, shared=shared, share=share)
        finally:
            KVCache.decode_attend = plain_attend
            decode_layer.set_enabled(fused_before)
            decode_layer.set_kv_prefetch(kv_before)
        if not fused:
            attn[p.shape[0]].append(spent[0] / (new - 1))
        return secs

    for r in range(rounds):
        g = torch.Generator().manual_seed(r)
        for b in batches:
            head = torch.randint(0, cfg.vocab_size, (1, shared), generator=g).expand(b, shared)
            prompts = torch.cat([head, torch.randint(0, cfg.vocab_size, (b, plen - shared), generator=g)], 1)
            order = [("shared on", lambda p=prompts: ours(p, True)),
                     ("shared off", lambda p=prompts: ours(p, False)),
                     ("shared on, no KV prefetch", lambda p=prompts: ours(p, True, kv=False)),
                     ("eager layers, shared on", lambda p=prompts: ours(p, True, fused=False)),
                     ("transformers", lambda p=prompts: hf_decode_cached(ref, p, new))]
            for impl, fn in order if r % 2 == 0 else order[::-1]:
                res[(impl, b)].append(b * (new - 1) / fn())
                print("context", impl, b, f"{res[(impl, b)][-1]:.1f} tok/s", flush=True)
    lines = ["`shared on` / `off`: our engine as it serves (decode steps one C++ call a layer, "
             "`kernels/decode_layer.py`), the shared prefix read from one slot for every row that shares it, or each "
             "row reading its own copy; `no KV prefetch`: shared on, without the attention's prefetch of the next "
             "task's keys and values (`decode_layer.set_kv_prefetch(False)`); `eager layers, shared on`: the "
             "same engine with each layer's torch calls (`OPENCOMPOSER_DECODE_LAYER=off`) and cascade attention over "
             "the shared prefix (`KVCache.decode_attend`).",
             "",
             "| batch | shared on tok/s | shared off tok/s | no KV prefetch tok/s | eager layers, shared on tok/s "
             "| transformers tok/s | on / off | on / no KV prefetch | on / eager layers | on / transformers "
             "| roofline bound tok/s | on / bound | eager layers: attention ms a step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in batches:
        on, off, nopf, eager, h = (statistics.median(res[(i, b)]) for i in impls)
        ctx = plen + new // 2
        bound = b / max((params * 4 + b * ctx * kv_per_token) / bw, 2 * params * b / fl)
        lines.append(f"| {b} | {on:.1f} | {off:.1f} | {nopf:.1f} | {eager:.1f} | {h:.1f} | **{on / off:.2f}x** | "
                     f"**{on / nopf:.2f}x** | {on / eager:.2f}x | **{on / h:.2f}x** | {bound:.0f} | "
                     f"**{on / bound:.2f}** | {statistics.median(attn[b]) * 1e3:.1f} |")
    lines += ["", "Attention: the seconds inside `KVCache.decode_attend` (the cache write and attention over it, all "
              "layers) per decode step of the eager arm, timed around each call (the fused layer does both inside its "
              "one call, so it has no such split)."]
    return lines


# -- episodes -----------------------------------------------------------------------------------------
class ReplayWithGeneration:
    """Each turn: the conversation goes to `generate` (the policy under test; its output is timed
    and discarded), and the demonstration's next turn is returned to the harness."""

    def __init__(self, task, generate, name: str):
        from opencomposer.evals.demonstration import demonstration_policy

        self.demo = demonstration_policy(task)
        self.generate = generate
        self.name = name

    def complete(self, messages, tools):
        self.generate(messages, tools)
        return self.demo.complete(messages, tools)


def run_episodes(tasks: Path, factory, args, out: Path) -> tuple[float, dict]:
    from opencomposer.evals.runner import EvalConfig, run_eval

    t = time.perf_counter()
    summary = run_eval(EvalConfig(tasks=tasks, passes=1, concurrency=args.concurrency, max_tasks=args.episodes),
                       factory, out)
    return time.perf_counter() - t, summary


def served(folder: Path, tasks: Path, cache: bool, args, out: Path, shared: bool = True) -> dict:
    from opencomposer.harness.openai_policy import OpenAIPolicy
    from opencomposer.inference.server import ServeConfig, Server, load_served

    engine, tok = load_served(folder, slots=max(4, args.concurrency), max_len=8192,
                              prefix_cache_mb=2048 if cache else 0, shared_prefix_attention=shared)
    with Server(engine, tok, "smol", ServeConfig(port=0)) as srv:
        pol = OpenAIPolicy(base_url=srv.url, model="smol", temperature=0.0, max_tokens=args.turn_tokens,
                           timeout_s=1800)
        secs, summary = run_episodes(tasks, lambda task, k=0: ReplayWithGeneration(task, pol.complete, "served"),
                                     args, out)
        st = dict(engine.stats)
    return {"seconds": secs, "episodes": summary["episodes"], "accuracy": summary["accuracy"],
            "prefill": st["prompt_tokens"], "cached": st["cached_prompt_tokens"], "generated": st["generated_tokens"],
            "requests": st["requests"], "prefill_s": st["prefill_seconds"], "decode_s": st["decode_seconds"]}


def no_policy(tasks: Path, args, out: Path) -> dict:
    """The same episodes with no model behind them (the demonstration's turns alone): what the
    harness, the sandboxes and grading cost by themselves."""
    secs, summary = run_episodes(tasks, lambda task, k=0: ReplayWithGeneration(task, lambda m, t: None, "none"),
                                 args, out)
    return {"seconds": secs, "episodes": summary["episodes"], "accuracy": summary["accuracy"], "cached": 0,
            "prefill": 0, "generated": 0, "requests": 0}


def transformers_run(folder: Path, tasks: Path, args, out: Path) -> dict:
    import transformers

    from opencomposer.tokenizer.bpe import Tokenizer
    from opencomposer.tokenizer.chat import ChatRenderer

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = Tokenizer.load(folder)
    renderer = ChatRenderer(tok)
    lock = threading.Lock()
    counts = {"prefill": 0, "generated": 0, "requests": 0}

    def generate(messages, tools):
        ids = renderer.encode(messages, tools or None, add_generation_prompt=True).ids
        x = torch.tensor([ids])
        with lock, torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.turn_tokens, do_sample=False,
                               eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
            counts["prefill"] += len(ids)
            counts["generated"] += y.shape[1] - len(ids)
            counts["requests"] += 1

    secs, summary = run_episodes(tasks, lambda task, k=0: ReplayWithGeneration(task, generate, "transformers"),
                                 args, out)
    return {"seconds": secs, "episodes": summary["episodes"], "accuracy": summary["accuracy"], "cached": 0, **counts}


def episodes_section(folder: Path, tmp: Path, args) -> list[str]:
    from opencomposer.tasks.builders.deletion import BuildConfig
    from opencomposer.tasks.default import DefaultBenchmarkConfig, build_default

    tasks = tmp / "tasks"
    build_default(tasks, DefaultBenchmarkConfig(sources=("colorsys", "graphlib"),
                                                build=BuildConfig(max_single=4, max_multi=0)))
    modes = ["cache on", "cache on, shared prefix off", "cache off"] + \
        ([] if args.skip_transformers else ["transformers"]) + ["no model"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            out = tmp / f"run-{r}-{m.replace(' ', '-')}"
            res = transformers_run(folder, tasks, args, out) if m == "transformers" else \
                no_policy(tasks, args, out) if m == "no model" else \
                served(folder, tasks, m != "cache off", args, out, shared=m == "cache on")
            runs[m].append(res)
            print(m, r, {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}, flush=True)
    eps = {m: statistics.median(x["episodes"] * 60 / x["seconds"] for x in v) for m, v in runs.items()}
    n = runs["cache on"][0]["episodes"]
    lines = [f"{n} episodes of the bundled benchmark (five harness turns each: grep, read, edit, compile, answer, "
             f"from each task's demonstration), {args.concurrency} in flight, SmolLM2-135M float32, up to "
             f"{args.turn_tokens} greedy tokens per turn, {args.rounds} alternating rounds, medians.", "",
             "| policy | episodes / min | prompt tokens prefilled per episode | served from cache | tokens generated "
             "per episode | engine prefill / decode, share of the wall time | graded pass rate |",
             "|---|---|---|---|---|---|---|"]
    for m, v in runs.items():
        pre = statistics.median(x["prefill"] / x["episodes"] for x in v)
        cached = statistics.median(x["cached"] / max(1, x["cached"] + x["prefill"]) for x in v)
        gen = statistics.median(x["generated"] / x["episodes"] for x in v)
        acc = statistics.median(x["accuracy"] for x in v)
        split = "n/a"  # transformers and the run with no model have no engine
        if "prefill_s" in v[0]:
            split = (f"{statistics.median(x['prefill_s'] / x['seconds'] for x in v):.0%} / "
                     f"{statistics.median(x['decode_s'] / x['seconds'] for x in v):.0%}")
        lines.append(f"| {m} | {eps[m]:.2f} | {pre:.0f} | {cached:.0%} | {gen:.0f} | {split} | {acc:.0%} |")
    lines += ["", f"Cache on / cache off: **{eps['cache on'] / eps['cache off']:.2f}x** episodes per minute (goal: 3x); "
              f"shared-prefix decode attention on / off, both with the cache: "
              f"**{eps['cache on'] / eps['cache on, shared prefix off']:.2f}x**"
              + (f"; cache on / transformers: **{eps['cache on'] / eps['transformers']:.2f}x**."
                 if "transformers" in eps else ".")]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("all", "episodes", "decode", "context"), default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true", help="episodes: only cache on/off")
    args = ap.parse_args()
    import transformers

    from opencomposer.model.interop import import_default

    transformers.logging.set_verbosity_error()
    cmd = " ".join([".venv/bin/python benchmarks/rollouts.py", *sys.argv[1:]])
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="oc-bench-rollouts-") as tmp:
        tmp = Path(tmp)
        folder = import_default(tmp / "smol")
        if args.part in ("all", "episodes"):
            body = episodes_section(folder, tmp, args)
            md = "\n".join(["## Rollout throughput on agent episodes (`benchmarks/rollouts.py --part episodes`)", "",
                            f"Reproduce: `{cmd}` ({threads} torch threads).", "", *body])
            print(md)
            write_section(ROOT / "docs" / "benchmarks.md", "rollouts", md)
        if args.part in ("all", "decode", "context"):
            bw, fl = machine_bound()
            print(f"machine: {bw / 1e9:.1f} GB/s streaming read, {fl / 1e9:.0f} GFLOP/s float32 matmul "
                  f"({threads} threads)", flush=True)
        if args.part in ("all", "decode"):
            body = decode_section(folder, args.rounds, bw, fl)
            md = "\n".join(["## Decode against transformers and the roofline (`benchmarks/rollouts.py --part decode`)",
                            "", f"Reproduce: `{cmd}` — SmolLM2-135M float32, 64-token prompts, 32 greedy tokens, prefill "
                            f"excluded, {args.rounds} alternating rounds, medians; {threads} torch threads on {cpu_summary()}. "
                            f"This machine measured {bw / 1e9:.1f} GB/s streaming read and {fl / 1e9:.0f} GFLOP/s float32 matmul in "
                            "the same run.", "", *body])
            print(md)
            write_section(ROOT / "docs" / "benchmarks.md", "rollouts-decode", md)
        if args.part in ("all", "context"):
            body = context_section(folder, args.rounds, bw, fl)
            md = "\n".join(["## Decode at an agent's context (`benchmarks/rollouts.py --part context`)", "",
                            f"Reproduce: `{cmd}` — SmolLM2-135M float32, 1,600-token prompts whose first 1,200 "
                            "tokens are one prefix, cached before the batch arrives; 64 greedy tokens, prefill "
                            f"excluded, {args.rounds} alternating rounds, medians; {threads} torch threads on "
                            f"{cpu_summary()}; {bw / 1e9:.1f} GB/s and {fl / 1e9:.0f} GFLOP/s measured in the same run.",
                            "", *body])
            print(md)
            write_section(ROOT / "docs" / "benchmarks.md", "rollouts-context", md)


if __name__ == "__main__":
    main()
