"""The eval runner: the harness on every task, in sandboxes, in parallel, resumably.

    opencomposer eval run --tasks DIR --model URL|oracle|noop --passes K --concurrency N

Each (task, pass) is one episode: a sandbox over the task's repository (through a `SandboxPool`),
the task's setup, the same `Agent` RL uses, then grading in a fresh fork of the final state. One
JSON line per episode goes to `results.jsonl` as soon as it finishes, so an interrupted run resumes
where it stopped; trajectories go to `trajectories/`. `summary.json` and `report.html` follow.

Built-in policies calibrate a dataset: `oracle` applies the gold change through the harness's own
edit tools and must score 100%; `noop` answers at once and must score 0%.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.core.metrics import read_jsonl
from opencomposer.evals import metrics
from opencomposer.harness.agent import Agent, AgentConfig
from opencomposer.harness.index import CodeIndex
from opencomposer.harness.openai_policy import OpenAIPolicyConfig
from opencomposer.harness.policy import Policy, ScriptedPolicy
from opencomposer.sandbox.base import SandboxConfig, SandboxError
from opencomposer.sandbox.local import Workspace
from opencomposer.sandbox.pool import PoolConfig, SandboxPool
from opencomposer.tasks.format import Task, load_dataset
from opencomposer.tasks.grade import grade_sandbox
from opencomposer.tasks.patch import hunks_by_file, post_images

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    tasks: Path
    split: str | None = None
    passes: int = 1
    concurrency: int = 2
    max_tasks: int | None = None
    agent: AgentConfig = field(default_factory=AgentConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    policy: OpenAIPolicyConfig = field(default_factory=OpenAIPolicyConfig)
    """Sampling settings of a served policy (temperature, top_p, max_tokens per turn); base_url and
    model come from `--model`."""


def oracle_policy(task: Task, k: int = 0) -> Policy:
    """Applies the gold change through the harness's own edit tools, in one turn of parallel calls
    (`oracle_calls`)."""
    return ScriptedPolicy([{"tool_calls": oracle_calls(task)}], name="oracle", final="Applied the reference change.")


def oracle_calls(task: Task) -> list[dict]:
    """The gold change as tool calls: `search_replace` per diff hunk (compact, so even a large file
    stays far inside the context budget), `write_file` for new files or where a hunk is not unique,
    `delete_file` for deletions."""
    calls = []
    images = post_images(task.repo, task.reference_patch)
    hunks = hunks_by_file(task.reference_patch)
    for path, content in images.items():
        if content is None:
            calls.append({"name": "delete_file", "arguments": {"target_file": path}})
            continue
        edits = _edits(task.repo / path, hunks.get(path, []))
        if edits is not None:
            calls += [{"name": "search_replace", "arguments": {"file_path": path, "old_string": old,
                                                               "new_string": new}} for old, new in edits]
            continue
        try:
            calls.append({"name": "write_file", "arguments": {"file_path": path, "contents": content.decode()}})
        except UnicodeDecodeError:  # a binary file: through the shell, still a harness tool
            b64 = base64.b64encode(content).decode()
            calls.append({"name": "run_terminal_cmd",
                          "arguments": {"command": f"mkdir -p \"$(dirname '{path}')\" && echo {b64} | base64 -d > '{path}'"}})
    return calls


def _edits(path: Path, hunks: list[tuple[str, str]]) -> list[tuple[str, str]] | None:
    """The hunks as (old, new) replacements if each old text is unique when it is applied; else None."""
    if not hunks or not path.is_file():
        return None
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return None
    for old, new in hunks:
        if not old or text.count(old) != 1:
            return None
        text = text.replace(old, new, 1)
    return hunks


def noop_policy(task: Task, k: int = 0) -> Policy:
    return ScriptedPolicy([{"content": "Nothing to do."}], name="noop")


def policy_factory(model: str, model_name: str | None = None,
                   config: OpenAIPolicyConfig | None = None) -> Callable[[Task, int], Policy]:
    if model == "oracle":
        return oracle_policy
    if model == "noop":
        return noop_policy
    if model == "demonstration":
        from opencomposer.evals.demonstration import demonstration_policy

        return demonstration_policy
    from opencomposer.harness.openai_policy import OpenAIPolicy, resolve_model

    base_url, name = resolve_model(model, model_name)
    config = config or OpenAIPolicyConfig()
    if config.seed is None:
        shared = OpenAIPolicy(config, base_url=base_url, model=name)
        return lambda task, k=0: shared
    # Seeded: one policy per episode, drawing from a seed of (task, pass), so the K passes of a task
    # differ and a rerun or a resumed run draws the same tokens whatever ran before it.
    return lambda task, k=0: OpenAIPolicy(config, base_url=base_url, model=name,
                                          seed=episode_seed(config.seed, task.id, k))


def episode_seed(seed: int, task_id: str, k: int) -> int:
    import zlib

    return seed + 10**6 * (zlib.crc32(task_id.encode()) % 10**6) + 10**4 * k


def run_episode(task: Task, k: int, policy: Policy, cfg: EvalConfig, pool: SandboxPool, traj_dir: Path,
                split: str | None, judge: Policy | None = None, stop: threading.Event | None = None) -> dict:
    """One episode. Never raises for the episode's own failures: any exception becomes an
    `infra_error` record with its reason, so one broken task cannot end an eval. The trajectory is
    on disk before grading starts (and again, with the grade, after). An episode ended by `stop`
    is `interrupted` and not graded: a resumed eval runs it again."""
    t0 = time.perf_counter()
    rec = {"task": task.id, "pass": k, "category": task.spec.category, "split": split, "policy": policy.name,
           "passed": False, "status": "infra_error", "detail": "", "turns": 0, "prompt_tokens": 0,
           "completion_tokens": 0, "cost_usd": 0.0, "tool_calls": 0, "tool_errors": 0, "stop_reason": "",
           "seconds": 0.0, "grade_seconds": 0.0}
    path = traj_dir / f"{task.id}.{k}.json"
    try:
        with Workspace(task.repo, task.sandbox_config(cfg.sandbox)) as ws, pool.acquire(ws, deadline_s=3600) as sb:
            for cmd in task.spec.setup:
                r = sb.exec(cmd, timeout_s=600)
                if not r.ok:
                    rec["detail"] = f"setup {cmd!r} failed: {r.stderr.strip()[:300]}"
                    return rec
            agent = Agent(policy, sb, cfg.agent, index=CodeIndex.build(task.repo, workdir=sb.config.workdir),
                          stop=stop)
            traj = agent.run(task.prompt, save_to=path)
            rec["seconds"] = time.perf_counter() - t0
            # a tool server that died mid-episode and was started again (the sandbox does it itself)
            rec["sandbox_restarts"] = int(sb.stats().get("server_restarts", 0))
            rec.update(turns=traj.turns, prompt_tokens=traj.prompt_tokens, completion_tokens=traj.completion_tokens,
                       cost_usd=traj.cost_usd, tool_calls=len(traj.tool_calls), tool_errors=traj.tool_errors,
                       stop_reason=traj.stop_reason)
            if traj.stop_reason == "interrupted":
                rec.update(status="interrupted", detail="the eval was stopped during this episode")
                return rec
            t1 = time.perf_counter()
            grade = grade_sandbox(task, sb)
            rec["grade_seconds"] = time.perf_counter() - t1
        traj.extra["grade"] = grade.to_dict()
        traj.save(path)
        rec.update(passed=grade.passed, status=grade.status, detail=grade.detail[:500])
        if judge is not None and traj.diff:
            from opencomposer.tasks.rubric import grade_rubric

            rubric = grade_rubric(judge, task.prompt, traj.diff)
            rec.update(rubric=rubric.mean, rubric_scores=rubric.scores, rubric_error=rubric.error)
        if traj.stop_reason.startswith("policy_error"):
            rec.update(passed=False, status="infra_error", detail=traj.stop_reason[:500])
    except Exception as e:  # noqa: BLE001 - recorded with its reason; the eval goes on
        if not isinstance(e, (SandboxError, OSError)):
            log.exception("episode %s.%d failed", task.id, k)
        rec["detail"] = f"{type(e).__name__}: {e}"[:500]
    rec["seconds"] = rec["seconds"] or time.perf_counter() - t0
    return rec


NOT_DONE = ("infra_error", "interrupted")


def run_eval(cfg: EvalConfig, factory: Callable[[Task, int], Policy], out: Path,
             progress: Callable[[dict], None] | None = None, judge: Policy | None = None) -> dict:
    """Run every (task, pass) not yet in `out/results.jsonl`; `judge` adds rubric scores (tasks/rubric.py).
    Ctrl-C stops the agents before their next call, keeps every finished result (each is flushed
    as it ends) and re-raises; running it again skips what was done."""
    if cfg.passes < 1 or cfg.concurrency < 1:
        raise ValueError("passes and concurrency must be >= 1")
    tasks = load_dataset(cfg.tasks, cfg.split)[: cfg.max_tasks]
    if not tasks:
        raise ValueError(f"no tasks in {cfg.tasks} (split {cfg.split})")
    split_of = _splits(cfg.tasks)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {(r["task"], r["pass"]) for r in read_jsonl(results) if r.get("status") not in NOT_DONE}
    jobs = [(t, k) for t in tasks for k in range(cfg.passes) if (t.id, k) not in done]
    lock = threading.Lock()
    stop = threading.Event()
    pool = SandboxPool(PoolConfig(max_concurrent=max(2, cfg.concurrency), max_load_per_cpu=None))
    ex = ThreadPoolExecutor(cfg.concurrency)
    written: set[int] = set()

    def record(i: int, rec: dict, f) -> None:
        if i in written or rec["status"] == "interrupted":
            return
        written.add(i)
        with lock:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if progress:
            progress(rec)

    with results.open("a") as f:
        futs = [ex.submit(run_episode, t, k, factory(t, k), cfg, pool, out / "trajectories", split_of.get(t.id),
                          judge, stop) for t, k in jobs]
        index = {fut: i for i, fut in enumerate(futs)}
        try:
            for fut in as_completed(futs):
                record(index[fut], fut.result(), f)
        except BaseException:
            stop.set()  # running agents end before their next policy call; queued episodes never start
            ex.shutdown(wait=True, cancel_futures=True)
            for fut in futs:  # episodes that finished while we stopped are results too
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    record(index[fut], fut.result(), f)
            raise
    ex.shutdown(wait=True)
    latest: dict[tuple, dict] = {}
    for r in read_jsonl(results):  # the last record of an episode wins (resumed infra errors)
        latest[(r["task"], r["pass"])] = r
    ids = {t.id for t in tasks}
    records = [r for key, r in latest.items() if key[0] in ids]
    summary = metrics.summarize(records, cfg.passes)
    summary.update(dataset=str(cfg.tasks), split=cfg.split, passes=cfg.passes, concurrency=cfg.concurrency,
                   policy=records[0]["policy"] if records else None)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    from opencomposer.evals.html import write_report

    write_report(out / "report.html", summary, records)
    return summary


def _splits(root: Path) -> dict[str, str]:
    m = Path(root) / "manifest.json"
    if not m.exists():
        return {}
    return {t["id"]: t["split"] for t in json.loads(m.read_text())["tasks"]}
