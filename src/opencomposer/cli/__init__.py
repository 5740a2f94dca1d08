"""The one command-line entry: `opencomposer <command> ...`.

Stage modules are imported lazily inside each command, so `opencomposer sandbox ...` never pays
for torch, and `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys

from opencomposer.cli.models import (
    cmd_eval_base,
    cmd_kernels_check,
    cmd_model_import_default,
    cmd_pretrain,
    cmd_report,
    cmd_rl,
    cmd_serve,
    cmd_sft,
    cmd_speedrun,
    cmd_study_cpt_vs_rl,
)
from opencomposer.cli.sandbox import (
    cmd_agent,
    cmd_sandbox_doctor,
    cmd_sandbox_fork_demo,
    cmd_sandbox_reap,
    cmd_sandbox_run,
)
from opencomposer.cli.tasks import (
    cmd_eval_run,
    cmd_tasks_build_default,
    cmd_tasks_build_git,
    cmd_tasks_import,
    cmd_tasks_validate,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opencomposer", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--debug", action="store_true", help="show tracebacks of user errors too")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("speedrun", help="the recipe on the embedded default (base -> CPT -> SFT -> RL, evaluated "
                                         "before and after) and its report card; resumes an unfinished run")
    sp.add_argument("-c", "--config", help="a TOML recipe of your own (instead of a preset)")
    sp.add_argument("--preset", default="default",
                    help="a recipe in configs/speedrun-<preset>.toml: default (renames of at most two places, "
                         "sized toward an hour on 2 CPU cores), smoke (4.5-11 minutes), renames-small (the "
                         "default's family with more SFT and RL and the lr-0 control), renames (larger renames), "
                         "bugfix (the bug-fix family), gpu-8b (documents the GPU path)")
    sp.add_argument("--fresh", action="store_true", help="start a new run even if an unfinished one exists")
    sp.set_defaults(fn=cmd_speedrun)

    sb = sub.add_parser("sandbox", help="isolated, forkable workspaces").add_subparsers(dest="sub", required=True)
    r = sb.add_parser("run", help="run a command in a sandbox over a workspace directory")
    r.add_argument("--workspace", required=True)
    r.add_argument("--timeout", type=float, default=None, help="seconds (default from config)")
    r.add_argument("-c", "--config", help="TOML with SandboxConfig fields")
    r.add_argument("command", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_sandbox_run)
    f = sb.add_parser("fork-demo", help="show snapshot, fork and restore")
    f.add_argument("--workspace", help="a directory to start from (default: a scratch one)")
    f.add_argument("-c", "--config")
    f.set_defaults(fn=cmd_sandbox_fork_demo)
    d = sb.add_parser("doctor", help="which isolation features this machine supports and enforces")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_sandbox_doctor)
    rp = sb.add_parser("reap", help="remove what crashed owners left behind")
    rp.set_defaults(fn=cmd_sandbox_reap)

    ag = sub.add_parser("agent", help="run the agent on a repository in a sandbox; print (and --apply) its diff")
    ag.add_argument("prompt")
    ag.add_argument("--repo", default=".")
    ag.add_argument("--model", default=None,
                    help="base URL of an OpenAI-compatible server (…/v1) or a model name (with $OPENAI_BASE_URL)")
    ag.add_argument("--model-name", default=None, help="model name at that server (default: its first model)")
    ag.add_argument("--temperature", type=float, default=0.2)
    ag.add_argument("--top-p", type=float, default=1.0)
    ag.add_argument("--max-tokens", type=int, default=4096, help="completion tokens per turn")
    ag.add_argument("--apply", action="store_true", help="apply the resulting diff to --repo")
    ag.add_argument("--out", default="runs", help="where the trajectory is saved")
    ag.add_argument("-c", "--config", help="TOML with AgentConfig fields")
    ag.set_defaults(fn=cmd_agent)

    tk = sub.add_parser("tasks", help="build and validate tasks").add_subparsers(dest="sub", required=True)
    bd = tk.add_parser("build-default", help="build the bundled benchmark from this Python's stdlib and its tests")
    bd.add_argument("--out", help="default: $OPENCOMPOSER_DATA/tasks/default (data/ by default)")
    bd.add_argument("--sources", help="comma-separated subset, e.g. json,textwrap")
    bd.add_argument("--max-single", type=int, default=8)
    bd.add_argument("--max-multi", type=int, default=3)
    bd.set_defaults(fn=cmd_tasks_build_default)
    bg = tk.add_parser("build-git", help="tasks from commits that change code together with tests")
    bg.add_argument("--repo", required=True)
    bg.add_argument("--out", required=True)
    bg.add_argument("--max-commits", type=int, default=200)
    bg.add_argument("--max-tasks", type=int, default=20)
    bg.add_argument("--model", help="rewrite prompts with this model (URL or name); default: commit subjects")
    bg.set_defaults(fn=cmd_tasks_build_git)
    im = tk.add_parser("import", help="import Harbor/Terminal-Bench folders, SWE-bench instances, SWE-smith mirrors")
    im.add_argument("kind", choices=["harbor", "swebench", "swesmith"])
    im.add_argument("sources", nargs="+", help="harbor: task folders; swebench: the repo checkout; swesmith: the mirror")
    im.add_argument("--instances", help="published instances: JSONL or a JSON array (swebench, swesmith)")
    im.add_argument("--workdir", help="absolute path the tests expect (swebench, swesmith; default /testbed)")
    im.add_argument("--env", action="append", metavar="K=V", help="environment variable for agent and verifier")
    im.add_argument("--setup", action="append", metavar="CMD", help="command run before the agent and grading")
    im.add_argument("--test-cmd", metavar="CMD", help="verifier command ({junit}: report path, {tests}: test files)")
    im.add_argument("--requirement", action="append", metavar="REQ",
                    help="package for the task environment (default: the repository's declared dependencies)")
    im.add_argument("--derive-tests", action="store_true",
                    help="swesmith: derive FAIL_TO_PASS/PASS_TO_PASS by running the suite at both revisions")
    im.add_argument("--main", help="swesmith: the mirror's clean branch (default main, else master)")
    im.add_argument("--keep-rejected", action="store_true", help="keep rejected tasks in OUT/.rejected")
    im.add_argument("-c", "--config", help="TOML with ImportConfig fields (workdir, env, setup, test_cmd, ...)")
    im.add_argument("--out", required=True)
    im.set_defaults(fn=cmd_tasks_import)
    va = tk.add_parser("validate", help="run the integrity gates on tasks or datasets")
    va.add_argument("dirs", nargs="+")
    va.add_argument("--static", action="store_true", help="skip the gates that run tests")
    va.set_defaults(fn=cmd_tasks_validate)

    ev = sub.add_parser("eval", help="benchmarks").add_subparsers(dest="sub", required=True)
    er = ev.add_parser("run", help="run the harness on every task and grade it")
    er.add_argument("--tasks", default="default", help="dataset folder, a task folder, or 'default'")
    er.add_argument("--model", required=True, help="oracle, noop, demonstration, a base URL (…/v1) or a model name")
    er.add_argument("--model-name")
    er.add_argument("--split")
    er.add_argument("--passes", type=int, default=1)
    er.add_argument("--concurrency", type=int, default=2)
    er.add_argument("--out")
    er.add_argument("--judge", help="a model (URL or name) that also scores each diff on a rubric")
    er.add_argument("--temperature", type=float, help="the policy's sampling temperature (default 1.0)")
    er.add_argument("--top-p", type=float, help="the policy's top_p (default 1.0)")
    er.add_argument("--max-tokens", type=int, help="completion tokens per turn (default 4096)")
    er.add_argument("-c", "--config", help="TOML with EvalConfig fields")
    er.set_defaults(fn=cmd_eval_run)

    eb = ev.add_parser("base", help="base-model evals: codebase perplexity and state tracking")
    eb.add_argument("--model", default="default", help="a model folder or 'default'")
    eb.add_argument("--out", help="write the JSON result here too")
    eb.add_argument("-c", "--config", help="TOML with BaseEvalConfig fields (repo, window, stride, ...)")
    eb.set_defaults(fn=cmd_eval_base)

    pt = sub.add_parser("pretrain", help="continued pretraining on a code mix (phases, checkpoints, resume)")
    pt.add_argument("-c", "--config", help="TOML recipe (PretrainConfig)")
    pt.set_defaults(fn=cmd_pretrain)
    st = sub.add_parser("sft", help="supervised fine-tuning on agent trajectories (assistant-only loss)")
    st.add_argument("-c", "--config", help="TOML recipe (SFTConfig)")
    st.set_defaults(fn=cmd_sft)

    rl = sub.add_parser("rl", help="asynchronous RL in the harness: rollouts on our server, Dr. GRPO, weight sync")
    rl.add_argument("-c", "--config", help="TOML recipe with RLConfig fields (see configs/rl.toml)")
    rl.add_argument("--out", help="run folder (an existing one resumes; default: runs/<time>-rl)")
    rl.set_defaults(fn=cmd_rl)
    sy = sub.add_parser("study", help="studies").add_subparsers(dest="sub", required=True)
    sc = sy.add_parser("cpt-vs-rl", help="CPT at log-spaced budgets, identical SFT (and RL, when it exists)")
    sc.add_argument("-c", "--config", help="TOML (StudyConfig: pretrain, sft, levels)")
    sc.set_defaults(fn=cmd_study_cpt_vs_rl)

    kn = sub.add_parser("kernels", help="low-precision MoE kernels").add_subparsers(dest="sub", required=True)
    kc = kn.add_parser("check", help="quantisers vs float64, GEMM errors per format, a tiny MoE trained per backend")
    kc.add_argument("-c", "--config", help="TOML (KernelsStageConfig)")
    kc.add_argument("--out", default="runs", help="parent folder of the run folder")
    kc.set_defaults(fn=cmd_kernels_check)

    mo = sub.add_parser("model", help="models").add_subparsers(dest="sub", required=True)
    mi = mo.add_parser("import-default", help="the embedded SmolLM2-135M-Instruct GGUF -> a Hugging Face model folder")
    mi.add_argument("--out", help="default: $OPENCOMPOSER_DATA/models/smollm2-135m-instruct")
    mi.set_defaults(fn=cmd_model_import_default)

    sv = sub.add_parser("serve", help="an OpenAI-compatible server over our engine (default: the embedded model)")
    sv.add_argument("--model", help="a model folder (default: the embedded SmolLM2-135M-Instruct, imported once)")
    sv.add_argument("--name", help="the served model name (default: the folder name)")
    sv.add_argument("--host", help="default 127.0.0.1")
    sv.add_argument("--port", type=int, help="default 8000")
    sv.add_argument("--slots", type=int, help="concurrent sequences (default 32)")
    sv.add_argument("--max-len", type=int, help="tokens per sequence (default: the model's context)")
    sv.add_argument("--speculative", action="store_true", help="MTP speculative decoding (models with MTP heads)")
    sv.add_argument("--admin-token", help="enables POST /admin/weights (or $OPENCOMPOSER_ADMIN_TOKEN)")
    sv.add_argument("--weights", help="follow a weight store (folder or fsspec URL): new versions are pulled, "
                                      "verified and swapped in flight (an RL inference replica)")
    sv.add_argument("-c", "--config", help="TOML with ServeConfig fields (max_waiting, request_timeout_s, ...)")
    sv.set_defaults(fn=cmd_serve)

    rep = sub.add_parser("report", help="(re)write the report card of a run folder")
    rep.add_argument("run_dir")
    rep.set_defaults(fn=cmd_report)
    return p


# Commands that take `--a.b=value` config overrides; every other command refuses unknown arguments.
TAKES_OVERRIDES = {"cmd_speedrun", "cmd_sandbox_run", "cmd_sandbox_fork_demo", "cmd_agent", "cmd_tasks_import",
                   "cmd_eval_run", "cmd_eval_base", "cmd_pretrain", "cmd_sft", "cmd_study_cpt_vs_rl",
                   "cmd_kernels_check", "cmd_serve", "cmd_rl"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and ns.fn.__name__ not in TAKES_OVERRIDES:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command != "speedrun":
        from opencomposer.core.log import setup_logging

        setup_logging(ns.log_level)
    if ns.command != "serve":  # (serve stops on SIGTERM by itself)
        import signal

        def _interrupt(signum, frame):  # SIGTERM ends a command the way Ctrl-C does: cleanly, saving its work
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return ns.fn(ns, extra)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from opencomposer.core.errors import UserError

        # A mistake the user can fix is one line, not a traceback (--debug shows it); a bug still
        # shows its traceback.
        if ns.debug or not isinstance(e, (UserError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                             PermissionError, json.JSONDecodeError, UnicodeDecodeError)):
            raise
        print(f"error: {e}  (--debug for the traceback)", file=sys.stderr)
        return 2
