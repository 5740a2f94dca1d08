"""The asynchronous RL loop (report §3–4, §6.2): a reconciler that moves samples through rollout
workers, grading and grouping to the trainer, a trainer that publishes the weights of every step that
changed them to the weight store (a version is a change of weights: staleness counts those), and an
inference replica that pulls them in flight while it keeps serving.

Services and their boundaries (`rl/services.py`):
- the inference replica is our server (`inference/server.py`, the OpenAI HTTP API) following the
  weight store on its own; rollout workers reach it only over HTTP, the trainer only through the
  store;
- rollout workers run `rl/rollout.py` (harness + sandbox + grading), a function of (task, sample,
  policy URL); the evaluator runs the held-out split against the replica's URL;
- the trainer (`rl/trainer.py`) and the reconciler run in the driver.
With `services = "processes"` (the default) the replica, every rollout worker and the evaluator are
processes of their own; `"threads"` runs them in the driver. A Ray backend takes over the same
boundaries; nothing else is shared.

The reconciler: group g of the plan is task `order[g]` (seeded shuffle; single epoch by default, so
no prompt is trained twice). At most `max_inflight_groups` groups are dispatched and not yet
trained — the knob that trades rollout throughput against staleness — and a sample whose oldest
trained token is more than `max_staleness` versions behind the trainer is not trained (its group
is dropped and recorded). Every state change goes to the event log first; finished groups are
checkpointed (sequences with advantages' inputs, tagged by policy version) before training, and the
step checkpoint names the groups it trained, so a restarted run trains nothing twice and loses no
finished group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from opencomposer.core import memory
from opencomposer.core.errors import UserError
from opencomposer.core.machine import usable_cpus
from opencomposer.core.metrics import read_jsonl
from opencomposer.core.rundir import write_atomic
from opencomposer.evals.runner import episode_seed
from opencomposer.harness.agent import AgentConfig, harness_config
from opencomposer.rl.curriculum import CurriculumConfig, Hardness, Planner
from opencomposer.rl.events import EventLog, read_events
from opencomposer.rl.objective import ObjectiveConfig
from opencomposer.rl.progress import load_progress, save_progress
from opencomposer.rl.rewards import RewardConfig
from opencomposer.rl.rollout import Sample, run_rollout
from opencomposer.rl.services import RayReplica, Replica, ReplicaProcess, Workers, answered, evaluate, ray_shutdown
from opencomposer.rl.threads import ThreadShare
from opencomposer.rl.trainer import RLTrainer, TrainerConfig

log = logging.getLogger(__name__)


class RLError(RuntimeError, UserError):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class RLConfig:
    model: Path
    """A Hugging Face model folder (with tokenizer.json) to start from: after CPT and SFT."""
    tasks: Path
    split: str | None = "train"
    task_ids: tuple[str, ...] = ()
    """Only these tasks of the split (empty: every one): the speedrun keeps the tasks SFT saw out of
    RL (`SpeedrunConfig.rl_share`)."""
    evaluate: bool = True
    """Measure `eval_split` before training, every `eval_every` steps and at the end."""
    eval_split: str | None = "held_out"
    """The held-out split (None: every task of the dataset folder)."""
    steps: int = 10
    minutes: float | None = None
    """A wall-clock budget for training: no step starts after this many minutes of the run (held-out
    evaluations not counted, earlier invocations of a resumed run counted); None: `steps` alone."""
    groups_per_step: int = 1
    max_inflight_groups: int = 2
    max_staleness: int = 2
    """Hard bound, per token: trainer version - the version that sampled it."""
    sync: bool = False
    """The synchronous baseline: a step's groups are dispatched only once the replica serves the
    trainer's latest weights, and the next step's only after this one trained (staleness 0; what
    `benchmarks/rl.py` compares the asynchronous pipeline against)."""
    max_attempts: int = 2
    """A sample whose rollout fails (infrastructure) is rolled out again at most this many times."""
    workers: int = 2
    epochs: int = 1
    seed: int = 0
    """Seeds the plan and every rollout's sampling (sample i of group g draws from its own seed),
    so a control run with learning rate 0 sees the same first draws."""
    temperature: float = 1.0
    turn_tokens: int = 256
    max_turns: int = 8
    rollout_timeout_s: float = 900.0
    tools: tuple[str, ...] = ()
    """Tools the agent may use (empty: the harness's default set); fewer tools, shorter prompts."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    objective: ObjectiveConfig = field(default_factory=lambda: ObjectiveConfig(group_size=4))
    rewards: RewardConfig = field(default_factory=RewardConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Later groups drawn by the hardness of earlier rollouts (`rl/curriculum.py`); off by default."""
    full_every: int = 10
    weight_store: str | None = None
    """Where weights are published (default: <out>/weights); any fsspec URL."""
    eval_every: int = 0
    eval_samples: int = 4
    slots: int = 8
    max_len: int | None = None
    services: Literal["processes", "threads", "ray"] = "processes"
    """Where the replica, the rollout workers and the evaluator run (`rl/services.py`): processes
    of their own that talk to the driver over HTTP and the weight store, threads of the driver, or
    Ray (an actor for the replica, tasks for rollouts and evaluations; `RAY_ADDRESS` or a local
    cluster)."""
    trainer_threads: int = 0
    replica_threads: int = 0
    """Torch threads of the trainer (in the driver) and of the replica process. The two compute at
    once, so threads past the cores they share make both slower: on this 2-core machine, with both
    busy, 1 thread each ran the trainer 1.53x and the engine 1.79x faster than 2 each
    (`benchmarks/rl.py --part threads`, docs/benchmarks.md); in a real run, where one side often
    waits on the other, both sides gained 1.2x (docs/rl.md). 0: with `services = "processes"` the
    CPUs this process may use are split between the two (the trainer gets the smaller half);
    otherwise torch's default (a replica in the driver shares its threads, and a Ray replica may
    sit on another machine)."""
    lend_threads: bool = True
    """While the trainer waits for rollouts, the replica computes with the trainer's threads as well
    as its own, and gives them back before each trainer step (POST /admin/threads, applied between
    the engine's steps). Only for a `services = "processes"` replica, which shares this machine's
    cores, and where the two sides' threads fit on the CPUs this process may use. In three RL runs
    of docs/rl.md the trainer sat idle 30-42% of the time while rollouts were in flight, and the
    engine decodes about twice as fast alone on 2 threads as on 1 beside the trainer
    (`benchmarks/rl.py --part threads`). Lent, the same six `renames-small` groups were trained
    1.14x sooner, at 1.37x fewer replica seconds per token (one pair of runs, docs/rl.md)."""
    borrow_threads: bool = True
    """The other way (`rl/threads.py`): during a trainer step, once no rollout is in flight, the
    trainer computes with the replica's threads as well as its own, until the step ends. Under the
    same conditions as `lend_threads`."""


def thread_split(cfg: RLConfig) -> tuple[int, int]:
    """(trainer threads, replica threads); 0 leaves torch's default (RLConfig.replica_threads)."""
    trainer, replica = cfg.trainer_threads, cfg.replica_threads
    if cfg.services == "processes":
        cpus = usable_cpus()
        trainer = trainer or max(1, cpus // 2)
        replica = replica or max(1, cpus - trainer)
    return trainer, replica


def agent_config(cfg: RLConfig) -> AgentConfig:
    return harness_config(cfg.tools, cfg.max_turns, cfg.rollout_timeout_s)


def _plan(n_tasks: int, cfg: RLConfig) -> list[int]:
    order = []
    rng = random.Random(cfg.seed)
    for _ in range(cfg.epochs):
        idx = list(range(n_tasks))
        rng.shuffle(idx)
        order += idx
    return order


class Run:
    """One RL run in `out` (resumable)."""

    def __init__(self, cfg: RLConfig, out: Path, progress=None):
        from opencomposer.model.hf import load_model
        from opencomposer.tasks.format import load_dataset

        self.cfg, self.out = cfg, Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        write_atomic(self.out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=1, default=str) + "\n")
        self.events = EventLog(self.out / "events.jsonl")
        self.tasks = load_dataset(cfg.tasks, cfg.split)
        if cfg.task_ids:
            keep = set(cfg.task_ids)
            self.tasks = [t for t in self.tasks if t.id in keep]
        if not self.tasks:
            raise RLError(f"no tasks in {cfg.tasks} (split {cfg.split}"
                          + (f", among the {len(cfg.task_ids)} task ids given)" if cfg.task_ids else ")"))
        self.store_url = cfg.weight_store or str(self.out / "weights")
        self.progress = progress
        self.trainer = RLTrainer(load_model(cfg.model), cfg.objective, cfg.trainer, model_dir=cfg.model)
        self.version, self.trained = 0, set()
        self._rejections_answered = 0
        self._answered_by = -1  # the last full snapshot published to answer a refusal (`answered`)
        self._eval_seconds = 0.0  # held-out evaluations during the run: not counted in `minutes`
        self._last_step_time: float | None = None
        """Wall clock of the last step (this process): step_seconds is the time between steps."""
        self.threads = ThreadShare((0, 0), lend=False, borrow=False)  # `run` sets the machine's split
        self.version, self.trained = load_progress(self.out, self.trainer)
        # groups finished before a crash and not yet trained: loaded, not rolled out again
        self.ready: dict[int, list[Sample]] = {}
        for f in sorted((self.out / "groups").glob("g*.json")) if (self.out / "groups").exists() else []:
            gid = int(f.stem[1:])
            if gid not in self.trained:
                self.ready[gid] = [Sample.from_dict(d) for d in json.loads(f.read_text())["samples"]]
        past = read_events(self.out / "events.jsonl")
        self.failed_groups = {e["group"] for e in past if e["kind"] == "group_failed"}
        hardness = Hardness(cfg.max_turns, cfg.turn_tokens)
        for f in sorted((self.out / "groups").glob("g*.json")) if (self.out / "groups").exists() else []:
            hardness.add(Sample.from_dict(d) for d in json.loads(f.read_text())["samples"])
        self.planner = Planner(_plan(len(self.tasks), cfg), [t.id for t in self.tasks], cfg.curriculum, hardness,
                               cfg.seed)
        self.planner.replay(past)  # the curriculum's earlier picks: every group keeps its task
        self.planner.decided |= self.trained
        self.metrics = open(self.out / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    # -- the reconciler ---------------------------------------------------------------------------
    def _next_groups(self, count: int, taken: set[int]) -> list[int]:
        out = []
        for g in range(len(self.planner.plan)):
            if len(out) == count:
                break
            if g in self.trained or g in self.failed_groups or g in taken:
                continue
            swap = self.planner.choose(g, taken | set(out) | self.failed_groups)
            if swap is not None:
                self.events.record("planned", **swap)
            out.append(g)
        return out

    def _replica(self) -> Replica:
        cfg = self.cfg
        kw = dict(slots=cfg.slots, max_len=cfg.max_len, turn_tokens=cfg.turn_tokens)
        if cfg.services in ("processes", "ray"):
            kw["threads"] = thread_split(cfg)[1]
            kind = RayReplica if cfg.services == "ray" else ReplicaProcess
            return kind(cfg.model, self.store_url, self.events, log_dir=self.out / "services", **kw).start()
        return Replica(cfg.model, self.store_url, self.events, **kw).start()

    def run(self) -> dict:
        from opencomposer.harness.openai_policy import OpenAIPolicyConfig
        from opencomposer.inference.weight_store import WeightStore, WeightStoreConfig
        from opencomposer.sandbox.pool import PoolConfig, SandboxPool

        cfg = self.cfg
        threads_before, trainer_threads = torch.get_num_threads(), thread_split(cfg)[0]
        if trainer_threads:
            torch.set_num_threads(trainer_threads)
        store = WeightStore(WeightStoreConfig(url=self.store_url, full_every=cfg.full_every))
        if self.version == 0 and not store.versions():
            self.events.record("published", version=0, **_pub(store.publish(self.trainer.model.to_hf_state(), 0)))
        elif self.version > 0:  # a restart: the trainer's state, published whole so every replica can load it
            self._publish(store)
        replica = self.replica = self._replica()
        cores = thread_split(cfg)
        cpus = usable_cpus()
        fits = cfg.services == "processes" and all(cores) and sum(cores) <= cpus
        lend = cfg.lend_threads and fits
        self.threads = ThreadShare(cores, lend=lend, borrow=cfg.borrow_threads and fits)
        self.events.record("run_started", version=self.version, trained_groups=len(self.trained),
                           ready_groups=sorted(self.ready), services=cfg.services,
                           threads={"trainer": torch.get_num_threads(), "replica": replica.health().get("threads")
                                    if isinstance(replica, ReplicaProcess) else torch.get_num_threads(),
                                    "lent": lend, "borrowed": self.threads.borrow})
        pool = SandboxPool(PoolConfig(max_concurrent=max(2, cfg.workers), max_load_per_cpu=None)) \
            if cfg.services == "threads" else None
        stop = threading.Event()
        inflight: dict[int, dict] = {}  # group -> {"samples": {i: Sample}, "attempts": {i: n}}
        self._pending: deque[tuple[int, int]] = deque()  # queued samples, submitted as workers free up
        self._futures: dict[Future, tuple[int, int]] = {}
        self.workers = Workers(cfg.workers, cfg.services, pool=pool, stop=stop, rollout=run_rollout)
        summary: dict = {"steps": []}
        G = cfg.objective.group_size
        steps_done = len(self.trained) // cfg.groups_per_step
        if cfg.evaluate and not (self.out / "evals" / "step-0" / "summary.json").exists():
            summary["eval_start"] = self._evaluate(replica, "step-0")
        self._last_step_time = time.time()  # the first step's time counts from here, evals apart
        spent = sum(r.get("step_seconds") or 0.0 for r in read_jsonl(self.out / "metrics.jsonl"))
        started = time.time()
        try:
            while steps_done < cfg.steps:
                if cfg.minutes is not None and spent + time.time() - started - self._eval_seconds > cfg.minutes * 60:
                    summary["stopped"] = f"the time budget ({cfg.minutes:g} min) ran out after {steps_done} steps"
                    break
                if not replica.alive():
                    self.events.record("replica_restarted", reason="replica not alive")
                    replica.stop()
                    replica = self.replica = self._replica()
                    self._rejections_answered = 0
                self.threads.lend_to(replica)  # the trainer waits from here to its next step
                self._policy = OpenAIPolicyConfig(base_url=replica.url, model="policy", temperature=cfg.temperature,
                                                  max_tokens=cfg.turn_tokens, timeout_s=cfg.rollout_timeout_s,
                                                  max_retries=0)
                if cfg.sync:  # one step's groups at a time, sampled by the trainer's latest weights
                    want = cfg.groups_per_step if not inflight and not self.ready else 0
                    if want:
                        self._await_replica(replica, store=store)
                else:  # dispatch whole groups while the staleness budget allows
                    want = cfg.max_inflight_groups - len(inflight) - len(self.ready)
                for g in self._next_groups(max(0, want), set(inflight) | set(self.ready)):
                    inflight[g] = {"samples": {}, "attempts": {i: 0 for i in range(G)}}
                    for i in range(G):
                        self._queue(g, i, inflight)
                self._pump(inflight)
                if not inflight and not self.ready:
                    summary["stopped"] = "the plan has no more groups (single epoch: no prompt twice)"
                    break
                # collect finished rollouts until enough groups are ready for a step
                while len(self.ready) < cfg.groups_per_step and self._futures:
                    done, _ = wait(list(self._futures), timeout=cfg.rollout_timeout_s + 60,
                                   return_when=FIRST_COMPLETED)
                    if not done:
                        raise RLError(f"no rollout finished within {cfg.rollout_timeout_s + 60:.0f} s")
                    for fut in done:
                        g, i = self._futures.pop(fut)
                        self._collect(fut, g, i, inflight)
                    self._pump(inflight)
                    self._repair(store, replica)  # a refused version is answered while rollouts go on
                if len(self.ready) < cfg.groups_per_step:
                    continue
                batch = sorted(self.ready)[: cfg.groups_per_step]
                groups = []
                for g in batch:
                    samples = self.ready.pop(g)
                    stale = [s for s in samples if s.min_version is not None
                             and self.version - s.min_version > cfg.max_staleness]
                    if stale:
                        self._fail_group(g, f"stale: {len(stale)} samples more than {cfg.max_staleness} versions "
                                            f"behind version {self.version}")
                        continue
                    groups.append((g, samples))
                if not groups:
                    continue
                steps_done += 1
                self.threads.reclaim(replica)  # the trainer's cores back before it trains
                summary["steps"].append(self._step(store, groups, replica))
                self._repair(store, replica)
                if cfg.evaluate and cfg.eval_every and steps_done % cfg.eval_every == 0 \
                        and steps_done < cfg.steps:
                    t_eval = time.time()
                    self._evaluate(replica, f"step-{steps_done}")
                    self._eval_seconds += time.time() - t_eval
                    self._last_step_time = time.time()
            self._export()
            if cfg.evaluate:
                summary["eval_end"] = self._evaluate(replica, f"step-{steps_done}")
        except KeyboardInterrupt:
            self.events.record("interrupted", version=self.version)
            raise
        finally:
            stop.set()
            self.workers.shutdown()
            replica.stop()
            if pool is not None:
                pool.close()
            if cfg.services == "ray":
                ray_shutdown()
            self.metrics.close()
            torch.set_num_threads(threads_before)
        summary.update(version=self.version, trained_groups=len(self.trained), failed_groups=len(self.failed_groups))
        self.events.record("run_finished", **{k: v for k, v in summary.items() if k != "steps"})
        self.events.close()
        write_atomic(self.out / "summary.json", json.dumps(summary, indent=1, default=str) + "\n")
        return summary

    def _queue(self, g: int, i: int, inflight: dict) -> None:
        task = self.tasks[self.planner.task(g)]
        inflight[g]["attempts"][i] += 1
        self.events.record("queued", f"g{g}.{i}", group=g, task=task.id, attempt=inflight[g]["attempts"][i])
        self._pending.append((g, i))

    def _pump(self, inflight: dict) -> None:
        """Hand queued samples to workers while one is free: the reconciler holds the queue, so a
        sample is `rolling_out` exactly when a worker has it."""
        while self._pending and len(self._futures) < self.cfg.workers:
            g, i = self._pending.popleft()
            if g not in inflight:  # its group failed meanwhile
                continue
            task = self.tasks[self.planner.task(g)]
            sid, attempt = f"g{g}.{i}", inflight[g]["attempts"][i]
            sample = Sample(id=sid, group=g, index=i + 100 * (attempt - 1), task=task.id)
            seeded = dataclasses.replace(self._policy, seed=episode_seed(self.cfg.seed, sid, sample.index))
            self.events.record("rolling_out", sid, policy_url=seeded.base_url)
            args = (task, sample, seeded, agent_config(self.cfg), self.cfg.rewards, self.out / "trajectories" / f"g{g}")
            try:
                fut = self.workers.submit(*args)
            except Exception as e:  # noqa: BLE001 - an idle worker died: the pool broke with no future to tell
                if not Workers.broke(e):
                    raise
                self._replace_workers(e)
                fut = self.workers.submit(*args)
            self._futures[fut] = (g, i)

    def _replace_workers(self, error: BaseException) -> None:
        self.workers.replace()
        self.events.record("worker_replaced", reason=f"{type(error).__name__}: {error}"[:300],
                           replaced=self.workers.replaced)

    def _collect(self, fut, g, i, inflight) -> None:
        try:
            s = fut.result()
        except Exception as e:  # noqa: BLE001 - a worker that died: its sample is re-queued
            s = Sample(id=f"g{g}.{i}", group=g, index=i, task="", error=f"worker died: {type(e).__name__}: {e}")
            if Workers.broke(e) and self.workers.broken_by(fut):
                self._replace_workers(e)
        if s.sandbox_restarts:
            # a run event (the sample's state did not change), naming the rollout
            self.events.record("sandbox_restarted", rollout=s.id, restarts=s.sandbox_restarts)
        if s.error is None and s.graded_at is not None:
            self.events.record("grading", s.id, started=s.graded_at)
        if s.error is not None:
            self.events.record("failed", s.id, reason=s.error)
            if g not in inflight:
                return
            if inflight[g]["attempts"][i] < self.cfg.max_attempts:
                self._queue(g, i, inflight)
            else:
                self._fail_group(g, f"sample {s.id} failed {self.cfg.max_attempts} times: {s.error}")
                inflight.pop(g, None)
            return
        if g not in inflight:
            return
        inflight[g]["samples"][i] = s
        if len(inflight[g]["samples"]) == self.cfg.objective.group_size:
            done = inflight.pop(g)["samples"]
            samples = [done[k] for k in range(self.cfg.objective.group_size)]
            path = self.out / "groups" / f"g{g}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"group": g, "samples": [x.to_dict() for x in samples]}) + "\n")
            for x in samples:
                self.events.record("grouped", x.id, group=g, reward=x.reward, passed=x.passed, task=x.task,
                                   broken_calls=x.breakdown.get("broken_calls", 0),
                                   min_version=x.min_version)
            self.ready[g] = samples
            self.planner.hardness.add(samples)

    def _repair(self, store, replica: Replica) -> None:
        """A replica refused a version: publish the trainer's weights whole, as the next version
        (the refused number stays refused), so that every replica has a base it can load again."""
        total, before = replica.rejected, self._rejections_answered
        if total <= before:
            return
        self._rejections_answered, fresh = total, replica.refusals()[-(total - before):]
        if answered(fresh, self._answered_by):
            self.events.record("refusals_answered", by=self._answered_by, refusals=len(fresh))
            return
        self.version = self._answered_by = self.version + 1
        save_progress(self.out, self.trainer, self.version, self.trained, moved=True)  # the new number
        m = store.publish(self.trainer.model.to_hf_state(), self.version, full=True)
        self.events.record("republished", version=self.version, reason="a replica rejected a version",
                           **_pub(m))

    def _await_replica(self, replica: Replica, timeout_s: float = 120.0, store=None) -> None:
        deadline = time.monotonic() + timeout_s
        while replica.version < self.version:
            if store is not None:
                self._repair(store, replica)
            if time.monotonic() > deadline:
                raise RLError(f"the replica still serves version {replica.version} {timeout_s:.0f} s after the "
                              f"trainer published {self.version}")
            time.sleep(0.05)

    def _export(self) -> Path:
        """The trained policy as a Hugging Face folder (`out/model`): weights, config, tokenizer."""
        import shutil

        from opencomposer.model.hf import save_model

        folder = self.out / "model"
        tmp = self.out / ".model-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(self.trainer.model, tmp)
        for f in Path(self.cfg.model).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                       "model.safetensors.index.json"):
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        self.events.record("exported", version=self.version, folder=str(folder))
        return folder

    def _evaluate(self, replica: Replica, label: str) -> dict:
        """Mean pass rate and best-of-K on the held-out split, through the same harness and server,
        on the weights the replica serves once it has caught up with the trainer (the evaluator
        service: its own process with `services = "processes"`)."""
        from opencomposer.tasks.format import load_dataset

        from opencomposer.evals.runner import EvalConfig
        from opencomposer.harness.openai_policy import OpenAIPolicyConfig

        cfg = self.cfg
        deadline = time.monotonic() + 120
        while replica.version < self.version and time.monotonic() < deadline:
            time.sleep(0.1)
        ecfg = EvalConfig(tasks=cfg.tasks, split=cfg.eval_split, passes=cfg.eval_samples, concurrency=cfg.workers,
                          agent=agent_config(cfg), policy=OpenAIPolicyConfig(temperature=cfg.temperature,
                                                                             max_tokens=cfg.turn_tokens, seed=cfg.seed))
        n = len(load_dataset(cfg.tasks, cfg.eval_split)) * cfg.eval_samples
        s = evaluate(ecfg, replica.url, "policy", self.out / "evals" / label, cfg.services,
                     timeout_s=cfg.rollout_timeout_s * max(1, n // max(1, cfg.workers) + 1))
        rec = {"label": label, "version": replica.version, "accuracy": s["accuracy"],
               "interval": s.get("accuracy_ci95"), f"best_of_{cfg.eval_samples}": s.get(f"best_of_{cfg.eval_samples}"),
               "episodes": s["episodes"]}
        self.events.record("eval", **rec)
        write_atomic(self.out / "evals" / label / "summary.json", json.dumps(rec, indent=1) + "\n")
        return rec

    def _fail_group(self, g: int, reason: str) -> None:
        self.failed_groups.add(g)
        self.events.record("group_failed", group=g, reason=reason)

    def _publish(self, store) -> dict:
        m = store.publish(self.trainer.model.to_hf_state(), self.version)
        self.events.record("published", version=self.version, **_pub(m))
        return m

    def _step(self, store, groups: list[tuple[int, list[Sample]]], replica: Replica) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        before = self.version
        # the replica's cores too once every rollout in flight has finished (`RLConfig.borrow_threads`)
        self.trainer.between = self.threads.borrower(lambda: all(f.done() for f in self._futures))
        try:
            st = self.trainer.step([s for _, s in groups])
        finally:
            self.threads.step_ended()
        lent_s, borrowed_s = self.threads.take_seconds()
        memory.trim()  # the step's activations, freed, back to the OS (core/memory.py)
        # A version is a change of weights: a step that trained nothing (every group skipped or at
        # advantage 0) publishes nothing and ages no sample in flight. It used to count, and in the
        # default speedrun 4 of 26 groups were dropped as stale behind steps that changed nothing.
        self.version += st["updated"]
        for g, _ in groups:
            self.trained.add(g)
        save_progress(self.out, self.trainer, self.version, self.trained, moved=st["updated"])
        for g, samples in groups:
            for s in samples:
                self.events.record("trained", s.id, group=g, version=self.version)
        t1 = time.perf_counter()
        m = self._publish(store) if st["updated"] else {"seconds": 0.0, "bytes": 0, "raw_bytes": 0}
        samples = [s for _, ss in groups for s in ss]
        # only the groups the step backpropagated: a skipped group's tokens were sampled, not trained
        staleness = [before - v for gi in st["trained"] for s in groups[gi][1] for q in s.sequences
                     for v, k in zip(q.versions, q.loss_mask) if k]
        calls: dict[str, int] = {}
        for s in samples:
            for n, c in s.tool_calls.items():
                calls[n] = calls.get(n, 0) + c
        editing = ("search_replace", "write_file", "delete_file")
        edits = sum(1 for s in samples if any(n in s.tool_calls for n in editing))
        rollout_s = {k: round(sum(s.seconds.get(k, 0.0) for s in samples) / len(samples), 3)
                     for k in ("episode", "policy", "tools", "grade")}
        now = time.time()
        rec = {"step": len(self.trained) // cfg.groups_per_step, "version": self.version, "updated": st["updated"],
               "groups": [g for g, _ in groups], "groups_backpropagated": [groups[gi][0] for gi in st["trained"]],
               "reward": sum(s.reward for s in samples) / len(samples),
               "pass_rate": sum(s.passed for s in samples) / len(samples),
               "kl_per_token": st["kl_per_token"], "zero_advantage_groups": st["zero_advantage_groups"],
               "unsolved_groups_skipped": st["unsolved_groups_skipped"],
               "solved_groups_skipped": st["solved_groups_skipped"], "ratio_max": st["ratio_max"],
               "bf16": st["bf16"], "truncated": st["truncated"],
               "zero_advantage_rollouts": st["zero_advantage_rollouts"], "trained_tokens": st["trained_tokens"],
               **{k: st.get(k, 0) for k in ("scaled_tokens", "call_only_groups", "copy_blamed_tokens")},
               "call_mass": [round(x, 3) for x in st.get("call_mass", [0.0, 0.0])],
               "advantage_mass": [round(x, 3) for x in st["advantage_mass"]],
               "tokens_per_rollout": sum(s.trained_tokens for s in samples) / len(samples),
               "turns_per_rollout": sum(s.turns for s in samples) / len(samples),
               "tool_calls": calls, "broken_calls": sum(s.breakdown.get("broken_calls", 0) for s in samples),
               "failed_edits": sum(s.breakdown.get("failed_edits", 0) for s in samples),
               "edit_rate": edits / len(samples), "merge_rate": sum(s.merge_rate for s in samples) / len(samples),
               "staleness": {str(k): staleness.count(k) for k in sorted(set(staleness))},
               "train_seconds": round(t1 - t0, 3), "publish_seconds": m["seconds"], "rollout_seconds": rollout_s,
               "step_seconds": round(now - self._last_step_time, 3) if self._last_step_time else None,
               "lent_seconds": round(lent_s, 3), "borrowed_seconds": round(borrowed_s, 3), "delta_bytes": m["bytes"],
               "full_bytes": m["raw_bytes"], "replica_version": replica.version,
               "grad_norm": st.get("grad_norm", 0.0), "loss": st["loss"], **memory.usage(), "time": now}
        self._last_step_time = now
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        self.events.record("step", **{k: v for k, v in rec.items() if k not in ("tool_calls", "staleness",
                                                                               "rollout_seconds")})
        if self.progress is not None:
            self.progress(rec)
        return rec


def _pub(m: dict) -> dict:
    return {"kind_of": m["kind"], "bytes": m["bytes"], "raw_bytes": m["raw_bytes"], "seconds": m["seconds"]}


def run(cfg: RLConfig, out: Path, progress=None) -> dict:
    return Run(cfg, out, progress).run()
