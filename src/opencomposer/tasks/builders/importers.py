"""Importers: SWE-bench-style instances and SWE-smith-style mirrors, run without Docker.

Both produce ordinary task folders (and so pass through the same integrity gates):
- the repository is the base tree with *no* history and without any version of the test files
  the instance's tests live in (the gates insist the hidden tests are absent);
- the hidden files are the tests as the verifier needs them;
- pytest node ids (`tests/test_x.py::TestC::test_y[1]`) become the JUnit ids the grader reads
  (`tests.test_x.TestC::test_y[1]`);
- `workdir` binds the task's folder to the absolute path its tests expect (`/testbed` for
  SWE-bench images) instead of building an image.

SWE-bench instance fields used: instance_id, base_commit, patch, test_patch, FAIL_TO_PASS,
PASS_TO_PASS (lists, or JSON strings of lists), problem_statement. SWE-smith mirrors keep one branch
per instance whose head commit introduced the bug; the gold change is that commit reversed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from opencomposer.tasks.builders.git_history import is_test_path
from opencomposer.tasks.format import Task, TaskSpec, TaskStats, VerifierSpec
from opencomposer.tasks.patch import apply_patch, changed_files, git, init_single_commit_repo, patch_stats

PYTEST = "python -m pytest -p no:cacheprovider -o addopts= -rA --junitxml={junit} {tests}"


def node_to_junit(node: str) -> str:
    """`tests/test_x.py::TestC::test_y[p]` -> `tests.test_x.TestC::test_y[p]` (pytest's JUnit naming)."""
    path, _, rest = node.partition("::")
    if not rest:
        return node
    module = path[:-3].replace("/", ".") if path.endswith(".py") else path.replace("/", ".")
    parts = rest.split("::")
    return f"{'.'.join([module, *parts[:-1]])}::{parts[-1]}"


def _ids(value) -> tuple[str, ...]:
    items = json.loads(value) if isinstance(value, str) else list(value or [])
    return tuple(node_to_junit(i) for i in items)


def _test_files(ids: tuple[str, ...], patch_files: list[str]) -> list[str]:
    files = {f for f in patch_files if f.endswith(".py")}
    for i in ids:
        mod = i.split("::")[0]
        for f in patch_files:
            if f.endswith(".py") and f[:-3].replace("/", ".") in mod:
                files.add(f)
    return sorted(files)


def _export(repo: Path, rev: str, dest: Path) -> None:
    dest.mkdir(parents=True)
    data = subprocess.run(["git", "-C", str(repo), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=data, check=True)


def _write(out_dir: Path, tid: str, base_tree: Path, hidden_files: dict[str, bytes], gold: str, prompt: str,
           f2p: tuple[str, ...], p2p: tuple[str, ...], test_files: list[str], *, source: str, category: str,
           workdir: str, command: str) -> Path:
    root = out_dir / re.sub(r"[^A-Za-z0-9_.-]+", "-", tid)
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(base_tree, root / "repo", symlinks=True)
    for rel in hidden_files:
        (root / "repo" / rel).unlink(missing_ok=True)
    base = init_single_commit_repo(root / "repo", f"{tid} base")
    for rel, data in hidden_files.items():
        (root / "hidden" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "hidden" / rel).write_bytes(data)
    (root / "hidden").mkdir(exist_ok=True)
    (root / "reference.patch").write_text(gold)
    (root / "prompt.md").write_text(prompt.strip() + "\n")
    files, lines = patch_stats(gold)
    Task.write_spec(root, TaskSpec(
        id=root.name, category=category, source=source, base_revision=base, workdir=workdir, tags=(source.split(":")[0],),
        verifier=VerifierSpec(command=command.format(junit="{junit}", tests=" ".join(test_files)),
                              fail_to_pass=f2p, pass_to_pass=p2p),
        stats=TaskStats(prompt_chars=len(prompt.strip()), files_changed=files, lines_changed=lines)))
    return root


def import_swebench(instance: dict, checkout: str | Path, out_dir: Path, *, workdir: str = "/testbed",
                    command: str = PYTEST) -> Path:
    """One SWE-bench-style instance, given a git checkout of its repository."""
    checkout = Path(checkout)
    for key in ("instance_id", "base_commit", "patch", "test_patch", "FAIL_TO_PASS"):
        if key not in instance:
            raise ValueError(f"instance is missing {key!r}")
    f2p, p2p = _ids(instance["FAIL_TO_PASS"]), _ids(instance.get("PASS_TO_PASS"))
    with tempfile.TemporaryDirectory(prefix="oc-swe-") as tmp:
        base = Path(tmp) / "base"
        _export(checkout, instance["base_commit"], base)
        after_tests = Path(tmp) / "tests"
        shutil.copytree(base, after_tests, symlinks=True)
        git(after_tests, "init", "-q")
        apply_patch(after_tests, instance["test_patch"])
        touched = [p for p, kind in changed_files(instance["test_patch"]) if kind != "deleted"]
        hidden = {p: (after_tests / p).read_bytes() for p in touched}
        tests = _test_files(f2p + p2p, touched)
        return _write(out_dir, instance["instance_id"], base, hidden, instance["patch"],
                      instance.get("problem_statement") or f"Resolve {instance['instance_id']}.", f2p, p2p, tests,
                      source=f"swebench:{instance.get('repo', checkout.name)}@{instance['base_commit']}",
                      category="bug_fix", workdir=workdir, command=command)


def import_swesmith(mirror: str | Path, instance: dict, out_dir: Path, *, workdir: str = "/testbed",
                    command: str = PYTEST) -> Path:
    """One SWE-smith-style instance: branch `instance_id` of `mirror` holds the bug in its head commit."""
    mirror = Path(mirror)
    branch = instance["instance_id"]
    if git(mirror, "rev-parse", "-q", "--verify", f"refs/heads/{branch}", check=False).returncode != 0:
        raise ValueError(f"{mirror}: no branch {branch!r}")
    f2p, p2p = _ids(instance["FAIL_TO_PASS"]), _ids(instance.get("PASS_TO_PASS"))
    bug_files = git(mirror, "diff", "--name-only", f"{branch}^", branch).stdout.decode().split()
    code = [f for f in bug_files if not is_test_path(f)]
    gold = git(mirror, "diff", "--binary", "--no-color", branch, f"{branch}^", "--", *code).stdout.decode("utf-8",
                                                                                                      "replace")
    with tempfile.TemporaryDirectory(prefix="oc-smith-") as tmp:
        base = Path(tmp) / "base"
        _export(mirror, branch, base)
        test_paths = sorted({i.split("::")[0].replace(".", "/") for i in f2p + p2p})
        hidden = {}
        for f in base.rglob("*.py"):
            rel = str(f.relative_to(base))
            if is_test_path(rel) and any(rel[:-3].startswith(t) or t.startswith(rel[:-3]) for t in test_paths):
                hidden[rel] = f.read_bytes()
        prompt = instance.get("problem_statement") or \
            f"Tests {', '.join(sorted({i.split('::')[-1] for i in f2p})[:3])} fail. Find and fix the bug."
        return _write(out_dir, branch, base, hidden, gold, prompt, f2p, p2p, sorted(hidden),
                      source=f"swesmith:{mirror.name}@{branch}", category="bug_fix", workdir=workdir, command=command)


def import_harbor(task_dir: str | Path, out_dir: Path) -> Path:
    """A Harbor / Terminal-Bench task folder (`instruction.md`, `task.toml`, `environment/`,
    `tests/test.sh`, optional `solution/solve.sh`), without Docker: the environment's files become
    the repository at the Dockerfile's WORKDIR (default /app), the tests are mounted at /tests only
    while grading, and the reward the tests write to /logs/verifier/reward.txt is the outcome. The
    gold change is what `solve.sh` does, run in a sandbox; without it the gold gate rejects the
    task. Dockerfile RUN steps are not executed: tasks that need them fail the gates and are rejected."""
    import tomllib

    from opencomposer.harness.agent import ensure_git_baseline, final_diff
    from opencomposer.sandbox.base import SandboxConfig
    from opencomposer.sandbox.local import Workspace

    task_dir = Path(task_dir)
    for need in ("instruction.md", "tests/test.sh"):
        if not (task_dir / need).exists():
            raise ValueError(f"{task_dir}: not a Harbor task (missing {need})")
    meta = tomllib.loads((task_dir / "task.toml").read_text()) if (task_dir / "task.toml").exists() else {}
    env = task_dir / "environment"
    workdir = "/app"
    if (env / "Dockerfile").exists():
        for line in (env / "Dockerfile").read_text().splitlines():
            if line.strip().upper().startswith("WORKDIR "):
                workdir = line.split(None, 1)[1].strip()
    with tempfile.TemporaryDirectory(prefix="oc-harbor-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        if env.is_dir():
            for p in env.iterdir():
                if p.name in ("Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore"):
                    continue
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, base / p.name)
        gold = ""
        solve = task_dir / "solution" / "solve.sh"
        if solve.exists():
            cfg = SandboxConfig(workdir=workdir, mounts=(f"{task_dir / 'solution'}:/solution",))
            with Workspace(base, cfg) as ws, ws.sandbox() as sb:
                ensure_git_baseline(sb)
                r = sb.exec("bash /solution/solve.sh", timeout_s=float(meta.get("agent", {}).get("timeout_sec", 600)))
                if r.exit_code == 0:
                    gold = final_diff(sb)
        tests = {f"tests/{p.relative_to(task_dir / 'tests')}": p.read_bytes()
                 for p in (task_dir / "tests").rglob("*") if p.is_file()}
        md = meta.get("metadata", {})
        root = _write(out_dir, task_dir.name, base, tests, gold, (task_dir / "instruction.md").read_text(), (), (), [],
                      source=f"harbor:{task_dir.name}", category=str(md.get("category") or "terminal"),
                      workdir=workdir, command="bash /tests/test.sh")
    spec = Task.load(root).spec
    timeout = float(meta.get("verifier", {}).get("timeout_sec", spec.verifier.timeout_s))
    import dataclasses

    Task.write_spec(root, dataclasses.replace(
        spec, tags=tuple(md.get("tags") or spec.tags),
        verifier=dataclasses.replace(spec.verifier, copy_hidden=False, mounts=("hidden/tests:/tests",),
                                     reward_file="/logs/verifier/reward.txt", timeout_s=timeout)))
    return root
