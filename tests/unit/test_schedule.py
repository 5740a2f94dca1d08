"""Which tool calls of a turn may overlap (harness/schedule.py): pure decisions, no sandbox."""

from __future__ import annotations

import threading
import time

from opencomposer.harness import schedule
from opencomposer.harness.schedule import BARRIER, Access
from opencomposer.harness.tools import ALL_TOOLS

TOOLS = {t.name: t for t in ALL_TOOLS}


def acc(name, args, workdir="/workspace"):
    import json

    return schedule.access_of(TOOLS, name, json.dumps(args), workdir)


def test_normalised_paths_meet():
    a = acc("search_replace", {"file_path": "pkg/calc.py", "old_string": "a", "new_string": "b"})
    b = acc("search_replace", {"file_path": "./pkg/../pkg/calc.py", "old_string": "c", "new_string": "d"})
    c = acc("read_file", {"target_file": "/workspace/pkg/calc.py"})
    other = acc("write_file", {"file_path": "pkg/other.py", "contents": ""})
    assert schedule.conflicts(a, b) and schedule.conflicts(a, c) and schedule.conflicts(c, a)
    assert not schedule.conflicts(a, other)
    # Reads never conflict with reads; a folder read conflicts with a write inside it.
    assert not schedule.conflicts(c, acc("read_file", {"target_file": "pkg/calc.py"}))
    assert schedule.conflicts(acc("list_dir", {"target_directory": "pkg"}), other)
    assert schedule.conflicts(acc("grep", {"pattern": "x"}), other)
    assert not schedule.conflicts(acc("grep", {"pattern": "x", "path": "docs"}), other)


def test_shell_is_a_barrier_and_broken_calls_touch_nothing():
    sh = acc("run_terminal_cmd", {"command": "ls"})
    assert sh.barrier and schedule.conflicts(sh, acc("read_file", {"target_file": "a"}))
    assert schedule.access_of(TOOLS, "no_such_tool", "{}", "/w") == schedule.NOTHING
    assert schedule.access_of(TOOLS, "read_file", "{not json", "/w") == schedule.NOTHING
    todo = acc("todo_write", {"todos": []})
    assert schedule.conflicts(todo, acc("todo_write", {"todos": []}))
    assert not schedule.conflicts(todo, acc("list_dir", {}))  # the todo list is not a path


def test_dependencies_and_order():
    w = Access(writes=("f",))
    r = Access(reads=("g",))
    deps = schedule.dependencies([w, r, w, BARRIER, r])
    assert deps == [[], [], [0], [0, 1, 2], [3]]


def test_run_ordered_keeps_same_path_order_and_overlaps_the_rest():
    log, lock = [], threading.Lock()
    live, peak = [0], [0]

    def run(call):
        name, delay = call
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(delay)
        with lock:
            live[0] -= 1
            log.append(name)
        return name

    calls = [("f1", 0.3), ("g", 0.05), ("f2", 0.0), ("h", 0.05)]
    accesses = [Access(writes=("f",)), Access(writes=("g",)), Access(writes=("f",)), Access(reads=("h",))]
    assert schedule.run_ordered(calls, accesses, run, max_parallel=4) == ["f1", "g", "f2", "h"]
    assert log.index("f1") < log.index("f2") and peak[0] >= 2  # f2 waited for f1; the rest overlapped
    # Many workers fewer than calls still finish (no waiting call holds a worker its dependency needs).
    chain = [(f"c{i}", 0.0) for i in range(20)]
    assert schedule.run_ordered(chain, [Access(writes=("x",))] * 20, run, max_parallel=2) == [c for c, _ in chain]
