"""The asynchronous RL loop end to end, small: a tiny real model (taught by SFT to either fix a real
colorsys bug with `search_replace` or stop at once) served by our server, acting through the real
harness in real sandboxes, graded by colorsys' own tests, trained by Dr. GRPO with weights shipped
through the weight store every step.

- It learns: the pass rate after RL beats the same run with learning rate 0 (same seeds), measured
  through the same harness and server. (The task family here is one task, trained and measured on
  the same prompt; the held-out proof on the embedded default is the slow test's and docs/rl.md's.)
- The reconciler's invariants, read back from the event log: every sample moved through its states
  in order, every group was trained once, the replica followed the trainer's versions.
- Faults: the trainer killed mid-run (SIGKILL) resumes with nothing trained twice and no finished
  group lost; an inference replica that dies is replaced and its samples are rolled out again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from opencomposer.rl.events import read_events  # noqa: E402
from opencomposer.rl.loop import RLConfig, Run  # noqa: E402
from opencomposer.rl.objective import ObjectiveConfig  # noqa: E402
from opencomposer.rl.rewards import RewardConfig  # noqa: E402
from opencomposer.rl.trainer import TrainerConfig  # noqa: E402
from tests.integration.rl_family import TEMPERATURE, TOOLS, build_family  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
LR = 2e-4


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("rl-family"))


def config(family, lr: float, steps: int = STEPS, **kw) -> RLConfig:
    tasks, model = family
    return RLConfig(model=model, tasks=tasks, split=None, eval_split=None, evaluate=True, eval_samples=16,
                    steps=steps, epochs=steps, tools=TOOLS, temperature=TEMPERATURE, turn_tokens=400, max_turns=3,
                    workers=2, objective=ObjectiveConfig(group_size=4, normalizer=256.0, kl_coef=0.0),
                    trainer=TrainerConfig(lr=lr), rewards=RewardConfig(effort=0.0), **kw)


def check_invariants(out: Path, steps: int) -> list[dict]:
    events = read_events(out / "events.jsonl")
    order = {"queued": 0, "rolling_out": 1, "grading": 2, "grouped": 3, "trained": 4}
    by_sample: dict[str, list[str]] = {}
    for e in events:
        if "sample" in e:
            by_sample.setdefault(e["sample"], []).append(e["kind"])
    trained = [s for s, ks in by_sample.items() if "trained" in ks]
    for s in trained:  # the last attempt's states run forward, and training happens once
        ks = by_sample[s]
        last = ks[len(ks) - 1 - ks[::-1].index("queued"):]
        assert [order[k] for k in last] == sorted(order[k] for k in last), (s, ks)
        assert ks.count("trained") == 1, (s, ks)
    step_groups = [g for e in events if e["kind"] == "step" for g in e["groups"]]
    assert len(step_groups) == len(set(step_groups)) == steps  # every group trained exactly once
    # a version is a change of weights: a step that trained nothing keeps the version it had
    version = None
    for e in events:
        if e["kind"] in ("run_started", "republished"):  # a (re)start's checkpoint; a full snapshot's number
            version = e["version"]
        elif e["kind"] == "step":
            assert e["version"] == version + e["updated"], e
            version = e["version"]
    return events


def updates(out: Path) -> int:
    """Steps that changed the weights (each one a published version)."""
    return sum(e["updated"] for e in read_events(out / "events.jsonl") if e["kind"] == "step")


@pytest.mark.timeout(1200)
def test_rl_raises_the_pass_rate_against_its_lr0_control(family, tmp_path):
    trained = Run(config(family, LR), tmp_path / "trained").run()
    control = Run(config(family, 0.0), tmp_path / "control").run()
    t0, t1 = trained["eval_start"]["accuracy"], trained["eval_end"]["accuracy"]
    c0, c1 = control["eval_start"]["accuracy"], control["eval_end"]["accuracy"]
    print(f"pass rate: trained {t0:.2f} -> {t1:.2f}; lr=0 control {c0:.2f} -> {c1:.2f}")
    assert t1 >= c1 + 0.25 and t1 > t0
    # measured on the trained weights, through the store
    assert trained["eval_end"]["version"] == updates(tmp_path / "trained")
    for out in (tmp_path / "trained", tmp_path / "control"):
        events = check_invariants(out, STEPS)
        steps = [e for e in events if e["kind"] == "step"]
        assert all(e["replica_version"] >= e["version"] - 2 for e in steps)  # the replica kept up
        assert all(e["delta_bytes"] < e["full_bytes"] for e in steps if e["updated"])  # deltas, not snapshots
    # the trainer and the replica process split the cores rather than each taking all of them
    started = next(e for e in read_events(tmp_path / "trained" / "events.jsonl") if e["kind"] == "run_started")
    cpus = len(os.sched_getaffinity(0))
    assert started["threads"] == {"trainer": max(1, cpus // 2), "replica": max(1, cpus - max(1, cpus // 2)),
                                  "lent": cpus >= 2, "borrowed": cpus >= 2}
    rows = [json.loads(line) for line in (tmp_path / "trained" / "metrics.jsonl").read_text().splitlines()]
    if cpus >= 2:  # the replica held the trainer's threads while the first group rolled out (POST /admin/threads)
        assert rows[0]["lent_seconds"] > 0
    assert {"reward", "pass_rate", "kl_per_token", "staleness", "tool_calls", "zero_advantage_groups",
            "edit_rate", "broken_calls", "ratio_max", "truncated", "borrowed_seconds"} <= set(rows[0])
    # how far off-policy the trained tokens were: float32 trainer, so the trainer's ratio to the sampler
    # stays near 1 (staleness and engine batching only), and the step says it did not autocast
    assert all(r["bf16"] is False and 0 < r["ratio_max"] < 100 for r in rows if r["updated"])


def _group_alive(pgid: int) -> list[str]:
    """Command lines of the live processes in process group `pgid`, with their states."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.getpgid(int(d.name)) == pgid:
                stat = (d / "stat").read_text()
                state = stat.rsplit(")", 1)[1].split()[0]
                if state != "Z":  # with the state and where each thread sleeps in the kernel
                    wchan = sorted({(t / "wchan").read_text() for t in (d / "task").iterdir()})
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                    out.append(f"{cmd} [{state}, {len(wchan)} distinct wchan: {','.join(wchan)[:200]}]")
        except (OSError, IndexError):
            continue
    return out


@pytest.mark.timeout(1200)
def test_a_killed_trainer_resumes_and_a_dead_replica_is_replaced(family, tmp_path):
    out = tmp_path / "run"
    # spare groups and attempts: a sample may fail twice here (the dead replica, then the dead worker)
    cfg = dataclasses.replace(config(family, LR, steps=4), evaluate=False, max_inflight_groups=3, epochs=6,
                              max_attempts=3)
    toml = tmp_path / "rl.toml"
    toml.write_text("\n".join([f'model = "{cfg.model}"', f'tasks = "{cfg.tasks}"', "steps = 4", "epochs = 6",
                               "max_attempts = 3",
                               "evaluate = false", "max_inflight_groups = 3", 'tools = ["search_replace"]',
                               "turn_tokens = 400", "max_turns = 3", f"temperature = {TEMPERATURE}", "[trainer]",
                               f"lr = {LR}", "[objective]",
                               "group_size = 4", "normalizer = 256.0", "kl_coef = 0.0", "[rewards]", "effort = 0.0"])
                    + "\n")
    cmd = [sys.executable, "-m", "opencomposer.cli", "rl", "-c", str(toml), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # kill it right after its first step
        if any(e["kind"] == "step" for e in read_events(out / "events.jsonl")):
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # the driver alone: its services must not outlive it
    proc.wait(30)
    deadline = time.monotonic() + 120
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _group_alive(proc.pid)
    if left:  # what they were doing, for the next one who reads this failure
        log = out / "services" / "replica.log"
        tail = log.read_bytes()[-1500:].decode("utf-8", "replace") if log.exists() else "(no replica log)"
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"processes outlived the killed driver: {left}\nreplica log:\n{tail}")
    before = read_events(out / "events.jsonl")
    grouped_before = {e["group"] for e in before if e["kind"] == "grouped"}
    trained_before = {g for e in before if e["kind"] == "step" for g in e["groups"]}
    assert trained_before and before[-1]["kind"] != "run_finished"

    # the second invocation resumes in-process; its replica process is SIGKILLed after the next step
    # and a rollout worker process after the one after
    run = Run(cfg, out)
    killed = []

    def kill_services(rec):
        if rec["step"] == 2:
            run.replica.kill()
        if rec["step"] == 3:
            procs = list(run.workers._executor._processes.values())
            os.kill(procs[0].pid, signal.SIGKILL)
            killed.append(procs[0].pid)

    run.progress = kill_services
    summary = run.run()
    assert summary["version"] == updates(out) and summary["trained_groups"] == 4
    events = check_invariants(out, 4)
    after = events[len(before):]
    # groups finished before the kill were loaded from their checkpoints, not rolled out again
    requeued = {e["group"] for e in after if e["kind"] == "queued"}
    assert not (grouped_before & requeued)
    assert any(e["kind"] == "replica_restarted" for e in after)
    assert killed and [e["replaced"] for e in after if e["kind"] == "worker_replaced"] == [1]
    failed = [e for e in after if e["kind"] == "failed"]
    assert all(any(w in e["reason"] for w in ("engine", "Connection", "policy", "BrokenProcessPool"))
               for e in failed), failed


class FirstCallFault:
    """The policy under test, except that its first turn is drawn again (a new seed each time, at
    most 40 draws) until it calls a tool, and `fault(completion)` is applied to that turn. The
    tiny model calls a tool 30-50% of the time: without redrawing, a fault meant for a tool call
    would find none now and then. Every turn returned is one the sampler produced, ids and all."""

    def __init__(self, policy):
        self.policy, self.calls = policy, 0
        self.name = policy.name

    def fault(self, c):
        return c

    def complete(self, messages, tools):
        c = self.policy.complete(messages, tools)
        self.calls += 1
        if self.calls == 1:
            for _ in range(40):
                if c.tool_calls:
                    return self.fault(c)
                c = self.policy.complete(messages, tools)
        return c

    def __getattr__(self, name):
        return getattr(self.policy, name)


class MalformedFirstCall(FirstCallFault):
    """The first tool call's arguments come back cut short (a malformed call, as a model emits one);
    the sampled token ids are untouched."""

    def fault(self, c):
        cut = tuple(dataclasses.replace(t, arguments=t.arguments[: len(t.arguments) // 2]) for t in c.tool_calls)
        return dataclasses.replace(c, tool_calls=cut)


class KillsItsToolServer(FirstCallFault):
    """Before the first tool call runs, the sandbox tool servers this test process started are
    SIGKILLed (a sandbox process dying mid-rollout); nothing outside this process tree is touched."""

    def fault(self, c):
        for pid in _descendants(os.getpid()):
            try:
                if b"sandbox/toolserver.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        return c


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.timeout(1200)
def test_injected_faults_are_recorded_and_the_run_goes_on(family, tmp_path, monkeypatch):
    """One run, five faults: a rollout worker that dies, a task whose verifier hangs, a policy
    that emits a malformed tool call, a sandbox whose tool server is killed mid-rollout, a weight
    delta corrupted in the store. Each is in the event log; nothing is trained twice; the run ends
    with every step trained."""
    import re
    import shutil

    from opencomposer.inference.weight_store import WeightStore, _name
    from opencomposer.rl import loop

    tasks_dir, model = family
    tasks = tmp_path / "tasks"
    (good,) = [p for p in tasks_dir.iterdir() if (p / "task.toml").exists()]
    shutil.copytree(good, tasks / good.name, symlinks=True)
    hang = tasks / f"hang-{good.name}"
    shutil.copytree(good, hang, symlinks=True)
    head, verifier = (hang / "task.toml").read_text().split("[verifier]")
    verifier = re.sub(r'command = ".*"', 'command = "sleep 600"', verifier, count=1)
    verifier = re.sub(r"timeout_s = [0-9.]+", "timeout_s = 3", verifier, count=1)
    (hang / "task.toml").write_text(head.replace(f'id = "{good.name}"', f'id = "hang-{good.name}"')
                                    + "[verifier]" + verifier)

    real_rollout, real_publish = loop.run_rollout, WeightStore.publish
    died, corrupted = [], []

    def faulty_rollout(task, sample, policy, *a, **kw):
        if sample.id == "g0.1" and not died:
            died.append(sample.id)
            raise RuntimeError("injected: the worker died")
        if sample.group in (1, 2) and sample.index < 2:  # half the group: its rewards differ, so it trains
            policy = MalformedFirstCall(policy)
        if sample.id == "g3.0":
            policy = KillsItsToolServer(policy)
        return real_rollout(task, sample, policy, *a, **kw)

    def corrupting_publish(self, state, version, **kw):
        m = real_publish(self, state, version, **kw)
        if m["kind"] == "delta" and not corrupted:  # flip a byte mid-blob: the checksum must catch it
            corrupted.append(version)
            blob = f"{self.root}/{_name(version)}/tensors.zst"
            data = bytearray(self.fs.cat_file(blob))
            data[len(data) // 2] ^= 0xFF
            self.fs.pipe_file(blob, bytes(data))
        return m

    monkeypatch.setattr(loop, "run_rollout", faulty_rollout)
    monkeypatch.setattr(WeightStore, "publish", corrupting_publish)
    # threads: the faults are injected by patching this process's rollout function and store
    cfg = dataclasses.replace(config(family, LR, steps=4), tasks=tasks, evaluate=False, epochs=3, services="threads")
    out = tmp_path / "run"
    summary = Run(cfg, out).run()
    events = read_events(out / "events.jsonl")
    steps = [e for e in events if e["kind"] == "step"]
    assert summary["trained_groups"] == 4 and len(steps) == 4
    groups = [g for e in steps for g in e["groups"]]
    assert len(groups) == len(set(groups))  # nothing trained twice
    trained = [e["sample"] for e in events if e["kind"] == "trained"]
    assert len(trained) == len(set(trained)) == 16
    # the dead worker: recorded with its reason, its sample rolled out again and trained once
    failed = [e for e in events if e["kind"] == "failed"]
    assert any(e["sample"] == "g0.1" and "injected: the worker died" in e["reason"] for e in failed)
    assert [e["attempt"] for e in events if e["kind"] == "queued" and e["sample"] == "g0.1"] == [1, 2]
    # the hanging verifier: graded (failed) within its deadline, not waited on
    grouped = {e["sample"]: e for e in events if e["kind"] == "grouped"}
    grading = {e["sample"]: e["started"] for e in events if e["kind"] == "grading"}
    hung = [s for s, e in grouped.items() if e["task"].startswith("hang-")]
    assert hung and all(not grouped[s]["passed"] for s in hung)
    assert all(grouped[s]["t"] - grading[s] < 60 for s in hung)
    # the malformed calls: executed as broken calls, counted in the samples' reward terms
    malformed = [e for s, e in grouped.items() if e["group"] in (1, 2) and int(s.split(".")[1]) < 2]
    assert malformed and all(e["broken_calls"] >= 1 for e in malformed)
    # the killed tool server: the sandbox started a new one, the rollout went on and was trained
    restarted = [e for e in events if e["kind"] == "sandbox_restarted"]
    assert "g3.0" in {e["rollout"] for e in restarted} and "g3.0" in grouped  # graded, not failed
    # the corrupt delta: refused by the replica, answered with a full snapshot, the run went on
    rejected = [e for e in events if e["kind"] == "weights_rejected"]
    republished = [e for e in events if e["kind"] == "republished"]
    assert rejected and "corrupt" in rejected[0]["error"] and republished
    assert republished[0]["kind_of"] == "full"
    assert summary["version"] == updates(tmp_path / "run") + 1  # the steps that trained + the full snapshot
    assert len(republished) == 1  # one answer: the replica loads it and follows the deltas again
    # a group the lag made too stale is dropped with its reason, never trained
    assert all("stale" in e["reason"] for e in events if e["kind"] == "group_failed")


@pytest.mark.timeout(600)
def test_a_time_budget_ends_the_run_at_a_step_boundary(family, tmp_path):
    """`minutes`: no step starts once the budget is spent; the run still exports its policy."""
    cfg = dataclasses.replace(config(family, LR, steps=50), evaluate=False, minutes=0.01, services="threads")
    summary = Run(cfg, tmp_path / "run").run()
    assert len(summary["steps"]) == 1 and "time budget" in summary["stopped"]  # the first step, then no more
    assert summary["version"] == summary["steps"][0]["updated"]
    assert (tmp_path / "run" / "model" / "config.json").exists()


def _ray_rollout_workers() -> list[int]:
    """Pids of Ray worker processes running a rollout now (Ray titles a busy worker ray::<task>)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "cmdline").read_bytes().startswith(b"ray::_ray_rollout"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


@pytest.mark.timeout(1200)
def test_the_ray_backend_runs_the_loop_and_replaces_what_dies(family, tmp_path, monkeypatch):
    """`services = "ray"` on a local Ray cluster: the replica is a Ray actor's process, rollouts
    and held-out evaluations are Ray tasks. The replica's actor is killed after the first step and,
    after the second, the first Ray worker seen in a rollout; both are replaced, nothing is trained
    twice.

    The rollout worker is killed from a thread, not from the step's callback: on a busy machine the
    groups in flight at the second step had all finished by then (the trainer is slower there than
    the rollouts), and the loop dispatches the next group only once the callback returns. With four
    steps, a group dispatched after the second step is one a later step trains, so its killed rollout
    is collected, retried and recorded."""
    import ray  # a test dependency (pyproject): a missing install fails here, it is not skipped

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = dataclasses.replace(config(family, LR, steps=4), eval_samples=4, max_inflight_groups=2, epochs=6,
                              max_attempts=3, services="ray")
    run = Run(cfg, tmp_path / "run")
    killed = []

    def kill_a_rollout_worker():
        deadline = time.monotonic() + 300
        while not (busy := _ray_rollout_workers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if busy:
            os.kill(busy[0], signal.SIGKILL)
            killed.append(busy[0])

    killer = threading.Thread(target=kill_a_rollout_worker, daemon=True)

    def kill_services(rec):
        if rec["step"] == 1:
            run.replica.kill()
        if rec["step"] == 2:
            killer.start()

    run.progress = kill_services
    summary = run.run()
    killer.join(timeout=5)
    assert killed, "no Ray worker was seen in a rollout after the second step"
    assert summary["version"] == updates(tmp_path / "run") and summary["trained_groups"] == 4
    assert summary["eval_start"]["episodes"] == 4 and summary["eval_end"]["version"] == summary["version"]
    events = check_invariants(tmp_path / "run", 4)
    assert [e["services"] for e in events if e["kind"] == "run_started"] == ["ray"]
    assert any(e["kind"] == "replica_restarted" for e in events)
    assert killed and any(e["kind"] == "worker_replaced" and "WorkerCrashed" in e["reason"] for e in events)
    # only the killed rollout failed: the others on the cluster went on
    assert [e for e in events if e["kind"] == "failed" and "worker died" in e["reason"]] == \
        [e for e in events if e["kind"] == "failed" and "WorkerCrashed" in e["reason"]]
    assert not ray.is_initialized()  # the local cluster it started is shut down with the loop
    assert not _ray_rollout_workers()
