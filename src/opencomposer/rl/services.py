"""The RL loop's services behind their boundaries: inference replicas, rollout workers and the
evaluator. The loop (`rl/loop.py`) sees only these interfaces — a replica is a URL with a version
that follows the weight store; a worker turns (task, sample, policy URL) into a graded `Sample`; the
evaluator turns (eval config, policy URL) into a summary — so where they run is a backend's choice:

- `processes` (the default): each replica is `opencomposer serve --weights=<store>` in its own
  process, pulling and verifying versions on its own; rollout workers are a pool of processes
  (spawned, so none inherits the trainer's torch threads); each held-out evaluation runs in a
  process of its own. Nothing is shared but HTTP and the store. A worker process that dies breaks
  the pool: the pool is replaced and every sample it held is rolled out again (`worker_replaced`).
- `threads`: the same services as threads of the driver (tests that reach into a replica's engine
  or patch a worker use it).
- `ray`: the same four calls (start a replica, submit a rollout, evaluate, stop) on Ray: the
  replica is `opencomposer serve` started by a Ray actor on whichever node Ray places it, serving
  on that node's address; a rollout is a Ray task (no retries: a crashed worker fails its future,
  and the loop re-queues the sample and records `worker_replaced`, as with processes); an
  evaluation is a Ray task. The cluster is the one `RAY_ADDRESS` names, or a local one started
  here and shut down with the loop. Every node needs this package and the task folders (shared
  storage); the weight store is an fsspec URL every node can read. Measured on one node only.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from opencomposer.core.errors import UserError

log = logging.getLogger(__name__)


class ServiceError(RuntimeError, UserError):
    pass


def answered(refusals: list[dict], snapshot: int) -> bool:
    """Whether the full snapshot `snapshot` already answers these refusals: each was made before the
    replica could see it (a delta published after a corrupt one no longer chains and is refused in
    turn; the snapshot published for the first refusal is the answer to both)."""
    return bool(refusals) and all(r.get("seen") is not None and r["seen"] < snapshot for r in refusals)


class Replica:
    """An inference replica in this process: our server on the current weights, following the store
    (`WeightFollower`). Refusals are recorded in the event log when the driver reads `rejected`."""

    def __init__(self, model: Path, store_url: str, events, *, slots: int, max_len: int | None, turn_tokens: int,
                 threads: int = 0):
        self.model, self.store_url, self.events = model, store_url, events
        self.slots, self.max_len, self.turn_tokens = slots, max_len, turn_tokens
        self.threads = threads
        """Torch threads of a replica process (0: torch's default); one in the driver shares its threads."""
        self.server = None
        self._reported = 0

    def start(self) -> Replica:
        from opencomposer.inference.server import ServeConfig, Server, load_served

        engine, tok = load_served(self.model, slots=self.slots, max_len=self.max_len)
        self.server = Server(engine, tok, "policy", ServeConfig(port=0, default_max_tokens=self.turn_tokens,
                                                                weights=self.store_url)).start()
        return self

    @property
    def url(self) -> str:
        return self.server.url if self.server else ""

    @property
    def version(self) -> int:
        return self.server.engine.version if self.server else -1

    def refusals(self) -> list[dict]:
        """The follower's refusals, oldest first."""
        follower = self.server.frontend.follower if self.server else None
        return follower.refusals if follower is not None else []

    @property
    def rejected(self) -> int:
        """Versions this replica refused (corrupt, partial, out of order); new ones are recorded."""
        refusals = self.refusals()
        for r in refusals[self._reported:]:
            self.events.record("weights_rejected", replica=self.url, version=r["version"], error=r["error"])
        self._reported = len(refusals)
        return len(refusals)

    def set_threads(self, n: int) -> bool:
        """Give the replica's engine `n` threads from its next step on; False where that is not
        this replica's to change (a replica in the driver shares the trainer's threads)."""
        return False

    def alive(self) -> bool:
        return self.server is not None and self.server.engine.load()["alive"]

    def kill(self) -> None:
        """What a crash looks like from outside (tests): the engine stops answering."""
        self.server.engine.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class ReplicaProcess(Replica):
    """An inference replica in its own process: `opencomposer serve --weights=<store>` on a free
    port, found through its ready file. Its version and refusals are read from its /health."""

    START_TIMEOUT_S = 600.0

    def __init__(self, *args, log_dir: Path, host: str = "127.0.0.1", **kw):
        super().__init__(*args, **kw)
        self.log_dir = Path(log_dir)
        self.host = host
        self.proc: subprocess.Popen | None = None
        self._url = ""
        self._health: dict = {}
        self._health_at = 0.0
        self._admin_token = secrets.token_hex(16)
        """The replica's admin token (in its environment, not on its command line): the driver sets
        its threads with it (`set_threads`)."""

    def start(self) -> ReplicaProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fd, ready = tempfile.mkstemp(prefix="replica-", suffix=".json", dir=self.log_dir)
        os.close(fd)
        os.unlink(ready)
        cmd = [sys.executable, "-m", "opencomposer.cli", "serve", "--model", str(self.model), "--name", "policy",
               "--host", self.host, "--port", "0", "--slots", str(self.slots), "--weights", self.store_url,
               f"--ready_file={json.dumps(ready)}", f"--default_max_tokens={self.turn_tokens}"]
        if self.max_len:
            cmd += ["--max-len", str(self.max_len)]
        if self.threads:
            cmd += [f"--threads={self.threads}"]
        self._log = open(self.log_dir / "replica.log", "ab")  # noqa: SIM115 - the child writes to it for its life
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1",
                                          "OPENCOMPOSER_ADMIN_TOKEN": self._admin_token,
                                          "OPENCOMPOSER_PARENT_PID": str(os.getpid())},
                                     preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not Path(ready).exists():
            if self.proc.poll() is not None:
                raise ServiceError(f"the replica process exited with {self.proc.returncode} before it served "
                                   f"(see {self.log_dir / 'replica.log'}): {self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"the replica process did not serve within {self.START_TIMEOUT_S:.0f} s "
                                   f"(see {self.log_dir / 'replica.log'})")
            time.sleep(0.05)
        self._url = json.loads(Path(ready).read_text())["url"]
        os.unlink(ready)
        return self

    def _log_tail(self) -> str:
        try:
            return (self.log_dir / "replica.log").read_bytes()[-600:].decode("utf-8", "replace")
        except OSError:
            return ""

    def health(self, max_age_s: float = 0.05) -> dict:
        """The replica's /health (cached for `max_age_s`); {} when it does not answer."""
        if time.monotonic() - self._health_at < max_age_s:
            return self._health
        try:
            with urllib.request.urlopen(self._url.removesuffix("/v1") + "/health", timeout=5) as r:
                self._health = json.loads(r.read())
        except (OSError, ValueError, http.client.HTTPException):
            # HTTPException: a replica that dies mid-answer (killed, out of memory) leaves a short
            # body (IncompleteRead), which is not an OSError (seen in the Ray test after it killed the replica)
            self._health = {}
        self._health_at = time.monotonic()
        return self._health

    @property
    def url(self) -> str:
        return self._url

    @property
    def version(self) -> int:
        return int(self.health().get("policy_version", -1))

    def set_threads(self, n: int) -> bool:
        """POST /admin/threads; a replica that does not answer within 5 s is left as it is (False)."""
        req = urllib.request.Request(self._url.removesuffix("/v1") + "/admin/threads", method="POST",
                                     data=json.dumps({"threads": n}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self._admin_token}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()
        except (OSError, ValueError, http.client.HTTPException) as e:
            log.warning("could not set the replica's threads to %d: %s", n, e)
            return False
        return True

    def refusals(self) -> list[dict]:
        """The newest refusals the replica lists (up to 20), oldest first."""
        return ((self.health().get("weights") or {}).get("refusals")) or []

    @property
    def rejected(self) -> int:
        weights = self.health().get("weights") or {}
        refusals, total = weights.get("refusals") or [], int(weights.get("rejected", 0))
        first = total - len(refusals)  # /health lists the newest refusals only
        for i, r in enumerate(refusals):
            if first + i >= self._reported:
                self.events.record("weights_rejected", replica=self.url, version=r["version"], error=r["error"])
        self._reported = max(self._reported, total)
        return total

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and \
            self.health(max_age_s=0.0).get("status") == "ok"

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # `opencomposer serve` stops on SIGTERM
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None


def _die_with_parent(parent: int) -> None:
    """In a child before exec (Linux): SIGTERM it when the process that started it (`parent`)
    dies, so a driver killed with SIGKILL leaves no replica serving behind it. A parent that died
    between the fork and the prctl sends no signal: that case is checked by hand. The replica
    bounds its own shutdown (`ServeConfig.shutdown_timeout_s`), so the SIGTERM ends it. The
    replica also watches its parent itself (`OPENCOMPOSER_PARENT_PID`, core/shutdown.py), since
    the signal is tied to the thread that forked it and a handler may not run at once."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


# -- rollout workers ----------------------------------------------------------------------------------

_POOL = None
"""A worker process's sandbox pool (made by `_init_worker`)."""
_BUSY = False
"""Whether the worker process is in a rollout (a SIGTERM then unwinds it; an idle one just exits)."""


def _watch_parent() -> None:
    """A pool process ends when the driver that started it dies: the pool's queue pipe stays open
    in the sibling workers, so no end-of-file would tell them. A busy worker gets the same SIGTERM
    as at shutdown first, so its rollout unwinds and closes its sandbox."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        if _BUSY:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30.0)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _worker_pool(max_concurrent: int):
    """A rollout worker's own sandbox pool (processes and Ray alike)."""
    from opencomposer.sandbox.pool import PoolConfig, SandboxPool

    return SandboxPool(PoolConfig(max_concurrent=max_concurrent, max_load_per_cpu=None))


def _init_worker(max_concurrent: int) -> None:
    _watch_parent()
    global _POOL
    _POOL = _worker_pool(max_concurrent)

    def _interrupt(*_):  # SIGTERM from the driver: a rollout unwinds, so its sandbox's `with` blocks close it
        if _BUSY:
            raise KeyboardInterrupt
        # idle: nothing to close, and raising inside the pool's queue read could leave its lock held;
        # the pool's shutdown sentinel ends this worker

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides what a Ctrl-C ends


def rollout_job(task_root: str, sample, policy_config, agent, rewards, traj_dir: str):
    """One rollout in a worker process (`rl/rollout.py`): a picklable function of its inputs."""
    from opencomposer.harness.openai_policy import OpenAIPolicy
    from opencomposer.rl.rollout import run_rollout
    from opencomposer.tasks.format import Task

    global _BUSY
    _BUSY = True
    try:
        return run_rollout(Task.load(Path(task_root)), sample, OpenAIPolicy(policy_config), _POOL, agent, rewards,
                           Path(traj_dir))
    finally:
        _BUSY = False


def evaluation_job(ecfg, url: str, model: str, out: str) -> dict:
    """A held-out evaluation in its own process (the evaluator service)."""
    from opencomposer.evals.runner import policy_factory, run_eval

    return run_eval(ecfg, policy_factory(url, model, ecfg.policy), Path(out))


class Workers:
    """Rollout workers: `submit(...)` -> a Future of a `Sample`. Processes (spawned) or threads."""

    def __init__(self, count: int, backend: str, pool=None, stop: threading.Event | None = None, rollout=None):
        self.count, self.backend, self.pool, self.stop_event = count, backend, pool, stop
        self.rollout = rollout
        """The threads backend's rollout function (`rl.rollout.run_rollout`; tests wrap it)."""
        self.replaced = 0
        self._executor = self._make()
        self._of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # future -> its executor

    def _make(self):
        if self.backend == "ray":
            return _RayTasks()
        if self.backend == "processes":
            return ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_init_worker, initargs=(2,))
        return ThreadPoolExecutor(self.count, thread_name_prefix="rollout")

    def submit(self, task, sample, policy_config, agent, rewards, traj_dir: Path) -> Future:
        if self.backend == "ray":
            fut = self._executor.submit(str(task.root), sample, policy_config, agent, rewards, str(traj_dir))
        elif self.backend == "processes":
            fut = self._executor.submit(rollout_job, str(task.root), sample, policy_config, agent, rewards,
                                        str(traj_dir))
        else:
            from opencomposer.harness.openai_policy import OpenAIPolicy

            fut = self._executor.submit(self.rollout, task, sample, OpenAIPolicy(policy_config), self.pool, agent,
                                        rewards, traj_dir, stop=self.stop_event)
        self._of[fut] = self._executor
        return fut

    @staticmethod
    def broke(error: BaseException) -> bool:
        """The worker process died (killed, out of memory): with processes the whole pool is gone
        with it; with Ray only that task's worker (Ray starts another for the next task)."""
        return isinstance(error, BrokenProcessPool) or _ray_worker_died(error)

    def broken_by(self, fut: Future) -> bool:
        """Whether `fut` ran on the current pool (the first of a dead pool's futures to be seen
        replaces it; the rest ran on the pool already replaced)."""
        return self._of.pop(fut, None) is self._executor

    def replace(self) -> None:
        """A new pool after a dead one (its futures have all failed; their samples are re-queued).
        On Ray only the dead task's worker is gone and Ray starts another by itself: the other
        rollouts go on."""
        if self.backend != "ray":
            self._shutdown(self._executor)
            self._executor = self._make()
        self.replaced += 1

    def _shutdown(self, executor, grace_s: float = 30.0) -> None:
        if isinstance(executor, _RayTasks):
            executor.shutdown()
            return
        if not isinstance(executor, ProcessPoolExecutor):
            executor.shutdown(wait=True, cancel_futures=True)
            return
        # Running rollouts are ended, not awaited: queued work is cancelled and idle workers take
        # the pool's sentinel; a busy one gets SIGTERM, which unwinds its rollout (and closes its
        # sandbox), then takes the sentinel too. Whatever is left after `grace_s` is SIGKILLed,
        # and the sandbox reaper collects what that leaves. (Python 3.14: terminate_workers().)
        procs = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)

    def shutdown(self) -> None:
        self._shutdown(self._executor)


def evaluate(ecfg, url: str, model: str, out: Path, backend: str, timeout_s: float) -> dict:
    """Run a held-out evaluation against a replica's URL: in its own process, a Ray task, or in
    this one."""
    if backend == "ray":
        ray = ray_runtime()
        ref = ray.remote(num_cpus=0, max_retries=0)(evaluation_job).remote(ecfg, url, model, str(out))
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            raise ServiceError(f"the evaluation did not finish within {timeout_s:.0f} s") from None
    if backend != "processes":
        return evaluation_job(ecfg, url, model, str(out))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_watch_parent) as ex:
        fut = ex.submit(evaluation_job, ecfg, url, model, str(out))
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            for p in list((getattr(ex, "_processes", None) or {}).values()):
                p.kill()
            raise ServiceError(f"the evaluation did not finish within {timeout_s:.0f} s") from None


# -- the Ray backend ----------------------------------------------------------------------------------
_RAY_STARTED = False
"""Whether this process started the local Ray cluster it uses (and so shuts it down)."""


def ray_runtime():
    """Ray, connected: to the cluster `RAY_ADDRESS` names, or to a local one started here."""
    global _RAY_STARTED
    try:
        import ray
    except ImportError as e:
        raise ServiceError('services = "ray" needs Ray: pip install "opencomposer[ray]"') from e
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or None
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)
        _RAY_STARTED = address is None
    return ray


def ray_shutdown() -> None:
    """Stop the local Ray cluster this process started (a cluster it joined stays up)."""
    global _RAY_STARTED
    if _RAY_STARTED:
        import ray

        ray.shutdown()
        _RAY_STARTED = False


def _ray_worker_died(error: BaseException) -> bool:
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    return isinstance(error, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                              ray.exceptions.OutOfMemoryError))


def _ray_rollout(task_root: str, sample, policy_config, agent, rewards, traj_dir: str):
    """A rollout as a Ray task: the worker process makes its sandbox pool on first use."""
    global _POOL
    if _POOL is None:
        _POOL = _worker_pool(2)
    return rollout_job(task_root, sample, policy_config, agent, rewards, traj_dir)


class _RayTasks:
    """The Ray backend's rollout executor: each rollout a Ray task whose result is a Future.
    num_cpus=0: a rollout mostly waits on the policy's HTTP answers, and the reconciler already
    bounds how many run at once (`workers`); Ray's CPU count would cap them at the core count."""

    def __init__(self):
        self.ray = ray_runtime()
        self.remote = self.ray.remote(num_cpus=0, max_retries=0)(_ray_rollout)
        self.refs: dict = {}

    def submit(self, *args) -> Future:
        ref = self.remote.remote(*args)
        fut = ref.future()
        self.refs[fut] = ref
        fut.add_done_callback(lambda f: self.refs.pop(f, None))
        return fut

    def shutdown(self) -> None:
        for ref in list(self.refs.values()):
            self.ray.cancel(ref, force=True)  # the worker process dies; the sandbox reaper collects its sandbox
        self.refs.clear()


class _ReplicaHost:
    """The Ray actor that starts a replica process on its node and serves on the node's address."""

    def __init__(self, model: str, store_url: str, log_dir: str, slots: int, max_len, turn_tokens: int,
                 threads: int = 0):
        import ray

        self.rep = ReplicaProcess(Path(model), store_url, None, slots=slots, max_len=max_len, turn_tokens=turn_tokens,
                                  threads=threads, log_dir=Path(log_dir), host=ray.util.get_node_ip_address()).start()

    def url(self) -> str:
        return self.rep.url

    def stop(self) -> None:
        self.rep.stop()


class RayReplica(ReplicaProcess):
    """An inference replica that a Ray actor runs; the driver reads its version and refusals from
    its /health over HTTP, as for `ReplicaProcess`."""

    actor = None
    """The `_ReplicaHost` actor's handle while it runs."""

    def start(self) -> RayReplica:
        ray = ray_runtime()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        host = ray.remote(num_cpus=0, max_restarts=0)(_ReplicaHost)
        self.actor = host.remote(str(self.model), self.store_url, str(self.log_dir), self.slots, self.max_len,
                                 self.turn_tokens, self.threads)
        try:
            self._url = ray.get(self.actor.url.remote(), timeout=self.START_TIMEOUT_S)
        except Exception as e:
            ray.kill(self.actor)
            raise ServiceError(f"the Ray replica did not serve: {type(e).__name__}: {e}"[:2000]) from e
        return self

    def alive(self) -> bool:
        return self.actor is not None and self.health(max_age_s=0.0).get("status") == "ok"

    def set_threads(self, n: int) -> bool:
        """Not lent: a Ray replica may run on another machine, whose cores the trainer does not have."""
        return False

    def kill(self) -> None:
        """What a crash looks like (tests): the actor's process dies, and its replica with it."""
        import ray

        ray.kill(self.actor)

    def stop(self) -> None:
        import ray

        if self.actor is None:
            return
        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - an actor that is already gone has nothing left to stop
            pass
        ray.kill(self.actor)
        self.actor = None
