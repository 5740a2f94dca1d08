"""`opencomposer tasks ...` (build, import, validate) and `opencomposer eval run`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from opencomposer.cli.common import _data_dir, _keep_gated, _overrides


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
    for flag, key in (("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_tokens")):
        if getattr(ns, flag) is not None:
            overrides.append(f"--policy.{key}={getattr(ns, flag)}")
    cfg = load_config(EvalConfig, ns.config, _overrides(ns, overrides))
    out = Path(ns.out) if ns.out else Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        factory = policy_factory(ns.model, ns.model_name, cfg.policy)
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
        try:
            summary = run_eval(cfg, factory, out, progress=lambda r: bar.advance(task), judge=judge)
        except KeyboardInterrupt:
            print(f"interrupted; finished episodes are in {out}/results.jsonl — run the same command with "
                  f"--out {out} to resume", file=sys.stderr)
            return 130
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}, indent=1))
    print(f"results: {out}/results.jsonl  report: {out}/report.html", file=sys.stderr)
    return 0
