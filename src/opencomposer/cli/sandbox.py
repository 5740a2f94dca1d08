"""`opencomposer sandbox ...` and `opencomposer agent`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opencomposer.cli.common import _overrides


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


def _sandbox_config(ns: argparse.Namespace, extra: list[str]):
    from opencomposer.core.config import load_config
    from opencomposer.sandbox.base import SandboxConfig

    return load_config(SandboxConfig, ns.config, _overrides(ns, extra))


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
        policy = OpenAIPolicy(base_url=base_url, model=model, temperature=ns.temperature, top_p=ns.top_p,
                              max_tokens=ns.max_tokens)
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

    import uuid

    out = Path(ns.out) / f"agent-{uuid.uuid4().hex[:12]}"
    try:
        with Workspace(repo) as ws, ws.sandbox() as sb:
            agent = Agent(policy, sb, cfg, index=CodeIndex.build(repo, workdir=sb.config.workdir), on_event=show)
            # Saved however the run ends (Ctrl-C, SIGTERM, an error): nothing of it is lost.
            traj = agent.run(ns.prompt, save_to=out / "trajectory.json")
    except KeyboardInterrupt:
        con.print(f"[yellow]interrupted[/]; the trajectory so far is in {out / 'trajectory.json'}")
        return 130
    except (SandboxError, ValueError) as e:
        con.print(f"[red]error:[/] {e}")
        return 2
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
