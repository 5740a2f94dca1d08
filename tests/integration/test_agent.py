"""The agent loop end to end: real sandbox, real tools, scripted or HTTP policies."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opencomposer.harness.agent import Agent, AgentConfig, ContextConfig
from opencomposer.harness.index import CodeIndex
from opencomposer.harness.openai_policy import OpenAIPolicy, resolve_model
from opencomposer.harness.policy import PolicyError, ScriptedPolicy, Usage
from opencomposer.harness.trajectory import Trajectory
from opencomposer.sandbox.local import Workspace
from tests.conftest import foreground_sigint, make_buggy_repo
from tests.integration.fake_openai_server import FakeOpenAIServer

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_trajectory.json"

FIX_SCRIPT = [
    {"tool_calls": [{"name": "grep", "arguments": {"pattern": "def add"}},
                    {"name": "read_file", "arguments": {"target_file": "AGENTS.md"}}]},
    {"tool_calls": [{"name": "read_file", "arguments": {"target_file": "pkg/calc.py"}}]},
    {"tool_calls": [{"name": "search_replace", "arguments": {"file_path": "pkg/calc.py",
                                                              "old_string": "return a - b",
                                                              "new_string": "return a + b"}},
                    {"name": "write_file", "arguments": {"file_path": "CHANGELOG.md", "contents": "- fix add\n"}}]},
    {"tool_calls": [{"name": "run_terminal_cmd", "arguments": {"command": "python -m pytest -q -p no:cacheprovider"}}]},
    {"content": "Fixed `add` (it subtracted) and noted it in CHANGELOG.md."},
]


def run_agent(repo, policy, config=None, **kw):
    with Workspace(repo) as ws, ws.sandbox() as sb:
        agent = Agent(policy, sb, config or AgentConfig(), index=CodeIndex.build(repo), **kw)
        return agent.run("add() is broken, fix it")


def test_scripted_fix_end_to_end(buggy_repo):
    events = []
    traj = run_agent(buggy_repo, ScriptedPolicy(FIX_SCRIPT), on_event=lambda k, p: events.append(k))
    assert traj.stop_reason == "done" and traj.turns == 5 and traj.tool_errors == 0
    assert "-    return a - b\n+    return a + b" in traj.diff and "CHANGELOG.md" in traj.diff
    test_out = [m for m in traj.segments[0].messages if m["role"] == "tool"][-1]["content"]
    assert "2 passed" in test_out
    assert (buggy_repo / "pkg" / "calc.py").read_text().count("a - b") == 1  # host repo untouched
    assert events.count("tool_call") == 6 and events[-1] == "done"
    # The prompt layout: system with the repo's rules, then recent files and the query.
    sys_msg, user = traj.segments[0].messages[:2]
    assert "AGENTS.md" in sys_msg["content"] and "python -m pytest" in sys_msg["content"]
    assert "<recent_files>" in user["content"] and "pkg/calc.py" in user["content"]
    assert user["content"].rstrip().endswith("</user_query>")


def test_golden_trajectory_replays_to_the_same_diff(tmp_path):
    golden = Trajectory.load(GOLDEN)
    repo = make_buggy_repo(tmp_path / "buggy")
    traj = run_agent(repo, ScriptedPolicy.from_trajectory(golden))
    assert traj.diff == golden.diff and traj.diff
    assert [(c.name, c.ok) for c in traj.tool_calls] == [(c.name, c.ok) for c in golden.tool_calls]
    tool_msgs = lambda t: [m["content"] for s in t.segments for m in s.messages if m["role"] == "tool"]  # noqa: E731
    assert [c.split(" in ")[0] for c in tool_msgs(traj)] == [c.split(" in ")[0] for c in tool_msgs(golden)]


def test_broken_calls_are_observations_and_counted(buggy_repo):
    script = [
        {"tool_calls": [{"name": "nope", "arguments": {}}, {"name": "read_file", "arguments": "{oops"},
                        {"name": "read_file", "arguments": {"target_file": "/etc/shadow"}},
                        {"name": "search_replace", "arguments": {"file_path": "pkg/calc.py", "old_string": "zzz",
                                                                 "new_string": "y"}}]},
        {"content": "gave up"},
    ]
    traj = run_agent(buggy_repo, ScriptedPolicy(script))
    assert traj.stop_reason == "done"
    assert traj.error_types == {"UnknownTool": 1, "MalformedArguments": 1, "PathError": 1, "NoMatch": 1}
    assert all(m["content"].startswith("Error (") for m in traj.segments[0].messages if m["role"] == "tool")


@pytest.mark.parametrize("limit,expect", [
    (dict(max_turns=2), "max_turns"),
    (dict(max_total_tokens=1), "max_tokens"),
    (dict(max_cost_usd=0.0), "max_cost"),
    (dict(max_wall_s=0.0), "max_wall_time"),
])
def test_limits_stop_the_loop(buggy_repo, limit, expect):
    read = ScriptedPolicy._parse(FIX_SCRIPT[1])
    endless = [dataclasses.replace(read, usage=Usage(10, 10), cost_usd=0.01)] * 10
    traj = run_agent(buggy_repo, ScriptedPolicy(endless), AgentConfig(**limit))
    assert traj.stop_reason == expect


def test_policy_error_ends_the_episode_cleanly(buggy_repo):
    traj = run_agent(buggy_repo, ScriptedPolicy([]))
    assert traj.stop_reason.startswith("policy_error") and traj.diff == ""


def _long_session(n: int) -> list[dict]:
    """n turns each reading a file (the context grows), then an answer."""
    return [{"tool_calls": [{"name": "read_file", "arguments": {"target_file": "test_calc.py"}}]}] * n


def test_self_summarisation_and_segments(buggy_repo):
    script = _long_session(3) + [
        {"content": "<scratchpad>what did I do</scratchpad><summary>Read test_calc.py three times.</summary>"},
    ] + _long_session(1) + [{"content": "done"}]
    policy = ScriptedPolicy(script)
    cfg = AgentConfig(context=ContextConfig(budget_tokens=1200, trigger=0.5, mode="self"))
    traj = run_agent(buggy_repo, policy, cfg)
    assert traj.stop_reason == "done" and len(traj.summaries) == 1
    assert [s.ended_by for s in traj.segments] == ["summary", "done"]
    first, second = traj.segments
    assert first.messages[-2]["content"].startswith("Your context is nearly full")
    assert len(first.completions) == 4 and len(second.completions) == 2  # summary tokens are in segment 0
    assert "Read test_calc.py three times." in second.messages[1]["content"]
    assert "scratchpad" not in second.messages[1]["content"] and 'count="1"' in second.messages[1]["content"]
    # What the policy saw after the reset is exactly the new segment's prefix.
    assert policy.seen[-1][:2] == second.messages[:2]
    assert traj.summaries[0]["tokens_after"] < traj.summaries[0]["tokens_before"]


def test_prompted_and_truncate_baselines(buggy_repo):
    summarizer = ScriptedPolicy([{"content": "SUMMARY-BY-SUMMARIZER"}], name="summarizer")
    cfg = AgentConfig(context=ContextConfig(budget_tokens=1200, trigger=0.5, mode="prompted"))
    traj = run_agent(buggy_repo, ScriptedPolicy(_long_session(3) + [{"content": "done"}]), cfg,
                     summarizer=summarizer)
    assert traj.summaries[0]["summary"] == "SUMMARY-BY-SUMMARIZER" and traj.stop_reason == "done"
    assert sum(len(s.completions) for s in traj.segments) == 4  # the summariser's tokens are not trainable
    cfg = AgentConfig(context=ContextConfig(budget_tokens=1200, trigger=0.5, mode="truncate"))
    traj = run_agent(buggy_repo, ScriptedPolicy(_long_session(3) + [{"content": "done"}]), cfg)
    assert traj.summaries[0]["mode"] == "truncate"
    assert "[output omitted to save context]" in json.dumps(traj.segments[-1].messages)


def test_trajectory_round_trip_and_atif(buggy_repo, tmp_path):
    traj = run_agent(buggy_repo, ScriptedPolicy(FIX_SCRIPT))
    p = traj.save(tmp_path / "t.json")
    again = Trajectory.load(p)
    assert again.to_dict() == traj.to_dict()
    atif = traj.to_atif()
    assert atif["schema_version"] == "ATIF-v1.4"
    assert [s["step_id"] for s in atif["steps"]] == list(range(1, len(atif["steps"]) + 1))
    agent_steps = [s for s in atif["steps"] if s["source"] == "agent"]
    assert len(agent_steps) == 5
    first = agent_steps[0]
    assert {c["function_name"] for c in first["tool_calls"]} == {"grep", "read_file"}
    assert [r["source_call_id"] for r in first["observation"]["results"]] == \
        [c["tool_call_id"] for c in first["tool_calls"]]


# -- OpenAIPolicy over real HTTP ------------------------------------------------------------------


def test_openai_policy_against_an_http_server(buggy_repo):
    turns = [{"tool_calls": [{"name": "read_file", "arguments": {"target_file": "pkg/calc.py"}}], "prompt_tokens": 50},
             {"tool_calls": [{"name": "search_replace", "arguments": {"file_path": "pkg/calc.py",
                                                                      "old_string": "a - b", "new_string": "a + b"}}]},
             {"content": "fixed"}]
    with FakeOpenAIServer(turns) as srv:
        policy = OpenAIPolicy(base_url=srv.base_url, model="fake-model")
        traj = run_agent(buggy_repo, policy)
        req = srv.requests[0]
    assert traj.stop_reason == "done" and "+    return a + b" in traj.diff
    assert {t["function"]["name"] for t in req["tools"]} >= {"read_file", "grep", "run_terminal_cmd"}
    assert req["messages"][0]["role"] == "system" and req["logprobs"] is True
    comp = traj.segments[0].completions[0]
    assert comp["token_ids"] == [100, 101, 102, 103, 104] and comp["logprobs"] == [-0.5] * 5
    assert comp["policy_versions"] == [3] * 5 and comp["usage"]["prompt_tokens"] == 50
    # The tool result went back with the matching tool_call_id.
    second = srv.requests[1]["messages"]
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == second[-2]["tool_calls"][0]["id"]


@pytest.mark.parametrize("served", [None, 2000])
def test_observations_fit_the_served_context(buggy_repo, served):
    """A read of a large file does not push the context past what the server serves: the agent
    asks the server its context length and cuts a turn's outputs to the room left (keeping head
    and tail); a server that says nothing keeps the configured budget (the control)."""
    (buggy_repo / "big.py").write_text("".join(f"VALUE_{i} = {i}  # line {i}\n" for i in range(4000)))
    turns = [{"tool_calls": [{"name": "read_file", "arguments": {"target_file": "big.py"}},
                             {"name": "read_file", "arguments": {"target_file": "pkg/calc.py"}}]},
             {"content": "done"}]
    with FakeOpenAIServer(turns, max_model_len=served) as srv:
        traj = run_agent(buggy_repo, OpenAIPolicy(base_url=srv.base_url, model="fake-model"))
        second = srv.requests[1]["messages"]
    big, calc = second[-2]["content"], second[-1]["content"]
    assert traj.stop_reason == "done" and "return a - b" in calc  # the small output is kept whole
    if served is None:
        assert traj.extra["context_budget"] == ContextConfig().budget_tokens and len(big) > 25_000
    else:
        assert traj.extra["context_budget"] == served
        assert "characters truncated" in big and "VALUE_0 " in big and "lines 1-2000 of 4000" in big  # head, tail
        usage = traj.segments[0].completions[0]["usage"]
        room = (served - ContextConfig().reserve_tokens - usage["prompt_tokens"] - usage["completion_tokens"]) \
            * ContextConfig().chars_per_token
        assert len(big) + len(calc) <= room + 100  # + the truncation marker
        assert sum(len(m.get("content") or "") for m in second) / ContextConfig().chars_per_token < served


def test_a_failed_summary_drops_old_outputs_and_the_episode_goes_on(buggy_repo):
    """The summary request fails (the server refuses it): the context is cut by dropping tool outputs
    (oldest first) until a call fits again, once, not a reset after a reset."""
    (buggy_repo / "big.py").write_text("".join(f"VALUE_{i} = {i}  # line {i}\n" for i in range(4000)))
    grep = {"tool_calls": [{"name": "grep", "arguments": {"pattern": "def add"}}]}
    reads = {"tool_calls": [{"name": "read_file", "arguments": {"target_file": "big.py"}},
                            {"name": "read_file", "arguments": {"target_file": "big.py", "offset": 2001}}]}
    turns = [grep, reads, {"http_error": 400}, {"content": "done"}]
    with FakeOpenAIServer(turns, max_model_len=2000) as srv:
        # reserve 200: the cut read fills the context past the trigger (0.8 of 2,000), so a reset comes
        traj = run_agent(buggy_repo, OpenAIPolicy(base_url=srv.base_url, model="fake-model"),
                         AgentConfig(context=ContextConfig(reserve_tokens=200)))
        sizes = [sum(len(json.dumps(m)) for m in r["messages"]) // 4 for r in srv.requests]
    assert traj.stop_reason == "done" and len(traj.summaries) == 1 and traj.summaries[0]["summary"] is None
    assert "[output omitted to save context]" in json.dumps(traj.segments[-1].messages)
    assert max(sizes) < 2000 and sizes[-1] < 0.8 * 2000  # the summary request fit; after it, under the trigger


def test_openai_policy_errors(buggy_repo):
    with FakeOpenAIServer([{"http_error": 500}] * 5) as srv:
        policy = OpenAIPolicy(base_url=srv.base_url, model="m", max_retries=0)
        with pytest.raises(PolicyError, match="InternalServerError"):
            policy.complete([{"role": "user", "content": "hi"}], [])
        assert resolve_model(srv.base_url) == (srv.base_url, "fake-model")
    with pytest.raises(PolicyError, match="not answering"):
        resolve_model("http://127.0.0.1:9/v1")


def test_cli_agent_with_apply(buggy_repo, tmp_path):
    turns = [{"tool_calls": [{"name": "search_replace", "arguments": {"file_path": "pkg/calc.py",
                                                                      "old_string": "a - b", "new_string": "a + b"}}]},
             {"content": "fixed"}]
    with FakeOpenAIServer(turns) as srv:
        r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "agent", "fix add", "--repo", str(buggy_repo),
                            "--model", srv.base_url, "--apply", "--out", str(tmp_path / "runs")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "+    return a + b" in r.stdout and "search_replace" in r.stderr
    assert "return a + b" in (buggy_repo / "pkg" / "calc.py").read_text()
    (run,) = list((tmp_path / "runs").iterdir())
    assert (run / "trajectory.json").exists() and (run / "trajectory.atif.json").exists()


def test_parallel_same_file_edits_equal_running_them_in_order(tmp_path):
    """Many edits of one file in one turn, mixed with reads and shell commands: nothing is lost, and
    the diff equals the one from running the calls one by one."""
    repo = tmp_path / "r"
    repo.mkdir()
    lines = [f"value_{i} = {i}" for i in range(14)]
    (repo / "m.py").write_text("\n".join(lines) + "\n")
    (repo / "n.py").write_text("n = 0\n")
    calls = [{"name": "search_replace", "arguments": {"file_path": "m.py", "old_string": f"value_{i} = {i}",
                                                      "new_string": f"value_{i} = {i * 10}"}} for i in range(2, 14, 2)]
    calls.insert(2, {"name": "read_file", "arguments": {"target_file": "m.py"}})
    calls.insert(4, {"name": "run_terminal_cmd", "arguments": {"command": "echo shell >> n.py"}})
    calls += [{"name": "search_replace", "arguments": {"file_path": "./m.py", "old_string": "value_1 = 1\n",
                                                       "new_string": "value_1 = -1\n"}},
              {"name": "search_replace", "arguments": {"file_path": "n.py", "old_string": "shell",
                                                       "new_string": "shell edited"}},
              {"name": "write_file", "arguments": {"file_path": "o.py", "contents": "o = 1\n"}}]
    script = [{"tool_calls": calls}, {"content": "done"}]
    par = run_agent(repo, ScriptedPolicy(script), AgentConfig(parallel_tool_calls=True, max_parallel=8))
    seq = run_agent(repo, ScriptedPolicy(script), AgentConfig(parallel_tool_calls=False))
    assert par.tool_errors == 0 and seq.tool_errors == 0
    assert par.diff == seq.diff and par.diff.count("\n+value_") == 7 and "+shell edited" in par.diff


def test_ctrl_c_keeps_the_trajectory(buggy_repo, tmp_path):
    """SIGINT (Ctrl-C) and SIGTERM while the model is thinking: the CLI exits 130 and the trajectory
    so far (the first turn's tool call and its result) is on disk."""
    import signal
    import time

    for sig in (signal.SIGINT, signal.SIGTERM):
        turns = [{"tool_calls": [{"name": "read_file", "arguments": {"target_file": "pkg/calc.py"}}]},
                 {"content": "slow", "delay_s": 30}]
        out = tmp_path / f"runs-{sig}"
        with FakeOpenAIServer(turns) as srv:
            p = subprocess.Popen([sys.executable, "-m", "opencomposer.cli", "agent", "fix add", "--repo",
                                  str(buggy_repo), "--model", srv.base_url, "--out", str(out)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=foreground_sigint)
            deadline = time.monotonic() + 120
            while len(srv.requests) < 2 and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.05)
            assert len(srv.requests) == 2
            p.send_signal(sig)
            _, err = p.communicate(timeout=60)
        assert p.returncode == 130, err
        (traj_file,) = list(out.glob("*/trajectory.json"))
        traj = Trajectory.load(traj_file)
        assert traj.stop_reason == "interrupted" and traj.turns == 1 and traj.tool_calls[0].name == "read_file"
        assert traj.segments and any(m["role"] == "tool" for m in traj.segments[0].messages)
