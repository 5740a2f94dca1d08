"""The speedrun's harness stage: the agent loop, end to end, on real code in a sandbox.

Until the model and inference stages exist, the policy is an *oracle script* (`ScriptedPolicy`)
that solves a planted bug the way an agent would — search, read, edit, run the tests — through
the same tools, sandbox RPC, loop and trajectory format that RL and evals use. The stage checks
that the edit fixed the real test suite, that broken tool calls were recorded as such, and writes
the trajectory (and its ATIF export) into the run folder. When a policy URL is configured, the
same stage runs that model instead of the oracle.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.rundir import RunDir
from opencomposer.harness.agent import Agent, AgentConfig
from opencomposer.harness.index import CodeIndex
from opencomposer.harness.policy import Policy, ScriptedPolicy
from opencomposer.sandbox.base import SandboxConfig
from opencomposer.sandbox.local import Workspace
from opencomposer.sandbox.stage import BREAK, TEST_CMD, make_json_workspace

TASK = "JSON strings come out unquoted from the pure-Python encoder. Fix it."


@dataclass(frozen=True, kw_only=True, slots=True)
class HarnessStageConfig:
    enabled: bool = True
    policy_url: str | None = None
    """An OpenAI-compatible server to run instead of the oracle script (…/v1)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def oracle_script() -> list[dict]:
    """What a competent agent does for TASK; includes one malformed call, which must be counted."""
    ctx = "return ESCAPE_DCT[match.group(0)]\n    "  # makes the edit's old_string unique
    bad, good = ctx + BREAK[1], ctx + BREAK[0]
    return [
        {"tool_calls": [{"name": "codebase_search", "arguments": {"query": "encode basestring quote string"}},
                        {"name": "grep", "arguments": {"pattern": "def py_encode_basestring\\b", "path": "json"}}]},
        {"tool_calls": [{"name": "read_file", "arguments": {"target_file": "json/encoder.py", "offset": 30,
                                                            "limit": 25}},
                        {"name": "read_file", "arguments": "{\"target_file\": "}]},  # truncated JSON
        {"tool_calls": [{"name": "todo_write", "arguments": {"todos": [
            {"id": "1", "content": "restore quoting in py_encode_basestring", "status": "in_progress"},
            {"id": "2", "content": "run test_json", "status": "pending"}]}}]},
        {"tool_calls": [{"name": "search_replace", "arguments": {"file_path": "json/encoder.py", "old_string": bad,
                                                                 "new_string": good}}]},
        {"tool_calls": [{"name": "run_terminal_cmd", "arguments": {"command": TEST_CMD, "timeout_s": 300}},
                        {"name": "read_lints", "arguments": {"paths": ["json/encoder.py"]}}]},
        {"tool_calls": [{"name": "todo_write", "arguments": {"merge": True, "todos": [
            {"id": "1", "status": "completed"}, {"id": "2", "status": "completed"}]}}]},
        {"content": "py_encode_basestring returned the raw string; it quotes and escapes again and test_json passes."},
    ]


def run(cfg: HarnessStageConfig, run_dir: RunDir, metrics: MetricsWriter, policy: Policy | None = None) -> dict:
    if policy is None and cfg.policy_url:
        from opencomposer.harness.openai_policy import OpenAIPolicy, resolve_model

        base_url, model = resolve_model(cfg.policy_url)
        policy = OpenAIPolicy(base_url=base_url, model=model)
    policy = policy or ScriptedPolicy(oracle_script(), name="oracle-script")
    out = run_dir.stage("harness")
    with tempfile.TemporaryDirectory(prefix="oc-harness-ws-") as tmp:
        src = make_json_workspace(Path(tmp))
        enc = src / "json" / "encoder.py"
        enc.write_text(enc.read_text().replace(BREAK[0], BREAK[1], 1))  # the planted bug
        with Workspace(src, cfg.sandbox) as ws, ws.sandbox() as sb:
            before = sb.exec(TEST_CMD, timeout_s=300).stdout.strip()
            t0 = time.perf_counter()
            agent = Agent(policy, sb, cfg.agent, index=CodeIndex.build(src, workdir=sb.config.workdir))
            traj = agent.run(TASK)
            seconds = time.perf_counter() - t0
        with Workspace(src, cfg.sandbox) as ws, ws.sandbox() as check:
            # Grade in a fresh sandbox: apply the agent's diff to the original state and rerun the tests.
            check.write_file(".git/agent.diff", traj.diff)
            applied = check.exec("git apply .git/agent.diff", timeout_s=60)
            after = check.exec(TEST_CMD, timeout_s=300).stdout.strip()
    traj.save(out / "trajectory.json")
    (out / "trajectory.atif.json").write_text(json.dumps(traj.to_atif(), indent=1))
    summary = {
        "policy": policy.name,
        "task": TASK,
        "stop_reason": traj.stop_reason,
        "turns": traj.turns,
        "tool_calls": len(traj.tool_calls),
        "tool_errors": traj.error_types,
        "parallel_turns": sum(1 for s in traj.segments for c in s.completions if len(c["tool_calls"]) > 1),
        "tests_before": before.splitlines()[-1] if before else "",
        "tests_after": after.splitlines()[-1] if after else "",
        "diff_applies": applied.exit_code == 0,
        "fixed": applied.exit_code == 0 and after.endswith(("OK", "OK (skipped=1)")) and "FAILED" in before,
        "diff_lines": sum(1 for ln in traj.diff.splitlines() if ln.startswith(("+", "-"))
                          and not ln.startswith(("+++", "---"))),
        "seconds": seconds,
        "tool_seconds": traj.tool_seconds,
    }
    run_dir.write_json("harness/summary.json", summary)
    metrics.log(stage="harness", fixed=summary["fixed"], turns=traj.turns, tool_errors=traj.tool_errors,
                seconds=seconds)
    return summary
