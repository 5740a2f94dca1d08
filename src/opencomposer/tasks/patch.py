"""Unified diffs of task repositories: make, apply, measure, and turn into post-images."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from opencomposer.core.errors import UserError

GIT_ENV = {"GIT_AUTHOR_NAME": "opencomposer", "GIT_AUTHOR_EMAIL": "tasks@opencomposer",
           "GIT_COMMITTER_NAME": "opencomposer", "GIT_COMMITTER_EMAIL": "tasks@opencomposer",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


class PatchError(RuntimeError, UserError):
    pass


def git(repo: Path, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True,
                       env={**os.environ, **GIT_ENV}, timeout=600)
    if check and r.returncode != 0:
        raise PatchError(f"git {' '.join(args)} in {repo}: {r.stderr.decode(errors='replace').strip()}")
    return r


def diff_dirs(a: Path, b: Path) -> str:
    """The patch that turns directory `a` into `b` (paths relative to each root, git format)."""
    with tempfile.TemporaryDirectory(prefix="oc-diff-") as tmp:
        work = Path(tmp) / "w"
        shutil.copytree(a, work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        git(work, "init", "-q")
        git(work, "add", "-A")
        git(work, "commit", "-qm", "a", "--allow-empty")
        for p in list(work.iterdir()):
            if p.name != ".git":
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        for p in b.iterdir():
            if p.name == ".git":
                continue
            dst = work / p.name
            shutil.copytree(p, dst, symlinks=True) if p.is_dir() and not p.is_symlink() else shutil.copy2(p, dst)
        git(work, "add", "-A")
        return git(work, "diff", "--cached", "--binary", "--no-color", "HEAD").stdout.decode("utf-8", "replace")


def apply_patch(repo: Path, patch: str) -> None:
    if not patch.strip():
        return
    git(repo, "apply", "--whitespace=nowarn", "-", input=patch.encode())


def patch_stats(patch: str) -> tuple[int, int]:
    """(files changed, lines added + removed)."""
    files = sum(1 for ln in patch.splitlines() if ln.startswith("diff --git "))
    lines = sum(1 for ln in patch.splitlines()
                if (ln.startswith("+") and not ln.startswith("+++")) or (ln.startswith("-") and not ln.startswith("---")))
    return files, lines


def changed_files(patch: str) -> list[tuple[str, str]]:
    """[(path, kind)] with kind in added/modified/deleted, from `diff --git` headers."""
    out = []
    cur = None
    kind = "modified"
    for ln in patch.splitlines():
        if ln.startswith("diff --git "):
            if cur:
                out.append((cur, kind))
            cur = ln.split(" b/", 1)[1] if " b/" in ln else ln.split()[-1][2:]
            kind = "modified"
        elif ln.startswith("new file mode"):
            kind = "added"
        elif ln.startswith("deleted file mode"):
            kind = "deleted"
    if cur:
        out.append((cur, kind))
    return out


def post_images(repo: Path, patch: str) -> dict[str, bytes | None]:
    """{path: content after the patch, or None if deleted}: what an editor must write."""
    with tempfile.TemporaryDirectory(prefix="oc-post-") as tmp:
        work = Path(tmp) / "w"
        shutil.copytree(repo, work, symlinks=True)
        apply_patch(work, patch)
        return {p: (None if kind == "deleted" else (work / p).read_bytes()) for p, kind in changed_files(patch)}


def init_single_commit_repo(path: Path, message: str = "base") -> str:
    """Make `path` a git repository whose whole history is one commit of its current content."""
    shutil.rmtree(path / ".git", ignore_errors=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-qm", message, "--allow-empty")
    git(path, "gc", "-q", "--prune=now")
    return git(path, "rev-parse", "HEAD").stdout.decode().strip()


def hunks_by_file(patch: str) -> dict[str, list[tuple[str, str]]]:
    """{path: [(old text, new text)]} per hunk of a unified diff (context lines in both)."""
    out: dict[str, list[tuple[str, str]]] = {}
    path = None
    old: list[str] = []
    new: list[str] = []
    in_hunk = False
    last = " "

    def flush() -> None:
        nonlocal last
        last = " "
        if path is not None and in_hunk and (old or new):
            out.setdefault(path, []).append(("".join(old), "".join(new)))

    for ln in patch.splitlines(keepends=True):
        if ln.startswith("diff --git "):
            flush()
            path, in_hunk, old, new = None, False, [], []
        elif ln.startswith("+++ "):
            target = ln[4:].strip()
            path = target[2:] if target.startswith("b/") else None
        elif ln.startswith("@@"):
            flush()
            in_hunk, old, new = True, [], []
        elif in_hunk and ln.startswith("\\"):  # "\ No newline at end of file": the line before had none
            for side, mark in ((old, "-"), (new, "+")):
                if last in (" ", mark) and side and side[-1].endswith("\n"):
                    side[-1] = side[-1][:-1]
        elif in_hunk and ln[:1] in (" ", "-", "+"):
            last = ln[0]
            body = ln[1:] if ln.endswith("\n") else ln[1:] + "\n"
            if ln[0] in (" ", "-"):
                old.append(body)
            if ln[0] in (" ", "+"):
                new.append(body)
    flush()
    return out
