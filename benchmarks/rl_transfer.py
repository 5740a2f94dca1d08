"""Does an RL run's update on its train groups point toward passing the held-out tasks?

Reads a speedrun folder (after its `rl` stage) and asks, at the SFT weights the RL stage started
from, what the run's own data says, with no new rollout:

- G_ho: the gradient of the held-out policy-gradient objective J_ho = sum_i A_i sum_t log p(y_t),
  A_i = passed_i - mean over the task's K episodes, over `agent_sft`'s seeded held-out episodes
  (sampled by the SFT model at the eval's temperature: on-policy), over the tasks where some but
  not all episodes passed. How much held-out tasks agree among themselves: each task's gradient
  against the sum of the others' (the same comparison a train group gets against G_ho), and the
  tasks split in two halves A and B, cos(G_A, G_B).
- g_k: the gradient of each trained RL group's objective (its rewards, the group-mean baseline, the
  run's `negative_advantages`, `failed_call_credit` and `failed_call_blame`; a run's `token_mean`
  baseline and importance weights are not replayed), in the run's order, at the same weights (first order: it
  ignores that the real run's weights moved between groups). Cosines do not depend on the constant
  normaliser (4096 here, the default).
- For each optimiser, the update it would have made from g_1..g_K (Adam at the run's betas and
  several eps, signSGD, SGD), its cosine with G_ho (transfer, first order) and its predicted
  dJ_ho per unit of update norm.
- Second order, measured (Adam at eps 1e-8 and 1e-4, and SGD): the weights moved along each
  update, scaled to the same norm, then
  J_ho and the held-out sampled tokens' log-probabilities computed again (forward only), so a
  direction's cost to what the SFT model does on held-out tasks shows beside its first-order gain.

- With `--call-advantage C` (or a run trained with `call_advantage`): each group's per-call term
  (`ObjectiveConfig.call_advantage`, every tool call's verdict against the group's calls of the same
  tool) replayed apart, its gradient's cosine with G_ho beside the outcome term's, over every group
  with a nonzero call term (also those that passed nothing), and the summed call, outcome and
  combined directions against G_ho. The optimiser replay and second-order checks stay on the
  outcome term.

    .venv/bin/python benchmarks/rl_transfer.py RUN_DIR [--groups N] [--norm 0.1] [--call-advantage 0.5] [--no-second-order]

Writes RUN_DIR/rl_transfer/{grads.npy (one row of 135M float32 per group for SmolLM2-135M: 540 MB
each), summary.json}. CPU, float32. On a 2-core AVX-512 host, for the default speedrun: ~5 min for
the held-out gradients (~8,300 trained tokens), ~50 s a train group, ~1.5 min a second-order check.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from opencomposer.core.metrics import read_jsonl
from opencomposer.harness.trajectory import Trajectory
from opencomposer.model.hf import load_model
from opencomposer.rl.forward import sequence_logprobs
from opencomposer.rl.objective import group_advantages
from opencomposer.rl.rollout import Sample
from opencomposer.rl.sequences import build_sequences
from opencomposer.rl.trainer import call_terms

NORMALIZER = 4096.0
CHECKPOINT = 1024


def held_out_groups(run: Path) -> list[list[tuple[float, list]]]:
    """Per held-out task with mixed outcomes: [(passed, sequences)] of agent_sft's episodes."""
    out = run / "agent_sft"
    by_task: dict[str, list] = {}
    for r in read_jsonl(out / "results.jsonl"):
        if r["status"] in ("infra_error", "interrupted"):
            continue
        traj = Trajectory.load(out / "trajectories" / f"{r['task']}.{r['pass']}.json")
        seqs, _ = build_sequences(traj)
        by_task.setdefault(r["task"], []).append((float(r["passed"]), seqs))
    return [eps for _, eps in sorted(by_task.items()) if len({p for p, _ in eps}) > 1]


def train_groups(run: Path, limit: int | None, call_coef: float = 0.0) -> list[tuple[list[float], list[Sample]]]:
    """The run's groups with an outcome gradient (mixed outcomes, nonzero advantages), and with
    `call_coef` also those with a nonzero call term (their outcome advantages 0), in group order."""
    cfg = json.loads((run / "rl" / "config.json").read_text())
    obj = cfg["objective"]
    out = []
    for f in sorted((run / "rl" / "groups").glob("g*.json"), key=lambda p: int(p.stem[1:])):
        samples = [Sample.from_dict(d) for d in json.loads(f.read_text())["samples"]]
        adv, zero = group_advantages([s.reward for s in samples], len(samples), obj.get("negative_advantages", 1.0))
        if zero or (obj.get("unsolved_groups") == "skip" and not any(s.passed for s in samples)):
            if not call_terms(samples, call_coef):
                continue
            adv = [0.0] * len(samples)
        out.append((adv, samples))
        if limit and len(out) >= limit:
            break
    return out


def flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def objective_grad(model, params, items: list[tuple[float, list]], per_call=None,
                   failed: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, int]:
    """d/dθ of sum_i A_i sum_t log p / NORMALIZER over (A_i, sequences); with `per_call` (the
    trainer's `call_terms` of the group, and A_i all 0 for the call term alone) each trained token
    also gets its call's advantage. `failed` = (failed_call_credit, failed_call_blame): the factor on
    a positive / negative A_i on the tokens of calls that broke or failed an edit, as the trainer has it."""
    model.zero_grad(set_to_none=True)
    tokens = 0
    for i, (a, seqs) in enumerate(items):
        calls = (per_call or {}).get(i, {})
        if a == 0.0 and not calls:
            continue
        for seq in seqs:
            if not seq.trained_tokens:
                continue
            scaled = seq.token_factors(failed[0] if a > 0 else failed[1]) if a != 0.0 else None
            adv = a * torch.tensor(scaled) if scaled is not None else torch.tensor(a)
            if calls:
                c = seq.token_call_advantages({ci: x for (g, ci), x in calls.items() if g == seq.segment})
                if c is not None:
                    adv = adv + torch.tensor(c)
            if not bool(adv.any()):
                continue
            logp = sequence_logprobs(model, seq, checkpoint=CHECKPOINT)
            ((adv * logp).sum() / NORMALIZER).backward()  # the ascent direction of +A log p
            tokens += seq.trained_tokens
    g = flat_grad(params)
    model.zero_grad(set_to_none=True)
    return g, tokens


def centred(group: list[tuple[float, list]]) -> list[tuple[float, list]]:
    mean = sum(p for p, _ in group) / len(group)
    return [(p - mean, s) for p, s in group]


@torch.no_grad()
def held_out_logprobs(model, groups) -> list[list[tuple[float, torch.Tensor]]]:
    """Per group, per episode: (passed, the sampled tokens' log-probabilities concatenated)."""
    out = []
    for g in groups:
        out.append([(p, torch.cat([sequence_logprobs(model, s).detach() for s in seqs if s.trained_tokens]))
                    for p, seqs in g])
    return out


def j_value(lps) -> float:
    total = 0.0
    for g in lps:
        mean = sum(p for p, _ in g) / len(g)
        total += sum((p - mean) * float(lp.sum()) for p, lp in g)
    return total / NORMALIZER


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / (float(a.norm()) * float(b.norm()) + 1e-30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--groups", type=int, default=0, help="at most this many trained groups (0: all)")
    ap.add_argument("--norm", type=float, default=0.0,
                    help="the update norm for the second-order check (0: the norm of Adam's, lr as in the run)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-second-order", action="store_true", help="skip the second-order checks")
    ap.add_argument("--call-advantage", type=float, default=None,
                    help="replay the per-call term at this weight (default: the run's `call_advantage`)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = args.run
    work = run / "rl_transfer"
    work.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    rl_cfg = json.loads((run / "rl" / "config.json").read_text())
    lr = float(rl_cfg["trainer"]["lr"])
    betas = tuple(rl_cfg["trainer"].get("betas", (0.9, 0.99)))
    clip = float(rl_cfg["trainer"].get("grad_clip", 1.0))

    model = load_model(run / "sft" / "model")
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)

    ho = held_out_groups(run)
    per_task = []
    for g in ho:
        grad, tok = objective_grad(model, params, centred(g))
        per_task.append((grad, tok))
    g_ho = torch.stack([g for g, _ in per_task]).sum(0)
    half = len(ho) // 2
    g_a = torch.stack([g for g, _ in per_task[:half]]).sum(0)
    g_b = g_ho - g_a
    ho_tokens = sum(t for _, t in per_task)
    # each held-out task against the other held-out tasks: how much one task's gradient says about the rest
    ho_loo = [cos(g, g_ho - g) for g, _ in per_task]
    print(f"held out: {len(ho)} mixed tasks, {ho_tokens} tokens, |G_ho| {float(g_ho.norm()):.3e}, "
          f"cos(G_A, G_B) {cos(g_a, g_b):+.4f}; each task against the others: "
          f"{' '.join(f'{c:+.3f}' for c in ho_loo)}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    del per_task

    failed = (float(rl_cfg["objective"].get("failed_call_credit", 1.0)),
              float(rl_cfg["objective"].get("failed_call_blame", 1.0)))
    call_coef = args.call_advantage if args.call_advantage is not None else \
        float(rl_cfg["objective"].get("call_advantage", 0.0))
    groups = train_groups(run, args.groups or None, call_coef)
    outcome = [(adv, samples) for adv, samples in groups if any(adv)]
    grads = np.lib.format.open_memmap(work / "grads.npy", mode="w+", dtype=np.float32, shape=(len(outcome), n))
    rows = []
    call_rows = []
    sums = {"outcome": torch.zeros(n), "call": torch.zeros(n)}
    for adv, samples in groups:
        items = [(a, s.sequences) for a, s in zip(adv, samples)]
        row = {"group": samples[0].group, "task": samples[0].task, "passed": sum(s.passed for s in samples)}
        if any(adv):
            g, tok = objective_grad(model, params, items, failed=failed)
            norm = float(g.norm())
            if norm > clip:  # the trainer clips the step's gradient norm
                g = g * (clip / norm)
            grads[len(rows)] = g.numpy()
            sums["outcome"] += g
            rows.append({**row, "tokens": tok, "grad_norm": norm, "cos_ho": cos(g, g_ho)})
            print(f"group {row['group']}: {tok} tokens, {row['passed']} of {len(samples)} passed, "
                  f"|g| {norm:.3e}, cos(g, G_ho) {rows[-1]['cos_ho']:+.4f}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        per_call = call_terms(samples, call_coef)
        if per_call:
            gc, tok = objective_grad(model, params, [(0.0, q) for _, q in items], per_call)
            sums["call"] += gc
            calls = [v for c in per_call.values() for v in c.values()]
            call_rows.append({**row, "tokens": tok, "calls": len(calls), "blamed": sum(v < 0 for v in calls),
                              "grad_norm": float(gc.norm()), "cos_ho": cos(gc, g_ho)})
            print(f"group {row['group']} call term: {len(calls)} calls with a term ({call_rows[-1]['blamed']} "
                  f"blamed), |g| {float(gc.norm()):.3e}, cos(g_call, G_ho) {call_rows[-1]['cos_ho']:+.4f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    grads.flush()
    summed = {k: cos(v, g_ho) for k, v in sums.items() if bool(v.any())}
    if call_rows:
        summed["combined"] = cos(sums["outcome"] + sums["call"], g_ho)
        print("summed over groups, cos with G_ho: " + ", ".join(f"{k} {v:+.4f}" for k, v in summed.items()), flush=True)
    del sums
    groups = outcome

    # optimisers replayed over g_1..g_K, one step per group (the run's groups_per_step = 1)
    K = len(groups)
    s = torch.from_numpy(np.asarray(grads)).sum(0)
    loo = [cos(torch.from_numpy(np.asarray(grads[k])), s - torch.from_numpy(np.asarray(grads[k]))) for k in range(K)]
    updates: dict[str, torch.Tensor] = {}
    for eps in (1e-8, 1e-6, 1e-5, 1e-4):
        m = torch.zeros(n)
        v = torch.zeros(n)
        u = torch.zeros(n)
        for k in range(K):
            g = torch.from_numpy(np.asarray(grads[k]))
            m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            mh = m / (1 - betas[0] ** (k + 1))
            vh = v / (1 - betas[1] ** (k + 1))
            u.add_(mh / (vh.sqrt() + eps), alpha=lr)
        updates[f"adam eps {eps:g}"] = u
    updates["signSGD of the sum"] = torch.sign(s)
    updates["SGD (the sum)"] = s.clone()
    ref_norm = args.norm or float(updates["adam eps 1e-08"].norm())
    first = {}
    for name, u in updates.items():
        first[name] = {"norm_as_run": float(u.norm()), "cos_ho": cos(u, g_ho), "cos_A": cos(u, g_a),
                       "cos_B": cos(u, g_b), "dJ_per_norm": float(u @ g_ho) / float(u.norm())}
        print(f"{name:>20}: |u| {float(u.norm()):.3e}  cos(u, G_ho) {first[name]['cos_ho']:+.4f} "
              f"(A {first[name]['cos_A']:+.4f}, B {first[name]['cos_B']:+.4f})", flush=True)

    # second order: move along each direction by the same norm, measure held-out J and log-probs
    base_lps = held_out_logprobs(model, ho)
    j0 = j_value(base_lps)
    flat = torch.nn.utils.parameters_to_vector(params).detach().clone()
    second = {}
    for name, u in updates.items():
        if args.no_second_order or name not in ("adam eps 1e-08", "adam eps 0.0001", "SGD (the sum)"):
            continue
        step = u * (ref_norm / float(u.norm()))
        torch.nn.utils.vector_to_parameters(flat + step, params)
        lps = held_out_logprobs(model, ho)
        d_pass = [float((lp - lp0).mean()) for g, g0 in zip(lps, base_lps) for (p, lp), (_, lp0) in zip(g, g0) if p]
        d_fail = [float((lp - lp0).mean()) for g, g0 in zip(lps, base_lps) for (p, lp), (_, lp0) in zip(g, g0) if not p]
        second[name] = {"norm": ref_norm, "dJ": j_value(lps) - j0, "dJ_first_order": float(step @ g_ho),
                        "dlogp_pass": sum(d_pass) / len(d_pass), "dlogp_fail": sum(d_fail) / len(d_fail)}
        print(f"{name:>20} at |u| {ref_norm:.3e}: dJ_ho {second[name]['dJ']:+.4e} (first order "
              f"{second[name]['dJ_first_order']:+.4e}); mean dlogp a token: passes {second[name]['dlogp_pass']:+.4f}, "
              f"failures {second[name]['dlogp_fail']:+.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    torch.nn.utils.vector_to_parameters(flat, params)
    summary = {"run": str(run), "parameters": n, "lr": lr, "betas": betas, "held_out_tasks": len(ho),
               "held_out_tokens": ho_tokens, "cos_GA_GB": cos(g_a, g_b), "held_out_leave_one_out_cos": ho_loo, "groups": rows,
               "call_advantage": call_coef, "call_groups": call_rows, "summed_cos_ho": summed,
               "leave_one_out_cos": loo, "first_order": first, "second_order": second, "J0": j0,
               "seconds": time.perf_counter() - t0, "random_cos_scale": 1 / math.sqrt(n)}
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
