"""Shell tools: run_terminal_cmd (a persistent shell, foreground or background), read_lints (ruff),
and todo_write (the plan the agent keeps; its unfinished items survive summarisation)."""

from __future__ import annotations

import json

from opencomposer.harness.schedule import BARRIER, Access
from opencomposer.harness.tools.base import Tool, ToolContext, ToolError


def run_terminal_cmd(ctx: ToolContext, a: dict) -> str:
    cmd = a["command"]
    if a.get("is_background"):
        job = ctx.sandbox.call("bg_start", cmd=cmd, cwd=ctx.shell_cwd)
        return (f"Started in the background as {job['job']} (pid {job['pid']}); its output goes to "
                f"/tmp/.oc-{job['job']}.log (read it with `tail /tmp/.oc-{job['job']}.log`).")
    timeout = a.get("timeout_s") or ctx.config.command_timeout_s
    r = ctx.sandbox.exec(cmd, session=ctx.config.shell_session, timeout_s=float(timeout))
    with ctx.lock:
        ctx.shell_cwd = r.cwd or ctx.shell_cwd
    parts = []
    if r.stdout:
        parts.append(r.stdout.rstrip("\n"))
    if r.stderr:
        parts.append(f"[stderr]\n{r.stderr.rstrip()}")
    status = f"[exit code {r.exit_code}"
    if r.killed_by:
        status += f"; stopped: {r.killed_by} after {r.duration_s:.1f}s"
    status += f"; cwd {r.cwd}]" if r.cwd else "]"
    parts.append(status)
    return "\n".join(parts)


def read_lints(ctx: ToolContext, a: dict) -> str:
    paths = a.get("paths") or ["."]
    r = ctx.sandbox.exec(["ruff", "check", "--no-cache", "--output-format=json", "--exit-zero", "--", *paths],
                         timeout_s=120)
    if r.killed_by or r.exit_code != 0:
        raise ToolError(f"linter failed: {(r.stderr or r.stdout).strip()[:1000]}", "LinterError")
    try:
        issues = json.loads(r.stdout or "[]")
    except json.JSONDecodeError:
        raise ToolError(f"linter output was not JSON: {r.stdout[:300]}", "LinterError") from None
    if not issues:
        return "No linter errors found."
    lines = []
    workdir = ctx.sandbox.config.workdir.rstrip("/") + "/"
    for it in issues[: ctx.config.max_results]:
        loc = it.get("location") or {}
        fname = it.get("filename", "").removeprefix(workdir)
        lines.append(f"{fname}:{loc.get('row')}:{loc.get('column')}: {it.get('code')} {it.get('message')}")
    if len(issues) > ctx.config.max_results:
        lines.append(f"[... {len(issues) - ctx.config.max_results} more]")
    return "\n".join(lines)


TODOS = ":todos"
"""Not a path: the agent's todo list, which todo_write calls change in order."""
STATUSES = ["pending", "in_progress", "completed", "cancelled"]


def render_todos(todos: list[dict]) -> str:
    mark = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}
    return "\n".join(f"{mark[t['status']]} {t['id']}: {t['content']}" for t in todos) or "(no todos)"


def todo_write(ctx: ToolContext, a: dict) -> str:
    items = a["todos"]
    with ctx.lock:
        if a.get("merge"):
            by_id = {t["id"]: t for t in ctx.todos}
            for it in items:
                if it["id"] in by_id:
                    by_id[it["id"]].update({k: v for k, v in it.items() if v is not None})
                else:
                    if "content" not in it or "status" not in it:
                        raise ToolError(f"new todo {it['id']!r} needs content and status", "InvalidArguments")
                    ctx.todos.append(dict(it))
                    by_id[it["id"]] = ctx.todos[-1]
        else:
            for it in items:
                if "content" not in it or "status" not in it:
                    raise ToolError(f"todo {it.get('id')!r} needs content and status", "InvalidArguments")
            ctx.todos[:] = [dict(it) for it in items]
        return render_todos(ctx.todos)


TOOLS = [
    Tool("run_terminal_cmd", "Run a shell command in the workspace. The shell persists between calls (cd and "
         "export carry over). Set is_background for servers and watchers; the call then returns at once.",
         {"type": "object", "properties": {
             "command": {"type": "string"},
             "is_background": {"type": "boolean"},
             "timeout_s": {"type": "number", "minimum": 1}},
          "required": ["command"]}, run_terminal_cmd, lambda a: BARRIER),
    Tool("read_lints", "Show linter errors (ruff) for files or directories.",
         {"type": "object", "properties": {"paths": {"type": "array", "items": {"type": "string"}}},
          "required": []}, read_lints, lambda a: Access(reads=tuple(a.get("paths") or ["."]))),
    Tool("todo_write", "Create or update the task's todo list. With merge=true, items update by id.",
         {"type": "object", "properties": {
             "todos": {"type": "array", "items": {"type": "object", "properties": {
                 "id": {"type": "string"}, "content": {"type": "string"},
                 "status": {"type": "string", "enum": STATUSES}}, "required": ["id"]}},
             "merge": {"type": "boolean"}},
          "required": ["todos"]}, todo_write, lambda a: Access(writes=(TODOS,))),
]
