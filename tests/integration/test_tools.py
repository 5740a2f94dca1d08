"""Every tool against real files in a real sandbox, parallel calls, and a hypothesis fuzz of the
tool layer: whatever the model sends, the result is an observation, never an exception."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opencomposer.harness.index import CodeIndex
from opencomposer.harness.tools import ALL_TOOLS, ToolConfig, ToolContext, build_toolset
from opencomposer.sandbox.local import Workspace


@pytest.fixture
def env(buggy_repo):
    with Workspace(buggy_repo) as ws, ws.sandbox() as sb:
        sb.start_server()
        ctx = ToolContext(sb, ToolConfig(), CodeIndex.build(buggy_repo))
        yield ctx, build_toolset()


def call(env, name, **args):
    ctx, ts = env
    return ts.call(ctx, name, json.dumps(args))


def test_read_file(env):
    r = call(env, "read_file", target_file="pkg/calc.py")
    assert r.ok and r.content.splitlines()[1] == "     2|    return a - b"
    r = call(env, "read_file", target_file="pkg/calc.py", offset=5, limit=1)
    assert r.content.startswith("     5|def mul") and "[lines 5-5 of 6" in r.content
    assert call(env, "read_file", target_file="nope.py").error_type == "NotFound"
    assert call(env, "read_file", target_file="../etc/passwd").error_type == "PathError"
    assert call(env, "read_file", target_file="pkg/calc.py", offset=99).error_type == "InvalidArguments"
    env[0].sandbox.write_file("blob.bin", b"\x00\x01\x02" * 100)
    assert call(env, "read_file", target_file="blob.bin").error_type == "BinaryFile"


def test_list_dir_and_glob(env):
    r = call(env, "list_dir")
    assert r.content.splitlines()[0] == "pkg/" and ".git" not in r.content
    assert "AGENTS.md" not in call(env, "list_dir", ignore_globs=["*.md"]).content
    assert call(env, "glob_file_search", glob_pattern="*.py").content.splitlines() == \
        ["pkg/__init__.py", "pkg/calc.py", "test_calc.py"]
    assert call(env, "glob_file_search", glob_pattern="*.rs").content.startswith("No files")
    env[0].sandbox.write_file(".gitignore", "ignored.py\n")
    env[0].sandbox.write_file("ignored.py", "x = 1\n")
    assert "ignored.py" not in call(env, "glob_file_search", glob_pattern="*.py").content


def test_grep_modes(env):
    assert call(env, "grep", pattern="def \\w+").content.count("\n") == 3  # add, mul, test_add, test_mul
    r = call(env, "grep", pattern="DEF ADD", case_insensitive=True, output_mode="files_with_matches")
    assert r.content.splitlines() == ["pkg/calc.py"]
    assert call(env, "grep", pattern="assert", output_mode="count").content == "test_calc.py:2"
    ctxr = call(env, "grep", pattern="return a - b", context_before=1)
    assert "def add" in ctxr.content
    assert call(env, "grep", pattern="zzz_nothing").content == "No matches found."
    assert call(env, "grep", pattern="(unclosed").error_type == "SearchError"
    assert call(env, "grep", pattern="def", glob="test_*.py", head_limit=1).content.startswith("test_calc.py:")


def test_codebase_search(env):
    r = call(env, "codebase_search", query="multiply two numbers mul")
    assert r.ok and r.content.split(":")[0] in ("pkg/calc.py", "test_calc.py")
    assert "def mul" in r.content


def test_edits(env):
    r = call(env, "search_replace", file_path="pkg/calc.py", old_string="return a - b", new_string="return a + b")
    assert r.ok and "return a + b" in r.content
    miss = call(env, "search_replace", file_path="pkg/calc.py", old_string="return a - b", new_string="x")
    # where the copy left the file, for RL's copy blame (not shown to the model): "return a " occurs
    assert miss.error_type == "NoMatch" and miss.detail == {"matched": len("return a ")}
    assert "matched" not in miss.content
    assert call(env, "search_replace", file_path="pkg/calc.py", old_string="return", new_string="yield").error_type \
        == "NotUnique"
    assert call(env, "search_replace", file_path="pkg/calc.py", old_string="return", new_string="return  ",
                replace_all=True).content.startswith("Replaced 2")
    assert call(env, "search_replace", file_path="pkg/calc.py", old_string="def  add", new_string="x").content \
        .endswith("copy the exact indentation)")
    assert call(env, "search_replace", file_path="new/mod.py", old_string="", new_string="X = 1\n").ok
    assert call(env, "write_file", file_path="w.txt", contents="hello").ok
    assert env[0].sandbox.read_file("w.txt") == b"hello" and env[0].sandbox.read_file("new/mod.py") == b"X = 1\n"
    assert call(env, "delete_file", target_file="w.txt").ok
    assert call(env, "delete_file", target_file="w.txt").error_type == "NotFound"
    # The index follows the agent's edits.
    assert "new/mod.py" in call(env, "codebase_search", query="X").content


def test_terminal_persistent_and_background(env):
    r = call(env, "run_terminal_cmd", command="cd pkg && export COLOR=blue && ls")
    assert "calc.py" in r.content and r.content.endswith("cwd /workspace/pkg]")
    assert "blue" in call(env, "run_terminal_cmd", command="echo $COLOR; pwd").content
    r = call(env, "run_terminal_cmd", command="sleep 5", timeout_s=1)
    assert "stopped: timeout" in r.content
    r = call(env, "run_terminal_cmd", command="python -m pytest -q -p no:cacheprovider ..", timeout_s=120)
    assert "1 failed, 1 passed" in r.content and "[exit code 1" in r.content
    bg = call(env, "run_terminal_cmd", command="for i in 1 2 3; do echo bg$i; done", is_background=True)
    assert bg.ok and "job" in bg.content
    time.sleep(0.5)
    log = bg.content.split("output goes to ")[1].split(" ")[0]
    assert "bg3" in call(env, "run_terminal_cmd", command=f"cat {log}").content


def test_read_lints_with_ruff(env):
    env[0].sandbox.write_file("bad.py", "import os\nx = undefined_name\n")
    r = call(env, "read_lints", paths=["bad.py"])
    assert "bad.py:1:8: F401" in r.content and "F821" in r.content
    assert call(env, "read_lints", paths=["pkg"]).content == "No linter errors found."
    assert env[0].sandbox.exec("test -e .ruff_cache").exit_code == 1  # no cache written into the workspace


def test_todo_write(env):
    r = call(env, "todo_write", todos=[{"id": "1", "content": "find bug", "status": "completed"},
                                       {"id": "2", "content": "fix bug", "status": "in_progress"}])
    assert r.content == "[x] 1: find bug\n[~] 2: fix bug"
    r = call(env, "todo_write", merge=True, todos=[{"id": "2", "status": "completed"},
                                                   {"id": "3", "content": "test", "status": "pending"}])
    assert r.content.splitlines()[1:] == ["[x] 2: fix bug", "[ ] 3: test"]
    assert call(env, "todo_write", todos=[{"id": "9"}]).error_type == "InvalidArguments"


def test_strict_mode_in_a_real_environment(buggy_repo):
    with Workspace(buggy_repo) as ws, ws.sandbox() as sb:
        ctx = ToolContext(sb, ToolConfig(strict=True))
        ts = build_toolset(ctx.config)
        assert ts.call(ctx, "read_file", '{"target_file": "pkg/calc.py", "limit": "2"}').error_type == \
            "InvalidArguments"
        assert ts.call(ctx, "read_file", '{"target_file": "pkg/calc.py", "limit": 2}').ok


def test_parallel_calls_run_concurrently(env):
    from concurrent.futures import ThreadPoolExecutor

    ctx, ts = env
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: ts.call(ctx, "grep", '{"pattern": "a"}'), range(4)))
    assert all(r.ok for r in rs) and len({r.content for r in rs}) == 1
    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: ctx.sandbox.exec("sleep 1", timeout_s=10), range(4)))
    assert all(r.ok for r in rs) and time.perf_counter() - t < 3.5  # 4 x 1s in parallel, not 4s


TOOL_NAMES = [t.name for t in ALL_TOOLS]
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
                           max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(TOOL_NAMES + ["nope", ""]),
       raw=st.one_of(st.text(max_size=200), json_values.map(json.dumps),
                     st.fixed_dictionaries({}, optional={
                         "target_file": st.sampled_from(["pkg/calc.py", "../x", "/etc/passwd", "", "a\x00b", "."]),
                         "file_path": st.sampled_from(["pkg/calc.py", "../../x", "/workspace/n.py"]),
                         "old_string": st.text(max_size=20), "new_string": st.text(max_size=20),
                         "command": st.sampled_from(["true", "exit 3", "yes | head -c 100000", "cat /dev/zero | head"]),
                         "pattern": st.text(max_size=10), "glob_pattern": st.text(max_size=10),
                         "offset": st.integers(-5, 10**9), "limit": st.integers(-5, 10**9),
                         "query": st.text(max_size=30), "todos": json_values,
                         "timeout_s": st.floats(0.1, 3)}).map(json.dumps)))
def test_fuzz_tool_layer_never_raises(env, name, raw):
    ctx, ts = env
    r = ts.call(ctx, name, raw)
    assert isinstance(r.content, str) and len(r.content) <= ctx.config.max_output_chars + 100
    assert r.ok or r.error_type


def test_huge_arguments_are_handled(env):
    r = call(env, "write_file", file_path="big.txt", contents="x" * 5_000_000)
    assert r.ok
    r = call(env, "read_file", target_file="big.txt")
    assert r.ok and "characters truncated" in r.content
