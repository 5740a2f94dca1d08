"""Integrity gates (`opencomposer tasks validate`): a task is accepted only if it is sound.

Task factories are where RL stacks leak answers (anchors-rl §5.6, anchors-env §2.2-2.3). Each gate
below guards against one known leak or defect, and each has a test that plants it:

- structure        the folder loads (task.toml, prompt.md, repo/, hidden/, reference.patch)
- hidden_absent    no hidden file is present in the repository, by path or by content
- history          the repository's git holds exactly its base commit: no later commits, other
                   refs, stashes, reflog entries or unreachable objects
- caches           no bytecode, test/type-checker/linter caches or build outputs
- reference_leak   the gold change's significant added lines are not already in the repository
- gold_passes      base + reference.patch passes the verifier
- noop_fails       the base repository fails it
- deterministic    grading gold twice gives the same outcome for every test
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from opencomposer.sandbox.local import Workspace
from opencomposer.tasks.format import Task, TaskError
from opencomposer.tasks.grade import grade_patch
from opencomposer.tasks.patch import git

CACHE_NAMES = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", ".tox", ".nox",
               ".coverage", "build", "dist", ".eggs", "node_modules", ".pyre", ".pytype"}
CACHE_SUFFIXES = (".pyc", ".pyo", ".egg-info", ".orig", ".rej")


@dataclass(frozen=True)
class GateResult:
    name: str
    ok: bool
    detail: str = ""


def validate(task_dir: str | Path, *, run_tests: bool = True) -> list[GateResult]:
    try:
        task = Task.load(task_dir)
    except TaskError as e:
        return [GateResult("structure", False, str(e))]
    out = [GateResult("structure", True), hidden_absent(task), history(task), caches(task), reference_leak(task)]
    if run_tests:
        with Workspace(task.repo, task.sandbox_config()) as ws:
            gold = grade_patch(task, task.reference_patch, ws)
            detail = gold.detail or gold.status
            notes = import_notes(task) if not gold.passed else ""
            if notes:
                detail = f"{notes}; {detail}"
            out.append(GateResult("gold_passes", gold.passed, detail))
            noop = grade_patch(task, "", ws)
            out.append(GateResult("noop_fails", noop.status == "failed",
                                  f"noop status {noop.status}" + (f": {noop.detail}" if noop.passed else "")))
            again = grade_patch(task, task.reference_patch, ws)
            same = again.outcomes == gold.outcomes and again.status == gold.status
            diff = sorted(t for t in set(gold.outcomes) | set(again.outcomes)
                          if gold.outcomes.get(t) != again.outcomes.get(t))
            out.append(GateResult("deterministic", same, "" if same else f"flaky: {', '.join(diff[:5])}"))
    return out


def keep_valid(paths: list[Path]) -> tuple[list[Path], list[tuple[Path, list[GateResult]]]]:
    """Run every gate on each task folder; delete the ones that fail. Returns (kept, rejected with
    their failed gates) — what builders and importers do with what they make."""
    import shutil

    kept, rejected = [], []
    for p in paths:
        failed = [g for g in validate(p) if not g.ok]
        if failed:
            shutil.rmtree(p, ignore_errors=True)
            rejected.append((p, failed))
        else:
            kept.append(p)
    return kept, rejected


def import_notes(task: Task) -> str:
    """What the importer noted about the task (e.g. "no solution"), if anything."""
    f = task.root / "import.json"
    if not f.is_file():
        return ""
    try:
        return "; ".join(str(v) for v in json.loads(f.read_text()).values())
    except (ValueError, AttributeError):
        return f"unreadable {f.name}"


def describe(failed: list[GateResult]) -> str:
    return "; ".join(f"{g.name}: {g.detail}" for g in failed)


def hidden_absent(task: Task) -> GateResult:
    """By path where the verifier puts the hidden files (copied into the workspace, or mounted
    elsewhere: Harbor's /tests), and by content anywhere in the repository."""
    hashes = {}
    for f in task.hidden.rglob("*"):
        if f.is_file():
            rel = f.relative_to(task.hidden)
            where = _in_workspace(task, rel)
            if where is not None and (task.repo / where).exists():
                return GateResult("hidden_absent", False, f"hidden file {rel} is present in repo/")
            data = f.read_bytes()
            if len(data) >= 64:  # tiny files (empty __init__.py) collide innocently
                hashes[hashlib.sha256(data).hexdigest()] = rel
    for f in _repo_files(task.repo):
        if hashlib.sha256(f.read_bytes()).hexdigest() in hashes:
            rel = hashes[hashlib.sha256(f.read_bytes()).hexdigest()]
            return GateResult("hidden_absent", False, f"{f.relative_to(task.repo)} is a copy of hidden {rel}")
    return GateResult("hidden_absent", True)


def _in_workspace(task: Task, rel: Path) -> Path | None:
    """Where hidden file `rel` lands in the workspace at grading time (None: outside it)."""
    spec = task.spec.verifier
    if spec.copy_hidden:
        return rel
    workdir = Path(task.spec.workdir)
    for m in spec.mounts:
        src, _, dst = m.partition(":")
        dst = dst.split(":")[0]
        src_rel = Path(src).relative_to("hidden") if Path(src).parts[:1] == ("hidden",) else None
        if src_rel is not None and (src_rel == Path(".") or rel.is_relative_to(src_rel)):
            target = Path(dst) / rel.relative_to(src_rel)
            return target.relative_to(workdir) if target.is_relative_to(workdir) else None
    return None


def history(task: Task) -> GateResult:
    repo = task.repo
    if not (repo / ".git").exists():
        return GateResult("history", True, "no git repository")
    commits = git(repo, "rev-list", "--all", "--count").stdout.decode().strip()
    if commits != "1":
        return GateResult("history", False, f"{commits} commits reachable from refs (only the base may exist)")
    refs = git(repo, "for-each-ref", "--format=%(refname)").stdout.decode().split()
    extra = [r for r in refs if not r.startswith("refs/heads/")] + [r for r in refs if r.startswith("refs/heads/")][1:]
    if extra:
        return GateResult("history", False, f"extra refs: {', '.join(extra)}")
    if (repo / ".git" / "refs" / "stash").exists() or (repo / ".git" / "logs" / "refs" / "stash").exists():
        return GateResult("history", False, "a stash exists")
    logs = repo / ".git" / "logs"
    if logs.exists():
        for f in logs.rglob("*"):
            if f.is_file() and len(f.read_text(errors="replace").splitlines()) > 1:
                return GateResult("history", False, f"reflog {f.relative_to(repo)} records earlier states")
    unreachable = git(repo, "fsck", "--unreachable", "--no-reflogs", "--no-progress", check=False).stdout.decode()
    if unreachable.strip():
        return GateResult("history", False, f"unreachable objects: {unreachable.splitlines()[0]}")
    return GateResult("history", True)


def caches(task: Task) -> GateResult:
    for p in task.repo.rglob("*"):
        if ".git" in p.relative_to(task.repo).parts[:1]:
            continue
        if p.name in CACHE_NAMES or p.name.endswith(CACHE_SUFFIXES):
            return GateResult("caches", False, f"{p.relative_to(task.repo)} may reveal removed or future code")
    return GateResult("caches", True)


def reference_leak(task: Task, share: float = 0.8) -> GateResult:
    """Is the gold change already in the repository? Looks for `share` of any added hunk (at least
    three non-blank lines, whitespace-normalised) appearing as consecutive lines of a repository
    file. Shorter shared runs are ordinary duplication (colorsys repeats eight lines of
    rgb_to_hls in rgb_to_hsv); most of a hunk is a leftover of the answer."""
    hunks, cur = [], []
    for ln in task.reference_patch.splitlines():
        if ln.startswith("+") and not ln.startswith("+++"):
            if ln[1:].strip():
                cur.append(" ".join(ln[1:].split()))
        elif cur:
            hunks.append(cur)
            cur = []
    if cur:
        hunks.append(cur)
    blocks = set()
    for h in hunks:
        if len(h) < 3:
            continue
        w = max(3, math.ceil(share * len(h)))
        blocks |= {"\n".join(h[i: i + w]) for i in range(len(h) - w + 1)}
    if not blocks:
        return GateResult("reference_leak", True, "no added block long enough to check")
    for f in _repo_files(task.repo):
        try:
            text = "\n".join(" ".join(ln.split()) for ln in f.read_text().splitlines() if ln.strip())
        except (UnicodeDecodeError, OSError):
            continue
        for b in blocks:
            if b in text:
                return GateResult("reference_leak", False,
                                  f"{f.relative_to(task.repo)} already holds gold lines: {b.splitlines()[0]!r} ...")
    return GateResult("reference_leak", True)


def _repo_files(repo: Path):
    for f in repo.rglob("*"):
        if f.is_file() and ".git" not in f.relative_to(repo).parts[:1]:
            yield f
