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

import difflib
import json
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


_TOKEN = re.compile(r"\w+(?:\.\w+)*|[^\w\s]|\s+")
"""What a span grows by: an identifier or attribute chain, one other character, or a run of white space."""


def _span(old: str, new: str, text: str) -> tuple[str, str] | None:
    """The smallest part of `old` (one or more whole lines of `text`, replaced by `new`) that holds
    every changed character and occurs once in `text`, with the matching part of `new`. It starts
    from the changed tokens, dressed as code is read (the name's quotes, its call's parenthesis, its
    `def` or `class`), and grows a token at a time (right, then left; white space only together with
    the token beyond it) within one line. None when no part of a line will do."""
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    q = 0
    while q < min(len(old), len(new)) - p and old[-1 - q] == new[-1 - q]:
        q += 1
    toks = [(m.start(), m.end()) for m in _TOKEN.finditer(old)]
    a, b = p, len(old) - q

    def tok(k: int) -> str:
        return old[toks[k][0]:toks[k][1]] if 0 <= k < len(toks) else ""

    if a == b:  # a pure insertion: the word it is in or touches (the one before it first)
        near = [k for k, (s, e) in enumerate(toks) if s < a < e or (e == a and re.match(r"\w", tok(k)))] + \
               [k for k, (s, e) in enumerate(toks) if s == a and tok(k).strip()]
        if not near:
            return None
        i = j = near[0]
    else:
        i = next(k for k, (s, e) in enumerate(toks) if e > a)
        j = max(k for k, (s, e) in enumerate(toks) if s < b)
    if tok(j + 1) in ("(", "'", '"'):
        j += 1
    if tok(i - 1) in ("'", '"'):
        i -= 1
    elif not tok(i - 1).strip() and tok(i - 2) in ("def", "class"):
        i -= 2
    grow_right = True
    while True:
        s, e = toks[i][0], toks[j][1]
        part = old[s:e]
        if part.strip() and part == part.strip() and "\n" not in part and text.count(part) == 1:
            return part, new[s:len(new) - (len(old) - e)]
        moved = False
        for _ in range(2):
            if grow_right and j + 1 < len(toks):
                j += 1 + (j + 2 < len(toks) and not tok(j + 1).strip())
                moved = True
            elif not grow_right and i > 0:
                i -= 1 + (i > 1 and not tok(i - 1).strip())
                moved = True
            grow_right = not grow_right
            if moved:
                break
        if not moved:
            return None


def minimal_edits(task: Task, spans: bool = False) -> list[tuple[dict, bool]] | None:
    """The reference change as the smallest `search_replace` calls: each run of changed lines of a
    hunk on its own, its old text widened by the hunk's context lines (below first, then above) only
    until it is unique in the file as the earlier edits left it. With each call, whether its old text
    is only changed lines (a search for them shows all of it). None when a file is added or
    deleted, or a run cannot be made unique inside its hunk (the oracle's whole hunks then).

    `spans`: where a run's changed lines can say it, only the smallest unique part of one of them
    (`_span`: `def read(` rather than the whole indented line), so the old text a policy must copy
    exactly is a few tokens of a line the search showed, without its indentation."""
    hunks = hunks_by_file(task.reference_patch)
    out: list[tuple[dict, bool]] = []
    for path, kind in changed_files(task.reference_patch):
        src = task.repo / path
        if kind != "modified" or not src.is_file():
            return None
        try:
            text = src.read_text()
        except UnicodeDecodeError:
            return None
        for old, new in hunks.get(path, []):
            a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
            for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
                if op == "equal":
                    continue
                lo, hi, bare = i1, i2, True
                while "".join(a[lo:hi]) == "" or text.count("".join(a[lo:hi])) != 1:
                    if hi < len(a):
                        hi += 1
                    elif lo > 0:
                        lo -= 1
                    else:
                        return None
                    bare = False
                before, after = "".join(a[lo:i1]), "".join(a[i2:hi])
                o, n = "".join(a[lo:hi]), before + "".join(b[j1:j2]) + after
                part = _span("".join(a[i1:i2]), "".join(b[j1:j2]), text) if spans and i2 > i1 else None
                if part is not None:
                    o, n, bare = part[0], part[1], True
                text = text.replace(o, n, 1)
                out.append(({"name": "search_replace", "arguments": {"file_path": path, "old_string": o,
                                                                     "new_string": n}}, bare))
    return out or None


def shown_by_search(task: Task, name: str | None, spans: bool = False) -> list[dict] | None:
    """The edits (`minimal_edits`) when the search for `name` already shows every line they
    replace: each is only changed lines (or a part of one), each with the name in it, and no file is added or
    deleted. Then there is nothing to read first (a rename is like that). None otherwise."""
    if not name:
        return None
    word = re.compile(rf"\b{re.escape(name)}\b")
    edits = minimal_edits(task, spans)
    if edits is None or not all(bare and all(word.search(ln) for ln in c["arguments"]["old_string"].splitlines())
                                for c, bare in edits):
        return None
    return [c for c, _ in edits]


def in_turns(calls: list[dict], max_chars: int | None) -> list[list[dict]]:
    """`calls` in order, as turns whose arguments take at most `max_chars` of JSON each (a call
    larger than that has a turn of its own): a policy capped at a turn's tokens can write each."""
    if not max_chars:
        return [calls] if calls else []
    turns: list[list[dict]] = []
    size = 0
    for c in calls:
        n = len(json.dumps(c["arguments"]))
        if not turns or size + n > max_chars:
            turns.append([])
            size = 0
        turns[-1].append(c)
        size += n
    return turns


def demonstration_turns(task: Task, max_turn_chars: int | None = None, spans: bool = False) -> list[dict]:
    """The turns (ScriptedPolicy's dict form) that solve `task`: search, read around each change,
    edit, check, final message; without the read when the search already shows every changed line
    (`shown_by_search`). The edits are the smallest unique ones (`minimal_edits`; the oracle's
    whole hunks, write_file or delete_file where those cannot say it), split into turns of at most
    `max_turn_chars` of arguments each (`in_turns`) so that a policy capped at a turn's tokens could
    write every turn it is shown; `spans`: each edit's old text only the smallest unique part of a
    line where that says it (`minimal_edits`)."""
    from opencomposer.evals.runner import oracle_calls

    patch = task.reference_patch
    files = changed_files(patch)
    hunks = hunks_by_file(patch)
    turns: list[dict] = []
    name = _identifier(task.prompt)
    direct = shown_by_search(task, name, spans)
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
    edits = direct or [c for c, _ in minimal_edits(task, spans) or []] or oracle_calls(task)
    for i, calls in enumerate(in_turns(edits, max_turn_chars)):
        turns.append({"content": "This is the fix." if i == 0 else "Continuing the change.", "tool_calls": calls})
    py = [p for p, kind in files if p.endswith(".py") and kind != "deleted"]
    if py:
        check = "python -m py_compile " + " ".join(shlex.quote(p) for p in py) + " && echo ok"
        turns.append({"content": "Checking that it compiles.",
                      "tool_calls": [{"name": "run_terminal_cmd", "arguments": {"command": check}}]})
    where = ", ".join(f"`{p}`" for p, _ in files[:3]) + (" and more" if len(files) > 3 else "")
    turns.append({"content": f"Fixed it in {where}."})
    return turns


def demonstration_policy(task: Task, k: int = 0, max_turn_chars: int | None = None,
                         spans: bool = False) -> ScriptedPolicy:
    return ScriptedPolicy(demonstration_turns(task, max_turn_chars, spans), name="demonstration")
