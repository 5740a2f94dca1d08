"""The one command-line entry: `opencomposer <command> ...`.

Stage modules are imported lazily inside each command, so `opencomposer sandbox ...` never pays
for torch, and `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def _overrides(ns: argparse.Namespace, extra: list[str]) -> list[str]:
    bad = [x for x in extra if not x.startswith("--")]
    if bad:
        raise SystemExit(f"unexpected arguments: {' '.join(bad)} (overrides look like --a.b=value)")
    return extra


def cmd_speedrun(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer import speedrun
    from opencomposer.core.config import load_config

    cfg = load_config(speedrun.SpeedrunConfig, ns.config, _overrides(ns, extra))
    run_dir = speedrun.run(cfg)
    print(run_dir.report.read_text())
    print(f"run folder: {run_dir.root}")
    return 0


def _sandbox_config(ns: argparse.Namespace, extra: list[str]):
    from opencomposer.core.config import load_config
    from opencomposer.sandbox.base import SandboxConfig

    return load_config(SandboxConfig, ns.config, _overrides(ns, extra))


def cmd_sandbox_run(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.sandbox.base import SandboxError
    from opencomposer.sandbox.local import Workspace

    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("error: no command given (usage: opencomposer sandbox run --workspace DIR -- CMD ...)", file=sys.stderr)
        return 2
    try:
        cfg = _sandbox_config(ns, extra)
        with Workspace(ns.workspace, cfg) as ws, ws.sandbox() as sb:
            res = sb.exec(command if len(command) > 1 else command[0], timeout_s=ns.timeout)
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.killed_by:
        print(f"[opencomposer: killed by {res.killed_by} after {res.duration_s:.2f}s]", file=sys.stderr)
    return res.exit_code


def cmd_sandbox_fork_demo(ns: argparse.Namespace, extra: list[str]) -> int:
    import tempfile

    from rich.console import Console

    from opencomposer.sandbox.local import Workspace

    con = Console()
    cfg = _sandbox_config(ns, extra)
    with tempfile.TemporaryDirectory(prefix="oc-forkdemo-") as d:
        src = Path(ns.workspace) if ns.workspace else Path(d)
        if not ns.workspace:
            (src / "counter.txt").write_text("0\n")
        with Workspace(src, cfg) as ws, ws.sandbox() as parent:
            parent.exec("echo parent-was-here >> counter.txt")
            con.print(f"[bold]parent[/] ({ws.mode} layers): counter.txt = {parent.read_file('counter.txt')!r}")
            snap = parent.snapshot()
            con.print(f"snapshot {snap.id}: {len(snap.layers)} frozen layer(s) over {snap.base}")
            children = parent.fork(3)
            for i, ch in enumerate(children):
                ch.exec(f"echo child-{i} >> counter.txt")
            parent.exec("echo parent-again >> counter.txt")
            for i, ch in enumerate(children):
                con.print(f"child {i}: {ch.read_file('counter.txt')!r}")
                ch.close()
            con.print(f"parent:  {parent.read_file('counter.txt')!r}")
            with ws.sandbox(snap) as restored:
                con.print(f"restored from snapshot: {restored.read_file('counter.txt')!r}")
            if ns.workspace:
                con.print(f"the workspace on the host is untouched: {src}")
    return 0


def cmd_sandbox_doctor(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.sandbox import doctor

    checks = doctor.run_checks()
    if ns.json:
        print(json.dumps(doctor.as_dicts(checks), indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="sandbox isolation on this machine")
        t.add_column("feature")
        t.add_column("enforced")
        t.add_column("detail")
        for c in checks:
            t.add_row(c.feature, "[green]yes[/]" if c.enforced else "[red]NO[/]", c.detail)
        Console().print(t)
    return 0 if all(c.enforced for c in checks) else 1


def cmd_sandbox_reap(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.sandbox import reaper

    r = reaper.reap()
    print(f"reaped {r.dirs} folders, {r.cgroups} cgroups, {r.processes} processes of dead owners")
    return 0


def cmd_agent(ns: argparse.Namespace, extra: list[str]) -> int:
    import subprocess

    from rich.console import Console

    from opencomposer.core.config import load_config
    from opencomposer.harness.agent import Agent, AgentConfig
    from opencomposer.harness.index import CodeIndex
    from opencomposer.harness.openai_policy import OpenAIPolicy, resolve_model
    from opencomposer.harness.policy import PolicyError
    from opencomposer.sandbox.base import SandboxError
    from opencomposer.sandbox.local import Workspace

    con = Console(stderr=True)
    cfg = load_config(AgentConfig, ns.config, _overrides(ns, extra))
    repo = Path(ns.repo).resolve()
    try:
        base_url, model = resolve_model(ns.model, ns.model_name)
        policy = OpenAIPolicy(base_url=base_url, model=model, temperature=ns.temperature)
    except PolicyError as e:
        con.print(f"[red]error:[/] {e}")
        return 2

    def show(kind: str, p: dict) -> None:
        if kind == "assistant" and p["content"]:
            con.print(f"[bold cyan]assistant[/] {p['content'][:2000]}")
        elif kind == "tool_call":
            con.print(f"[yellow]-> {p['name']}[/] {p['arguments'][:300]}")
        elif kind == "tool_result":
            first = (p["content"].splitlines() or [""])[0][:200]
            con.print(f"   [{'green' if p['ok'] else 'red'}]{'ok' if p['ok'] else 'error'}[/] {first}")
        elif kind == "summary":
            con.print(f"[magenta]context reset ({p['mode']}) at {p['tokens_before']} tokens[/]")

    try:
        with Workspace(repo) as ws, ws.sandbox() as sb:
            agent = Agent(policy, sb, cfg, index=CodeIndex.build(repo, workdir=sb.config.workdir), on_event=show)
            traj = agent.run(ns.prompt)
    except (SandboxError, ValueError) as e:
        con.print(f"[red]error:[/] {e}")
        return 2
    out = Path(ns.out) / f"agent-{traj.id}"
    traj.save(out / "trajectory.json")
    (out / "trajectory.atif.json").write_text(json.dumps(traj.to_atif(), indent=1))
    con.print(f"stop: {traj.stop_reason}; turns {traj.turns}; tool errors {traj.tool_errors}; "
              f"tokens {traj.prompt_tokens}+{traj.completion_tokens}; trajectory {out}")
    print(traj.diff, end="")
    if ns.apply and traj.diff:
        r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=traj.diff.encode(), cwd=repo,
                           capture_output=True)
        if r.returncode != 0:
            con.print(f"[red]could not apply the diff:[/] {r.stderr.decode().strip()}")
            return 1
        con.print(f"[green]applied to {repo}[/]")
    return 0 if traj.stop_reason == "done" else 1


def _data_dir() -> Path:
    import os

    return Path(os.environ.get("OPENCOMPOSER_DATA", "data"))


def cmd_tasks_build_default(ns: argparse.Namespace, extra: list[str]) -> int:
    from rich.console import Console

    from opencomposer.tasks.builders.deletion import BuildConfig
    from opencomposer.tasks.default import DefaultBenchmarkConfig, build_default

    con = Console(stderr=True)
    out = Path(ns.out) if ns.out else _data_dir() / "tasks" / "default"
    cfg = DefaultBenchmarkConfig(sources=tuple(s for s in (ns.sources or "").split(",") if s),
                                 build=BuildConfig(max_single=ns.max_single, max_multi=ns.max_multi))
    with con.status("building tasks") as status:
        m = build_default(out, cfg, progress=lambda msg: status.update(msg))
    con.print(f"{len(m.tasks)} validated tasks in {out}; {len(m.extra['rejected'])} rejected")
    print(json.dumps(m.extra["split_stats"], indent=1))
    return 0 if m.tasks else 1


def _keep_gated(made: list[Path], what: str) -> int:
    """Gate freshly made task folders, drop the rejected (saying why), report how many remain."""
    from opencomposer.tasks import gates

    kept, rejected = gates.keep_valid(made)
    for p, failed in rejected:
        print(f"rejected {p.name}: {gates.describe(failed)}", file=sys.stderr)
    print(f"{len(kept)} {what}")
    return 0 if kept else 1


def cmd_tasks_build_git(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.tasks.builders.git_history import GitHistoryConfig, build_from_git

    policy = None
    if ns.model:
        from opencomposer.harness.openai_policy import OpenAIPolicy, resolve_model

        base_url, name = resolve_model(ns.model, None)
        policy = OpenAIPolicy(base_url=base_url, model=name)
    out = Path(ns.out)
    made = build_from_git(ns.repo, out, GitHistoryConfig(max_commits=ns.max_commits, max_tasks=ns.max_tasks),
                          policy=policy, progress=lambda m: print(m, file=sys.stderr))
    return _keep_gated(made, f"validated tasks in {out}")


def _read_instances(path: Path) -> list[dict]:
    """Published instance files: JSONL (one object a line) or one JSON array."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        data = json.loads(text)
    else:
        data = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    data.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: {path}:{i}: not JSON ({e.msg}); expected one instance object a line")
    if not all(isinstance(d, dict) for d in data):
        raise SystemExit(f"error: {path}: expected instance objects")
    return data


def cmd_tasks_import(ns: argparse.Namespace, extra: list[str]) -> int:
    import dataclasses
    import shutil

    from rich.console import Console
    from rich.table import Table

    from opencomposer.core.config import load_config
    from opencomposer.tasks import gates
    from opencomposer.tasks.builders import importers
    from opencomposer.tasks.builders.harbor import import_harbor
    from opencomposer.tasks.environment import EnvBuildError

    cfg = load_config(importers.ImportConfig, ns.config, _overrides(ns, extra))
    env = dict(cfg.env)
    for kv in ns.env or []:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            print(f"error: --env {kv!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        env[k] = v
    changes = {"env": env}
    if ns.workdir:
        changes["workdir"] = ns.workdir
    if ns.setup:
        changes["setup"] = (*cfg.setup, *ns.setup)
    if ns.test_cmd:
        changes["test_cmd"] = ns.test_cmd
    if ns.requirement:
        changes["requirements"] = (*(cfg.requirements or ()), *ns.requirement)
    if ns.derive_tests:
        changes["derive_tests"] = True
    cfg = dataclasses.replace(cfg, **changes)
    out = Path(ns.out)
    rows: list[tuple[str, str, str, str]] = []  # (source item, task id, result, reason)

    def attempt(label: str, fn) -> None:
        try:
            root = fn()
        except (importers.ImportRejected, EnvBuildError, KeyError) as e:
            rows.append((label, "", "rejected", f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)))
            return
        failed = [g for g in gates.validate(root) if not g.ok]
        if not failed:
            rows.append((label, root.name, "accepted", ""))
            return
        rows.append((label, root.name, "rejected", gates.describe(failed)))
        if ns.keep_rejected:
            dest = out / ".rejected" / root.name
            shutil.rmtree(dest, ignore_errors=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(root), dest)
        else:
            shutil.rmtree(root, ignore_errors=True)

    if ns.kind == "harbor":
        for d in map(Path, ns.sources):
            if not d.is_dir():
                print(f"error: {d}: no such folder", file=sys.stderr)
                return 2
            dirs = [d] if (d / "instruction.md").exists() else sorted(p for p in d.iterdir() if (p / "instruction.md").exists())
            if not dirs:
                print(f"error: {d}: no Harbor task folders (with instruction.md) in it", file=sys.stderr)
                return 2
            for t in dirs:
                attempt(t.name, lambda t=t: import_harbor(t, out, cfg))
    else:
        if not ns.instances:
            print("error: --instances FILE (JSONL or a JSON array of published instances) is required", file=sys.stderr)
            return 2
        src = Path(ns.sources[0])
        if not (src / ".git").exists() and not (src / "HEAD").exists():
            print(f"error: {src}: not a git repository ({'the checkout' if ns.kind == 'swebench' else 'the mirror'})",
                  file=sys.stderr)
            return 2
        for inst in _read_instances(Path(ns.instances)):
            label = str(inst.get("instance_id", "?"))
            if ns.kind == "swebench":
                attempt(label, lambda inst=inst: importers.import_swebench(inst, src, out, cfg))
            else:
                attempt(label, lambda inst=inst: importers.import_swesmith(src, inst, out, cfg, main=ns.main))
    table = Table(title=f"tasks import {ns.kind} -> {out}")
    for col in ("source", "task", "result", "reason"):
        table.add_column(col, overflow="fold")
    for label, tid, result, reason in rows:
        table.add_row(label, tid, "[green]accepted[/]" if result == "accepted" else "[red]rejected[/]", reason[:600])
    Console(width=160).print(table)
    kept = sum(r[2] == "accepted" for r in rows)
    print(f"{kept} of {len(rows)} accepted" + (f"; rejected tasks kept in {out / '.rejected'}" if ns.keep_rejected
                                              and kept < len(rows) else ""))
    return 0 if kept else 1


def cmd_tasks_validate(ns: argparse.Namespace, extra: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from opencomposer.tasks import gates

    dirs = []
    for d in map(Path, ns.dirs):
        dirs += [d] if (d / "task.toml").exists() else sorted(p for p in d.iterdir() if (p / "task.toml").exists())
    t = Table(title="integrity gates")
    t.add_column("task")
    t.add_column("result")
    t.add_column("failed gates")
    bad = 0
    for d in dirs:
        res = gates.validate(d, run_tests=not ns.static)
        failed = [g for g in res if not g.ok]
        bad += bool(failed)
        t.add_row(d.name, "[red]rejected[/]" if failed else "[green]ok[/]",
                  "; ".join(f"{g.name}: {g.detail}" for g in failed))
    Console().print(t)
    return 1 if bad or not dirs else 0


def cmd_eval_run(ns: argparse.Namespace, extra: list[str]) -> int:
    from rich.progress import Progress

    from opencomposer.core.config import load_config
    from opencomposer.evals.runner import EvalConfig, policy_factory, run_eval
    from opencomposer.harness.policy import PolicyError

    tasks = Path(ns.tasks) if ns.tasks != "default" else _data_dir() / "tasks" / "default"
    if ns.tasks == "default" and not (tasks / "manifest.json").exists():
        from opencomposer.tasks.default import build_default

        print(f"building the default benchmark in {tasks} (first use)", file=sys.stderr)
        build_default(tasks)
    overrides = [f"--tasks={tasks}", f"--passes={ns.passes}", f"--concurrency={ns.concurrency}", *extra]
    if ns.split:
        overrides.append(f"--split={json.dumps(ns.split)}")
    cfg = load_config(EvalConfig, ns.config, overrides)
    out = Path(ns.out) if ns.out else Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        factory = policy_factory(ns.model, ns.model_name)
    except PolicyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rich.console import Console

    judge = None
    if ns.judge:
        from opencomposer.harness.openai_policy import OpenAIPolicy, resolve_model

        base_url, name = resolve_model(ns.judge, None)
        judge = OpenAIPolicy(base_url=base_url, model=name, temperature=0.0)
    with Progress(console=Console(stderr=True)) as bar:
        task = bar.add_task("episodes", total=None)
        summary = run_eval(cfg, factory, out, progress=lambda r: bar.advance(task), judge=judge)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}, indent=1))
    print(f"results: {out}/results.jsonl  report: {out}/report.html", file=sys.stderr)
    return 0


def cmd_model_import_default(ns: argparse.Namespace, extra: list[str]) -> int:
    from rich.progress import Progress

    from opencomposer.model.interop import import_default
    from opencomposer.tokenizer.gguf import GGUFError

    out = Path(ns.out) if ns.out else _data_dir() / "models" / "smollm2-135m-instruct"
    try:
        from rich.console import Console

        with Progress(console=Console(stderr=True)) as bar:
            task = bar.add_task("dequantising GGUF tensors", total=None)
            import_default(out, progress=lambda i, n: bar.update(task, completed=i, total=n))
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cmd_serve(ns: argparse.Namespace, extra: list[str]) -> int:
    import os
    import signal

    from opencomposer.inference.server import ServeConfig, make_server
    from opencomposer.model.errors import ModelLoadError
    from opencomposer.tokenizer.bpe import TokenizerError

    cfg = ServeConfig(model=Path(ns.model) if ns.model else None, name=ns.name, host=ns.host, port=ns.port,
                      slots=ns.slots, max_len=ns.max_len, speculative=ns.speculative,
                      admin_token=ns.admin_token or os.environ.get("OPENCOMPOSER_ADMIN_TOKEN"))
    try:
        server = make_server(cfg, _data_dir() / "models" / "smollm2-135m-instruct").start()
    except (ModelLoadError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {server.name} at {server.url} (admin endpoint {'on' if cfg.admin_token else 'off'})",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.stop()
    return 0


def _train_progress(total: int, label: str):
    from rich.console import Console
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True))
    task = bar.add_task(label, total=total)

    def update(step: int, rec: dict) -> None:
        bar.update(task, completed=step, description=f"{label} {rec['phase']} loss {rec['loss']:.3f}")
    return bar, update


def _train_command(module, config_cls, label: str, ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.core.config import load_config

    cfg = load_config(config_cls, ns.config, _overrides(ns, extra))
    bar, update = _train_progress(sum(p.steps for p in cfg.phases), label)
    with bar:
        summary = module.run(cfg, data_dir=_data_dir(), progress=update)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_pretrain(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.train import pretrain

    return _train_command(pretrain, pretrain.PretrainConfig, "pretrain", ns, extra)


def cmd_sft(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.train import sft

    return _train_command(sft, sft.SFTConfig, "sft", ns, extra)


def cmd_study_cpt_vs_rl(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.core.config import load_config
    from opencomposer.train import study

    cfg = load_config(study.StudyConfig, ns.config, _overrides(ns, extra))
    result = study.run(cfg, data_dir=_data_dir())
    print(Path(result["folder"], "study.md").read_text())
    return 0


def cmd_kernels_check(ns: argparse.Namespace, extra: list[str]) -> int:
    from rich.progress import Progress

    from opencomposer import report
    from opencomposer.core.config import load_config
    from opencomposer.core.metrics import EventLog, MetricsWriter
    from opencomposer.core.rundir import RunDir
    from opencomposer.train import precision

    cfg = load_config(precision.KernelsStageConfig, ns.config, _overrides(ns, extra))
    run_dir = RunDir.create(ns.out, "kernels")
    run_dir.write_config(cfg)
    with EventLog(run_dir.events) as events, MetricsWriter(run_dir.metrics) as metrics, Progress() as bar:
        task = bar.add_task("kernels: train the MoE per backend", total=cfg.steps * len(cfg.backends))
        events.emit("stage_start", stage="kernels")
        t0 = time.monotonic()
        precision.run(cfg, run_dir, metrics, progress=lambda: bar.advance(task))
        events.emit("stage_end", stage="kernels", seconds=time.monotonic() - t0)
    print(report.write(run_dir).read_text())
    print(f"run folder: {run_dir.root}")
    return 0


def cmd_eval_base(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.core.config import load_config
    from opencomposer.train import base_evals
    from opencomposer.train.pretrain import load_base

    cfg = load_config(base_evals.BaseEvalConfig, ns.config, _overrides(ns, extra))
    model, tok, _ = load_base(ns.model, _data_dir())
    result = base_evals.run(model.eval(), tok, cfg)
    text = json.dumps(result, indent=2)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    print(text)
    return 0


def cmd_report(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer import report
    from opencomposer.core.rundir import RunDir

    path = report.write(RunDir.open(ns.run_dir))
    print(path.read_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opencomposer", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("speedrun", help="run every stage on the embedded default and write a report card")
    sp.add_argument("-c", "--config", help="TOML recipe (default: built-in defaults)")
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
    er.add_argument("--model", required=True, help="oracle, noop, a base URL (…/v1) or a model name")
    er.add_argument("--model-name")
    er.add_argument("--split")
    er.add_argument("--passes", type=int, default=1)
    er.add_argument("--concurrency", type=int, default=2)
    er.add_argument("--out")
    er.add_argument("--judge", help="a model (URL or name) that also scores each diff on a rubric")
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
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--slots", type=int, default=32, help="concurrent sequences")
    sv.add_argument("--max-len", type=int, help="tokens per sequence (default: the model's context)")
    sv.add_argument("--speculative", action="store_true", help="MTP speculative decoding (models with MTP heads)")
    sv.add_argument("--admin-token", help="enables POST /admin/weights (or $OPENCOMPOSER_ADMIN_TOKEN)")
    sv.set_defaults(fn=cmd_serve)

    rep = sub.add_parser("report", help="(re)write the report card of a run folder")
    rep.add_argument("run_dir")
    rep.set_defaults(fn=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if ns.command != "speedrun":
        from opencomposer.core.log import setup_logging

        setup_logging(ns.log_level)
    try:
        return ns.fn(ns, extra)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
