"""Demonstrations: a task's gold change replayed the way an engineer works with the harness's own
tools, over several turns — search for what the prompt names, read the code around each change,
edit it, check that it still compiles, say what was done.

The oracle (`runner.oracle_policy`) applies the gold change in one turn of edits to files it never
read; a model trained on that learns to edit blind. A demonstration is what SFT should show a model
before RL (report §4 starts RL from a model that already acts like an agent), and a realistic
multi-turn conversation for measuring rollout throughput (`benchmarks/rollouts.py`). It is built
from the task folder alone: the prompt, `repo/` and `reference.patch`.
"""

from __future__ import annotations

import re
import shlex

from opencomposer.harness.policy import ScriptedPolicy
from opencomposer.tasks.format import Task
from opencomposer.tasks.patch import changed_files, hunks_by_file

WINDOW = 12
"""Lines read above and below a change."""


def _identifier(prompt: str) -> str | None:
    """The first `code` span of the prompt that looks like an identifier (what a person greps for)."""
    for span in re.findall(r"`([^`\n]+)`", prompt):
        name = span.strip().removesuffix("()")
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name) and not name.endswith(".py"):
            return name.split(".")[-1]
    return None


def _line_of(text: str, old: str) -> int:
    at = text.find(old) if old else -1
    return text[:at].count("\n") + 1 if at >= 0 else 1


def _trimmed(old: str, new: str) -> tuple[str, str]:
    """A hunk without its unchanged context lines."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    while a and b and a[0] == b[0]:
        a, b = a[1:], b[1:]
    while a and b and a[-1] == b[-1]:
        a, b = a[:-1], b[:-1]
    return "".join(a), "".join(b)


def shown_by_search(task: Task, name: str | None) -> list[dict] | None:
    """The edits as `search_replace` calls of only the changed lines, when the search for `name`
    already shows every one of them: each changed line has the name in it and is unique in its
    file, and no file is added or deleted. Then there is nothing to read first (a rename is like
    that). None otherwise."""
    if not name:
        return None
    word = re.compile(rf"\b{re.escape(name)}\b")
    calls = []
    hunks = hunks_by_file(task.reference_patch)
    for path, kind in changed_files(task.reference_patch):
        src = task.repo / path
        if kind != "modified" or not src.is_file():
            return None
        text = src.read_text(errors="replace")
        for old, new in hunks.get(path, []):
            old, new = _trimmed(old, new)
            if not old or text.count(old) != 1 or not all(word.search(ln) for ln in old.splitlines()):
                return None
            calls.append({"name": "search_replace", "arguments": {"file_path": path, "old_string": old,
                                                                  "new_string": new}})
    return calls or None


def demonstration_turns(task: Task) -> list[dict]:
    """The turns (ScriptedPolicy's dict form) that solve `task`: search, read around each change,
    edit, check, final message (five when the change edits existing files); four, without the
    read, when the search already shows every changed line (`shown_by_search`)."""
    from opencomposer.evals.runner import oracle_calls

    patch = task.reference_patch
    files = changed_files(patch)
    hunks = hunks_by_file(patch)
    turns: list[dict] = []
    name = _identifier(task.prompt)
    direct = shown_by_search(task, name)
    if name:
        turns.append({"content": f"Let me find `{name}`.",
                      # the plain name, not \bname\b: in JSON that is "\\bname\\b", which SmolLM2 after
                      # SFT garbled into invalid regexes (measured on the rename family, docs/rl.md)
                      "tool_calls": [{"name": "grep", "arguments": {"pattern": name}}]})
    else:
        turns.append({"content": "Let me look at the repository.", "tool_calls": [{"name": "list_dir",
                                                                                    "arguments": {}}]})
    reads = []
    for path, kind in files if direct is None else ():
        src = task.repo / path
        if kind == "added" or not src.is_file():
            continue
        try:
            text = src.read_text()
        except UnicodeDecodeError:
            continue
        for old, _ in hunks.get(path, [])[:2]:
            line = _line_of(text, old)
            reads.append({"name": "read_file", "arguments": {"target_file": path, "offset": max(1, line - WINDOW),
                                                             "limit": 2 * WINDOW + old.count("\n")}})
    if reads:
        turns.append({"content": "Reading the code around it.", "tool_calls": reads})
    # the edits are the oracle's (search_replace per hunk, write_file or delete where it must)
    turns.append({"content": "This is the fix.", "tool_calls": direct or oracle_calls(task)})
    py = [p for p, kind in files if p.endswith(".py") and kind != "deleted"]
    if py:
        check = "python -m py_compile " + " ".join(shlex.quote(p) for p in py) + " && echo ok"
        turns.append({"content": "Checking that it compiles.",
                      "tool_calls": [{"name": "run_terminal_cmd", "arguments": {"command": check}}]})
    where = ", ".join(f"`{p}`" for p, _ in files[:3]) + (" and more" if len(files) > 3 else "")
    turns.append({"content": f"Fixed it in {where}."})
    return turns


def demonstration_policy(task: Task, k: int = 0) -> ScriptedPolicy:
    return ScriptedPolicy(demonstration_turns(task), name="demonstration")
