"""The prompt layout of report §2: "a system message, the tool call format specification, recent
file information, past user messages, and the current task" — plus the repository's own rules
files (AGENTS.md and friends), read through the sandbox like everything else.

The tool schemas travel in the request's `tools` field (OpenAI function calling); how they become
tokens is the chat renderer's job (tokenizer issue), identical for SFT, RL and serving.
"""

from __future__ import annotations

from collections.abc import Sequence

from opencomposer.sandbox.base import SandboxError

RULES_FILES = ("AGENTS.md", "CLAUDE.md", ".cursorrules", ".github/copilot-instructions.md")
RULES_MAX_CHARS = 8000

SYSTEM = """You are a coding agent working in a software repository at {workdir}, inside an isolated sandbox \
with no network access. You make real changes to the repository with your tools until the user's request is \
done, then reply with a short summary of what you changed.

Working style:
{style}

Tool use:
- Call tools through the function-calling interface; arguments are JSON objects matching each tool's schema.
- Independent calls (e.g. reading several files) can be made together in one turn: they run in parallel.
- Paths are relative to {workdir}. Every result comes back as a tool message; errors say what was wrong.
- When the request is fully done, answer without calling any tool."""

# The working style names only the tools the agent has: a prompt that recommends `write_file` or
# `todo_write` to an agent restricted to four tools (the speedrun's) invites calls that can only fail.
# Each clause is (tool, text); with every tool present the text is the one the harness always had.
_FIND = (("codebase_search", "codebase_search"), ("grep", "grep"), ("glob_file_search", "glob_file_search"),
         ("read_file", "read_file"))
_EDIT = (("search_replace", "search_replace for edits"), ("write_file", "write_file for new files"))
_CHECK = (("run_terminal_cmd", "run the tests or the program with run_terminal_cmd"),
          ("read_lints", "read_lints for Python"))
_CONVENTIONS = "- Follow the conventions and abstractions already in the codebase. Keep changes focused on the request."
_TODOS = "- For work with several steps, keep a todo list with todo_write and update it as you go."


def working_style(tools: Sequence[str] | None = None) -> str:
    """The system prompt's working-style lines for an agent with `tools` (None: every tool)."""
    def pick(clauses):
        return ", ".join(text for name, text in clauses if tools is None or name in tools)

    find, edit, check = pick(_FIND), pick(_EDIT), pick(_CHECK)
    steps = [f"Find the relevant code first ({find})" if find else "",
             f"edit it ({edit})" if edit else "", f"check your work ({check})" if check else ""]
    steps = [x for x in steps if x]
    lines = []
    if steps:
        first = ", then ".join(steps)
        lines.append("- " + first[0].upper() + first[1:] + ".")
    lines.append(_CONVENTIONS)
    if tools is None or "todo_write" in tools:
        lines.append(_TODOS)
    return "\n".join(lines)


SUMMARIZE_PROMPT = """Your context is nearly full. Write a summary that lets you continue the task from it \
alone: the user's request, what you have learned about the codebase (files, functions, conventions), what \
you have changed so far, what remains, and anything that failed and why. You may think first inside \
<scratchpad>...</scratchpad> (it will be dropped); then write the summary inside <summary>...</summary>. \
Do not call tools."""

PROMPTED_SUMMARIZER_SYSTEM = """You compress the transcript of a coding agent's session so it can continue \
with a fresh context. Keep: the request, key files and findings, changes made, remaining work, failures. \
Reply with the summary only."""


def read_rules(sandbox) -> str:
    blocks = []
    for name in RULES_FILES:
        try:
            text = sandbox.read_file(name, length=RULES_MAX_CHARS).decode("utf-8", "replace")
        except SandboxError:
            continue
        blocks.append(f'<rules file="{name}">\n{text.strip()}\n</rules>')
    return "\n".join(blocks)


def recent_files(sandbox, limit: int = 15) -> list[str]:
    """Recently changed files, from git history when there is one."""
    r = sandbox.exec("git log -n 20 --name-only --format= 2>/dev/null | awk 'NF && !seen[$0]++' | head -n "
                     f"{int(limit)}", timeout_s=30)
    return [ln for ln in r.stdout.splitlines() if ln.strip()] if r.exit_code == 0 else []


def system_message(workdir: str, rules: str, tools: Sequence[str] | None = None) -> dict:
    """The system message; `tools` are the names of the tools the agent has (None: every tool)."""
    text = SYSTEM.format(workdir=workdir, style=working_style(tools))
    if rules:
        text += "\n\nThe repository's own rules (follow them):\n" + rules
    return {"role": "system", "content": text}


def task_message(task: str, *, recent: Sequence[str] = (), history: Sequence[str] = (), summary: str | None = None,
                 todos: str | None = None, summaries: int = 0) -> dict:
    parts = []
    if recent:
        parts.append("<recent_files>\n" + "\n".join(recent) + "\n</recent_files>")
    if history:
        parts.append("<previous_user_messages>\n" + "\n---\n".join(history) + "\n</previous_user_messages>")
    if summary is not None:
        parts.append(f"<summary_of_earlier_work count=\"{summaries}\">\n{summary.strip()}\n</summary_of_earlier_work>")
        if todos:
            parts.append(f"<todos>\n{todos}\n</todos>")
        parts.append("Continue the task from the summary above.")
    parts.append(f"<user_query>\n{task.strip()}\n</user_query>")
    return {"role": "user", "content": "\n\n".join(parts)}


def extract_summary(text: str | None) -> str:
    """The text inside <summary>...</summary>; else everything outside <scratchpad>...</scratchpad>."""
    text = text or ""
    if "<summary>" in text:
        body = text.split("<summary>", 1)[1]
        return body.split("</summary>", 1)[0].strip()
    while "<scratchpad>" in text and "</scratchpad>" in text.split("<scratchpad>", 1)[1]:
        head, rest = text.split("<scratchpad>", 1)
        text = head + rest.split("</scratchpad>", 1)[1]
    return text.strip()
