"""Importers: SWE-bench instances and SWE-smith mirrors as published, run without Docker.

Both produce ordinary task folders (and so pass through the same integrity gates):
- the repository is the base tree with *no* history and without any version of the files that
  hold the instance's fail-to-pass tests (the gates insist the hidden tests are absent);
- the hidden files are those tests as the verifier needs them;
- pytest node ids (`tests/test_x.py::TestC::test_y[1]`) become the JUnit ids the grader reads
  (`tests.test_x.TestC::test_y[1]`);
- `workdir` binds the task's folder to the absolute path its tests expect (`/testbed` for
  SWE-bench images) instead of building an image;
- the task runs in an environment built from the repository's declared dependencies plus the test
  runner (tasks/environment.py), never in the harness's own;
- the task id and the base commit's message are neutral (`<repo>-<hash>`, "Initial commit"): the
  published instance id, which names SWE-smith's mutation (`func_pm_remove_cond`), stays in
  `source` on the host side, where the agent cannot read it.

SWE-bench instance fields used: instance_id, base_commit, patch, test_patch, FAIL_TO_PASS,
PASS_TO_PASS (lists, or JSON strings of lists), problem_statement.

SWE-smith mirrors as published: the mirror's main is the clean code (the gold); each instance is a
branch whose parent commit introduces the bug and whose tip only deletes the fail-to-pass test
files ("Remove F2P Tests"). The agent starts from the tip; the hidden tests are the files the tip
deleted; the gold change is main's code against the tip's parent. FAIL_TO_PASS/PASS_TO_PASS come
from the instance, or are derived by running the suite at the bug and at the gold revision in
sandboxes (`derive_tests`, or when the instance has none). A branch whose tip is the bug commit
itself (no test-deleting commit) is read the same way with the tip as the bug.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.core.errors import UserError
from opencomposer.tasks.builders.git_history import is_test_path
from opencomposer.tasks.environment import EnvironmentSpec, declared_requirements
from opencomposer.tasks.format import Task, TaskSpec, TaskStats, VerifierSpec
from opencomposer.tasks.patch import apply_patch, changed_files, git, init_single_commit_repo, patch_stats

PYTEST = "python -m pytest -p no:cacheprovider -o addopts= -rA --junitxml={junit} {tests}"
BASE_MESSAGE = "Initial commit"
PROBLEMS = "import.json"
"""Host-side notes an importer leaves in a task folder (e.g. why no gold change could be made);
the gates add them to their failure messages."""


class ImportRejected(ValueError, UserError):
    """An instance cannot become a task; the message says why and what to do."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportConfig:
    """What every importer takes (`opencomposer tasks import ... --env/--setup/--test-cmd`, or a TOML)."""

    workdir: str = "/testbed"
    """Absolute path the tests expect (SWE-bench/SWE-smith; Harbor reads its Dockerfile's WORKDIR)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the agent and the verifier, e.g. PYTHONPATH=/testbed/src."""
    setup: tuple[str, ...] = ()
    """Commands run in the workspace before the agent starts and before grading."""
    test_cmd: str | None = None
    """The verifier command; `{junit}` is the report path, `{tests}` the test files. Default: pytest."""
    requirements: tuple[str, ...] | None = None
    """The environment's packages; None: the repository's declared dependencies."""
    runner: tuple[str, ...] | None = None
    """The test runner's packages; None: pytest (tasks/environment.py)."""
    harness_env: bool = False
    """Run in the harness's own environment (no isolation: only for debugging an import)."""
    derive_tests: bool = False
    """SWE-smith: derive FAIL_TO_PASS/PASS_TO_PASS by running the suite at both revisions, even
    where the instance lists them."""
    timeout_s: float = 600.0


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


def neutral_id(repo_name: str, instance_id: str) -> str:
    """`<repo>-<hash>`: nothing of how the instance was made (builder, mutation) shows in the id,
    which appears in paths inside the sandbox."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", repo_name).strip("-").lower()[:40] or "task"
    return f"{name}-{hashlib.sha1(instance_id.encode()).hexdigest()[:10]}"


def _file_of(test_id: str, tree: Path) -> str | None:
    """The file holding a JUnit test id (`tests.test_x.TestC::test_y` -> tests/test_x.py), if any."""
    parts = test_id.split("::")[0].split(".")
    for n in range(len(parts), 0, -1):
        rel = "/".join(parts[:n]) + ".py"
        if (tree / rel).is_file():
            return rel
    return None


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


def environment_for(tree: Path, cfg: ImportConfig) -> EnvironmentSpec:
    reqs = declared_requirements(tree) if cfg.requirements is None else cfg.requirements
    return EnvironmentSpec(requirements=tuple(reqs), runner=cfg.runner, harness=cfg.harness_env)


def write_task(out_dir: Path, tid: str, base_tree: Path, hidden_files: dict[str, bytes], gold: str, prompt: str,
               f2p: tuple[str, ...], p2p: tuple[str, ...], command: str, *, source: str, category: str,
               cfg: ImportConfig, workdir: str, remove_hidden: bool = True, tags: tuple[str, ...] = (),
               problems: dict | None = None, environment: EnvironmentSpec | None = None) -> Path:
    """A task folder from a base tree; `remove_hidden` deletes the hidden files' paths from the
    repository (SWE-bench/SWE-smith; Harbor mounts its tests elsewhere and keeps the tree as shipped)."""
    root = out_dir / tid
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(base_tree, root / "repo", symlinks=True)
    if remove_hidden:
        for rel in hidden_files:
            (root / "repo" / rel).unlink(missing_ok=True)
    for cache in [p for p in (root / "repo").rglob("__pycache__") if p.is_dir()]:
        shutil.rmtree(cache, ignore_errors=True)
    base = init_single_commit_repo(root / "repo", BASE_MESSAGE)
    (root / "hidden").mkdir(parents=True, exist_ok=True)
    for rel, data in hidden_files.items():
        (root / "hidden" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "hidden" / rel).write_bytes(data)
    (root / "reference.patch").write_text(gold)
    (root / "prompt.md").write_text(prompt.strip() + "\n")
    if problems:
        (root / PROBLEMS).write_text(json.dumps(problems, indent=1) + "\n")
    files, lines = patch_stats(gold)
    Task.write_spec(root, TaskSpec(
        id=tid, category=category, source=source, base_revision=base, workdir=workdir, tags=tags,
        setup=cfg.setup, env=dict(cfg.env), environment=environment or environment_for(base_tree, cfg),
        verifier=VerifierSpec(command=command, fail_to_pass=f2p, pass_to_pass=p2p, timeout_s=cfg.timeout_s),
        stats=TaskStats(prompt_chars=len(prompt.strip()), files_changed=files, lines_changed=lines)))
    return root


def _command(cfg: ImportConfig, tests: list[str]) -> str:
    return (cfg.test_cmd or PYTEST).replace("{tests}", " ".join(tests))


def import_swebench(instance: dict, checkout: str | Path, out_dir: Path, cfg: ImportConfig = ImportConfig()) -> Path:
    """One SWE-bench instance as published, given a git checkout of its repository."""
    checkout = Path(checkout)
    for key in ("instance_id", "base_commit", "patch", "test_patch", "FAIL_TO_PASS"):
        if key not in instance:
            raise ImportRejected(f"instance is missing {key!r} (SWE-bench fields: instance_id, base_commit, patch, "
                                 "test_patch, FAIL_TO_PASS, PASS_TO_PASS)")
    f2p, p2p = _ids(instance["FAIL_TO_PASS"]), _ids(instance.get("PASS_TO_PASS"))
    with tempfile.TemporaryDirectory(prefix="oc-swe-") as tmp:
        base = Path(tmp) / "base"
        try:
            _export(checkout, instance["base_commit"], base)
        except subprocess.CalledProcessError:
            raise ImportRejected(f"{checkout}: base_commit {instance['base_commit']} is not in this checkout "
                                 "(fetch the full history)") from None
        after_tests = Path(tmp) / "tests"
        shutil.copytree(base, after_tests, symlinks=True)
        git(after_tests, "init", "-q")
        apply_patch(after_tests, instance["test_patch"])
        touched = [p for p, kind in changed_files(instance["test_patch"]) if kind != "deleted"]
        hidden = {p: (after_tests / p).read_bytes() for p in touched}
        tests = _test_files(f2p + p2p, touched)
        repo_name = str(instance.get("repo") or checkout.name).split("/")[-1]
        return write_task(out_dir, neutral_id(repo_name, instance["instance_id"]), base, hidden, instance["patch"],
                          instance.get("problem_statement") or "Fix the failing behaviour described by the tests.",
                          f2p, p2p, _command(cfg, tests), cfg=cfg, workdir=cfg.workdir, category="bug_fix",
                          source=f"swebench:{instance.get('repo', checkout.name)}@{instance['base_commit']}"
                                 f"#{instance['instance_id']}", tags=("swebench",))


def _only_deletes_tests(mirror: Path, rev: str) -> list[str] | None:
    """The files `rev` deletes, if all it does is delete test files (SWE-smith's "Remove F2P Tests")."""
    out = git(mirror, "diff", "--name-status", "--no-renames", f"{rev}^", rev).stdout.decode().splitlines()
    rows = [ln.split("\t", 1) for ln in out if ln.strip()]
    if rows and all(st == "D" and is_test_path(path) for st, path in rows):
        return [path for _, path in rows]
    return None


def import_swesmith(mirror: str | Path, instance: dict, out_dir: Path, cfg: ImportConfig = ImportConfig(), *,
                    main: str | None = None) -> Path:
    """One SWE-smith instance: branch `instance_id` of `mirror` (see the module docstring for the
    layout). `main` names the clean branch (default: main, else master)."""
    mirror = Path(mirror)
    branch = instance["instance_id"]
    if git(mirror, "rev-parse", "-q", "--verify", f"refs/heads/{branch}", check=False).returncode != 0:
        raise ImportRejected(f"{mirror}: no branch {branch!r} (a SWE-smith mirror has one branch per instance_id)")
    main = main or next((b for b in ("main", "master") if git(mirror, "rev-parse", "-q", "--verify", f"refs/heads/{b}",
                                                                check=False).returncode == 0), None)
    if main is None:
        raise ImportRejected(f"{mirror}: no main or master branch holds the clean code")
    removed = _only_deletes_tests(mirror, branch)
    bug_rev = f"{branch}^" if removed is not None else branch
    gold_rev = git(mirror, "merge-base", main, branch).stdout.decode().strip()
    changed = git(mirror, "diff", "--name-only", "--no-renames", bug_rev, gold_rev).stdout.decode().split()
    code = [f for f in changed if not is_test_path(f)]
    if not code:
        raise ImportRejected(f"{branch}: the bug commit changes no code outside tests (bug at {bug_rev})")
    gold = git(mirror, "diff", "--binary", "--no-color", bug_rev, gold_rev, "--", *code).stdout.decode("utf-8",
                                                                                                     "replace")
    with tempfile.TemporaryDirectory(prefix="oc-smith-") as tmp:
        bug_tree, start = Path(tmp) / "bug", Path(tmp) / "start"
        _export(mirror, bug_rev, bug_tree)
        _export(mirror, branch, start)
        env_spec = environment_for(bug_tree, cfg)
        if cfg.derive_tests or not instance.get("FAIL_TO_PASS"):
            gold_tree = Path(tmp) / "gold"
            _export(mirror, gold_rev, gold_tree)
            f2p, p2p = derive_tests(bug_tree, gold_tree, cfg, env_spec)
        else:
            f2p, p2p = _ids(instance["FAIL_TO_PASS"]), _ids(instance.get("PASS_TO_PASS"))
        if removed is not None:
            hidden = {rel: (bug_tree / rel).read_bytes() for rel in removed}
        else:  # older layout (the tip is the bug): the files holding fail-to-pass tests are hidden
            hidden = {f: (bug_tree / f).read_bytes() for f in {_file_of(t, bug_tree) for t in f2p} if f}
        if not f2p:
            raise ImportRejected(f"{branch}: no test fails at the bug and passes at the gold revision")
        files = sorted(set(hidden) | {f for f in (_file_of(t, bug_tree) for t in f2p + p2p) if f})
        prompt = instance.get("problem_statement") or \
            f"Tests {', '.join(sorted({i.split('::')[-1] for i in f2p})[:3])} fail. Find and fix the bug."
        repo_name = str(instance.get("repo") or mirror.name).split("/")[-1].split(".")[0]
        return write_task(out_dir, neutral_id(repo_name, branch), start, hidden, gold, prompt, f2p, p2p,
                          _command(cfg, files), cfg=cfg, workdir=cfg.workdir, category="bug_fix",
                          source=f"swesmith:{mirror.name}@{branch}", tags=("swesmith",), environment=env_spec)


def derive_tests(bug_tree: Path, gold_tree: Path, cfg: ImportConfig,
                 env_spec: EnvironmentSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """FAIL_TO_PASS and PASS_TO_PASS measured: the whole suite at the bug and at the gold revision,
    each in a sandbox of the task's environment."""
    from opencomposer.sandbox.base import SandboxConfig
    from opencomposer.sandbox.local import Workspace
    from opencomposer.tasks import environment
    from opencomposer.tasks.grade import split_outcomes, suite_outcomes

    box = environment.sandbox_config(env_spec, SandboxConfig(workdir=cfg.workdir), dict(cfg.env))
    command = _command(cfg, [])
    outcomes = []
    for tree in (bug_tree, gold_tree):
        with tempfile.TemporaryDirectory(prefix="oc-nohidden-") as empty, Workspace(tree, box) as ws, \
                ws.sandbox() as sb:
            for cmd in cfg.setup:
                sb.exec(cmd, timeout_s=cfg.timeout_s)
            outcomes.append(suite_outcomes(sb, Path(empty), command, cfg.timeout_s))
    return split_outcomes(*outcomes)
