"""Grading: the verifier runs in a fresh fork of the final state, with the hidden tests copied in.

Hardened against the ways graders are fooled (anchors-env §2.2, anchors-rl §5.6):
- the hidden files are written *after* the agent is done, over whatever it left at those paths;
- runner-rigging files (conftest.py, pytest.ini, sitecustomize.py, ...) are restored to their base
  state, and new ones are deleted;
- the result comes from a JUnit report at a path chosen at grading time (removed before the run),
  never from stdout ("PASSED" printed by a patch means nothing);
- every fail-to-pass and pass-to-pass test must appear in the report and pass: a suite that did
  not run, or ran partly, fails;
- failures of the machinery (sandbox errors, setup that does not run) are `infra_error`, reported
  apart from model failures.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import posixpath
import tarfile
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from opencomposer.sandbox.base import SandboxConfig, SandboxError
from opencomposer.sandbox.local import LocalSandbox, Workspace, owner_dir
from opencomposer.sandbox.reaper import default_state_root
from opencomposer.tasks.format import Task
from opencomposer.tasks.junit import JunitError, parse_junit

log = logging.getLogger(__name__)

Status = Literal["passed", "failed", "no_tests_ran", "infra_error"]


@dataclass
class GradeResult:
    task_id: str
    status: Status
    fail_to_pass: dict[str, str] = field(default_factory=dict)
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    tests_run: int = 0
    exit_code: int | None = None
    duration_s: float = 0.0
    detail: str = ""
    outcomes: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def infra(self) -> bool:
        return self.status == "infra_error"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("outcomes")
        d["passed"] = self.passed
        return d


@contextmanager
def grading_config(task: Task, base: SandboxConfig):
    """The sandbox config to grade `task` in: its verifier mounts, plus a fresh folder for a reward
    file when the task has one. Yields (config, reward folder or None).

    The folder lives in this process's sandbox state folder (`sandbox/reaper.py`), not in /tmp: a
    grader SIGKILLed mid-grade cannot remove it, and the next owner's reaper then does."""
    spec = task.spec.verifier
    mounts = [f"{task.root / rel}:{dst}" for rel, dst in (m.split(":", 1) for m in spec.mounts)]
    if not spec.reward_file:
        yield dataclasses.replace(base, mounts=(*base.mounts, *mounts)), None
        return
    state = owner_dir(Path(base.state_dir) if base.state_dir else default_state_root())
    with tempfile.TemporaryDirectory(prefix="reward-", dir=state) as tmp:
        reward_dir = Path(tmp)
        reward_dir.chmod(0o777)
        mounts.append(f"{reward_dir}:{posixpath.dirname(spec.reward_file)}:rw")
        yield dataclasses.replace(base, mounts=(*base.mounts, *mounts)), reward_dir


def grade_sandbox(task: Task, final: LocalSandbox) -> GradeResult:
    """Grade an agent's final sandbox: snapshot it, verify in a fresh fork (the original is left as it was)."""
    try:
        snap = final.snapshot()
        with grading_config(task, final.config) as (cfg, reward_dir), \
                final.workspace.sandbox(snap, config=cfg) as fork:
            return verify(task, fork, reward_dir)
    except SandboxError as e:
        return GradeResult(task.id, "infra_error", detail=f"{type(e).__name__}: {e}")


def grade_patch(task: Task, patch: str, workspace: Workspace | None = None) -> GradeResult:
    """Grade a patch against the task's base repository (integrity gates, and evals of diffs)."""
    own = workspace is None
    ws = workspace or Workspace(task.repo, task.sandbox_config())
    try:
        with grading_config(task, ws.config) as (cfg, reward_dir), ws.sandbox(config=cfg) as sb:
            if patch.strip():
                sb.write_file(".git/opencomposer-grade.patch", patch)
                r = sb.exec("git apply --whitespace=nowarn .git/opencomposer-grade.patch", timeout_s=120)
                if r.exit_code != 0:
                    return GradeResult(task.id, "failed", detail=f"patch does not apply: {r.stderr.strip()[:500]}")
            return verify(task, sb, reward_dir)
    except SandboxError as e:
        return GradeResult(task.id, "infra_error", detail=f"{type(e).__name__}: {e}")
    finally:
        if own:
            ws.close()


def verify(task: Task, sb: LocalSandbox, reward_dir: Path | None = None) -> GradeResult:
    """Run the verifier in `sb` with one-shot commands only (no tool server: grading a fork costs
    one bubblewrap start per step, not a server start)."""
    spec = task.spec.verifier
    t0 = time.perf_counter()
    try:
        files = _restore_protected(task, sb)
        if spec.copy_hidden:
            files.update({str(p.relative_to(task.hidden)): p for p in task.hidden.rglob("*") if p.is_file()})
        if files:
            # Whatever the agent left at those paths (files, directories, symlinks) goes first.
            sb.exec(["rm", "-rf", "--", *files], timeout_s=120)
            r = sb.exec(["tar", "-x", "-f", "-"], stdin=_tar(files), timeout_s=300)
            if r.exit_code != 0:
                return GradeResult(task.id, "infra_error", detail=f"copying verifier files failed: {r.stderr[:300]}",
                                   duration_s=time.perf_counter() - t0)
        for cmd in task.spec.setup:
            r = sb.exec(cmd, timeout_s=600)
            if not r.ok:
                return GradeResult(task.id, "infra_error", detail=f"setup {cmd!r} failed: {r.stderr.strip()[:500]}",
                                   duration_s=time.perf_counter() - t0)
        junit = f".oc-junit-{uuid.uuid4().hex}.xml"
        r = sb.exec(spec.command.format(junit=junit), timeout_s=spec.timeout_s)
        if spec.reward_file:
            return _reward_result(task, reward_dir, r, time.perf_counter() - t0)
        cat = sb.exec(["cat", "--", junit], timeout_s=120, output_limit=256 << 20)
        if cat.exit_code != 0:
            detail = "the verifier wrote no report (the suite did not run)"
            if r.killed_by:
                detail += f"; it was stopped: {r.killed_by}"
            return GradeResult(task.id, "no_tests_ran", exit_code=r.exit_code, detail=detail + "\n" + r.stderr[-2000:],
                               duration_s=time.perf_counter() - t0)
        report = cat.stdout
    except SandboxError as e:
        return GradeResult(task.id, "infra_error", detail=f"{type(e).__name__}: {e}", duration_s=time.perf_counter() - t0)
    try:
        outcomes = parse_junit(report)
    except JunitError as e:
        return GradeResult(task.id, "no_tests_ran", exit_code=r.exit_code, detail=f"unreadable report: {e}",
                           duration_s=time.perf_counter() - t0)
    f2p = {t: outcomes.get(t, "missing") for t in spec.fail_to_pass}
    p2p = {t: outcomes.get(t, "missing") for t in spec.pass_to_pass}
    expected = {**f2p, **p2p}
    ok = bool(expected) and all(v == "passed" for v in expected.values())
    # An empty report means the suite did not run; a report without our tests (e.g. a collection
    # error because a module is missing) is an ordinary failure.
    status: Status = "passed" if ok else ("no_tests_ran" if not outcomes else "failed")
    bad = [f"{t}: {v}" for t, v in expected.items() if v != "passed"]
    return GradeResult(task.id, status, f2p, p2p, tests_run=len(outcomes), exit_code=r.exit_code,
                       duration_s=time.perf_counter() - t0,
                       detail="; ".join(bad[:10]) + (f" (+{len(bad) - 10} more)" if len(bad) > 10 else ""),
                       outcomes=outcomes)


def _reward_result(task: Task, reward_dir: Path | None, r, duration: float) -> GradeResult:
    """Harbor-style outcome: the number in the reward file (written by the verifier, outside the
    workspace, into a folder only the grader provides): >= 1 passes."""
    path = reward_dir / posixpath.basename(task.spec.verifier.reward_file) if reward_dir else None
    if path is None or not path.is_file():
        return GradeResult(task.id, "no_tests_ran", exit_code=r.exit_code, duration_s=duration,
                           detail="the verifier wrote no reward" + (f" (stopped: {r.killed_by})" if r.killed_by else ""))
    text = path.read_text().strip()
    try:
        reward = float(json.loads(text).get("reward")) if text.startswith("{") else float(text)
    except (ValueError, TypeError, AttributeError):
        return GradeResult(task.id, "no_tests_ran", exit_code=r.exit_code, duration_s=duration,
                           detail=f"unreadable reward {text[:100]!r}")
    detail = f"reward {reward}"
    if reward < 1.0:  # what the verifier said, so a rejected import or a failed episode explains itself
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        detail += f" (verifier exit {r.exit_code}{'; ' + r.killed_by if r.killed_by else ''}); verifier output: {tail}"
    return GradeResult(task.id, "passed" if reward >= 1.0 else "failed", exit_code=r.exit_code, duration_s=duration,
                       detail=detail, tests_run=1, outcomes={"reward": str(reward)})


def split_outcomes(before: dict[str, str], after: dict[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(fail-to-pass, pass-to-pass) from suite outcomes without and with the change."""
    passed = [t for t, o in after.items() if o == "passed"]
    return (tuple(sorted(t for t in passed if before.get(t) != "passed")),
            tuple(sorted(t for t in passed if before.get(t) == "passed")))


def suite_outcomes(sb: LocalSandbox, hidden: Path, command: str, timeout_s: float = 600.0) -> dict[str, str]:
    """Copy `hidden` into the sandbox, run `command` ({junit} = the report), return the outcomes
    ({} when no readable report was written). What builders use to measure fail/pass-to-pass."""
    files = {str(f.relative_to(hidden)): f for f in hidden.rglob("*") if f.is_file()}
    if files:
        sb.exec(["tar", "-x", "-f", "-"], stdin=_tar(files), timeout_s=300)
    junit = f".oc-junit-{uuid.uuid4().hex}.xml"
    sb.exec(command.format(junit=junit), timeout_s=timeout_s)
    cat = sb.exec(["cat", "--", junit], timeout_s=120, output_limit=256 << 20)
    try:
        return parse_junit(cat.stdout) if cat.exit_code == 0 else {}
    except JunitError:
        return {}


def _restore_protected(task: Task, sb: LocalSandbox) -> dict[str, Path]:
    """Runner-rigging files: new ones are deleted here; the base versions are returned, to be
    written back with the hidden files."""
    names = task.spec.verifier.protected
    if not names:
        return {}
    expr = " -o ".join(f"-name {n}" for n in names)
    r = sb.exec(f"find . -path ./.git -prune -o \\( {expr} \\) -type f -print", timeout_s=60)
    restore: dict[str, Path] = {}
    extra = []
    for rel in r.stdout.split():
        rel = rel.removeprefix("./")
        if (task.repo / rel).is_file():
            restore[rel] = task.repo / rel
        else:
            extra.append(rel)
    if extra:
        sb.exec(["rm", "-f", "--", *extra], timeout_s=60)
    for name in names:  # base versions the agent deleted come back too
        for base in task.repo.rglob(name):
            if ".git" not in base.relative_to(task.repo).parts and base.is_file():
                restore[str(base.relative_to(task.repo))] = base
    return restore


def _tar(files: dict[str, Path]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for rel, path in sorted(files.items()):
            tf.add(path, arcname=rel, recursive=False)
    return buf.getvalue()
