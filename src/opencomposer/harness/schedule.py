"""Which tool calls of one turn may run at the same time.

A turn's calls run in parallel (report §5: the harness issues them concurrently), but only where
they cannot conflict: `search_replace` reads, changes and writes a whole file, so two edits of one
file run at once keep only one of them. Each tool declares what it touches (`Access`): paths it
reads, paths it writes, or everything (a terminal command can touch any file: it is a barrier).
A call waits for every earlier call of the turn it conflicts with — same path (or a folder holding
it) with a write on either side — and otherwise starts at once. The result therefore equals
running the calls one by one in their given order.

Paths are compared after normalisation (workspace-relative, `.`/`..` resolved); two names of one
file through a symlink are not detected, which the tool server's own checks keep rare (it refuses
paths that leave the workspace).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Access:
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    barrier: bool = False
    """Touches anything (shell commands): runs alone, after everything before it."""


BARRIER = Access(barrier=True)
NOTHING = Access()


def normalize(path: str, workdir: str) -> str:
    p = (path or ".").strip()
    if p.startswith(":"):
        return p
    root = workdir.rstrip("/") or "/"
    if p.startswith("/"):
        p = posixpath.relpath(posixpath.normpath(p), root)
    p = posixpath.normpath(p)
    return "." if p in ("", ".") else p


def _overlap(a: str, b: str) -> bool:
    if a.startswith(":") or b.startswith(":"):  # named state, not a path (the todo list)
        return a == b
    if a == "." or b == "." or a == b:
        return True
    return a.startswith(b + "/") or b.startswith(a + "/") or a.startswith("..") or b.startswith("..")


def conflicts(a: Access, b: Access) -> bool:
    if a.barrier or b.barrier:
        return True
    return any(_overlap(x, y) for x in a.writes for y in (*b.reads, *b.writes)) or \
        any(_overlap(x, y) for x in a.reads for y in b.writes)


def access_of(tools: dict, name: str, raw_arguments: str, workdir: str) -> Access:
    """What a call touches. Calls that will fail before touching anything (an unknown tool, arguments
    that are not a JSON object) touch nothing."""
    tool = tools.get(name)
    if tool is None:
        return NOTHING
    try:
        args = json.loads(raw_arguments) if raw_arguments and raw_arguments.strip() else {}
    except (json.JSONDecodeError, TypeError):
        return NOTHING
    if not isinstance(args, dict):
        return NOTHING
    try:
        acc = tool.access(args)
    except Exception:  # noqa: BLE001 - odd argument types: be safe, not clever
        return BARRIER
    return Access(tuple(normalize(p, workdir) for p in acc.reads if isinstance(p, str)),
                  tuple(normalize(p, workdir) for p in acc.writes if isinstance(p, str)), acc.barrier)


def dependencies(accesses: Sequence[Access]) -> list[list[int]]:
    """For each call, the earlier calls it must wait for. Only the nearest conflicting ones are
    needed, but waiting for all of them costs nothing and is easy to check."""
    return [[j for j in range(i) if conflicts(accesses[j], accesses[i])] for i in range(len(accesses))]


def run_ordered(calls: Sequence[Any], accesses: Sequence[Access], run: Callable[[Any], Any],
                max_parallel: int) -> list[Any]:
    """Run `run(call)` for every call, in parallel where `accesses` allow; results in call order.
    A call is submitted only after the calls it depends on were submitted (FIFO pool), so a waiting
    call never holds a worker its dependency needs."""
    deps = dependencies(accesses)
    futures: list[Future] = []
    with ThreadPoolExecutor(max_workers=max(1, min(len(calls), max_parallel))) as pool:
        for i, call in enumerate(calls):
            before = [futures[j] for j in deps[i]]

            def job(call=call, before=before):
                for f in before:
                    f.exception()  # wait; a failed dependency still lets this call run, as in order
                return run(call)

            futures.append(pool.submit(job))
        return [f.result() for f in futures]
