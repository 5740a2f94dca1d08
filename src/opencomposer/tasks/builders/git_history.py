"""Tasks from git history: commits that change code together with tests.

For a commit C with parent P: the repository state is P's tree *without* the test files C touches
(and with no history at all: one fresh commit), the hidden tests are C's versions of those test
files, the gold change is C's diff of the non-test files, and the prompt is a terse statement of
the intent — the commit's subject by default, or a rewrite by a model through `Policy` when one is
given. Fail-to-pass and pass-to-pass tests are measured by running the hidden tests on P's code and
on C's code, in sandboxes; a commit with no fail-to-pass test is not a task.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opencomposer.sandbox.base import SandboxConfig
from opencomposer.sandbox.local import Workspace
from opencomposer.tasks import environment
from opencomposer.tasks.environment import EnvironmentSpec, declared_requirements
from opencomposer.tasks.format import Task, TaskSpec, TaskStats, VerifierSpec
from opencomposer.tasks.grade import split_outcomes, suite_outcomes
from opencomposer.tasks.patch import git, init_single_commit_repo, patch_stats

log = logging.getLogger(__name__)
TEST_PATH = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)")


@dataclass(frozen=True, kw_only=True, slots=True)
class GitHistoryConfig:
    max_commits: int = 200
    """Commits examined (newest first along the first-parent line)."""
    max_tasks: int = 20
    test_command: str = "python -m pytest -q -p no:cacheprovider -o addopts= --junitxml={junit} {tests}"
    """`{tests}` becomes the hidden test files; `{junit}` the report path."""
    max_files: int = 40
    """Skip commits touching more files than this (vendoring, mass renames)."""
    timeout_s: float = 600.0


def is_test_path(path: str) -> bool:
    return bool(TEST_PATH.search(path))


def candidate_commits(repo: Path, cfg: GitHistoryConfig) -> list[tuple[str, str, list[str], list[str]]]:
    """[(commit, subject, code files, test files)] for non-merge commits changing both."""
    log_out = git(repo, "log", "--first-parent", "--no-merges", f"-n{cfg.max_commits}", "--format=%H%x00%s").stdout
    out = []
    for line in log_out.decode("utf-8", "replace").splitlines():
        sha, _, subject = line.partition("\0")
        if not git(repo, "rev-parse", "-q", "--verify", f"{sha}^", check=False).stdout.strip():
            continue  # the root commit has no parent to start from
        files = git(repo, "diff", "--name-only", "--no-renames", f"{sha}^", sha).stdout.decode().split()
        if not files or len(files) > cfg.max_files:
            continue
        tests = [f for f in files if is_test_path(f) and f.endswith(".py")]
        code = [f for f in files if not is_test_path(f) and f.endswith(".py")]
        if tests and code:
            out.append((sha, subject, code, tests))
    return out


def _export(repo: Path, rev: str, dest: Path) -> None:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _outcomes(code_dir: Path, hidden: Path, command: str, sandbox: SandboxConfig | None, timeout_s: float) -> dict:
    with Workspace(code_dir, sandbox) as ws, ws.sandbox() as sb:
        return suite_outcomes(sb, hidden, command, timeout_s)


def rewrite_prompt(policy, subject: str, body: str, stat: str) -> str:
    """A terse request in a user's words, from the commit (through any Policy)."""
    msgs = [{"role": "system", "content": "Rewrite a commit as the short request a developer would type to a coding "
                                          "agent: one or two sentences, imperative, no file names unless essential, "
                                          "never mention tests or the commit. Reply with the request only."},
            {"role": "user", "content": f"{subject}\n\n{body}\n\n{stat}"}]
    text = (policy.complete(msgs, []).content or "").strip()
    return text or subject


def build_from_git(repo: str | Path, out_dir: Path, cfg: GitHistoryConfig = GitHistoryConfig(), *,
                   sandbox: SandboxConfig | None = None, policy=None,
                   progress: Callable[[str], None] | None = None) -> list[Path]:
    repo = Path(repo).resolve()
    if not (repo / ".git").exists():
        raise ValueError(f"not a git repository: {repo}")
    say = progress or (lambda m: None)
    made: list[Path] = []
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", repo.name)
    for sha, subject, code, tests in candidate_commits(repo, cfg):
        if len(made) >= cfg.max_tasks:
            break
        with tempfile.TemporaryDirectory(prefix="oc-git-") as tmp:
            tmp = Path(tmp)
            before, after = tmp / "before", tmp / "after"
            _export(repo, f"{sha}^", before)
            _export(repo, sha, after)
            hidden = tmp / "hidden"
            for t in tests:
                if (after / t).exists():
                    (hidden / t).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(after / t, hidden / t)
                    (before / t).unlink(missing_ok=True)  # the agent never sees any version of them
                    (after / t).unlink()
            present = [t for t in tests if (hidden / t).exists()]
            if not present:
                continue
            command = cfg.test_command.format(junit="{junit}", tests=" ".join(present))
            env_spec = EnvironmentSpec(requirements=declared_requirements(before))
            box = environment.sandbox_config(env_spec, sandbox)
            pre = _outcomes(before, hidden, command, box, cfg.timeout_s)
            post = _outcomes(after, hidden, command, box, cfg.timeout_s)
            f2p, p2p = split_outcomes(pre, post)
            if not f2p:
                say(f"{sha[:8]}: no fail-to-pass test, skipped")
                continue
            tid = f"{name}-{sha[:10]}"
            root = out_dir / tid
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(before, root / "repo")
            base = init_single_commit_repo(root / "repo", f"{name} at {sha[:10]}^")
            shutil.copytree(hidden, root / "hidden")
            patch = git(repo, "diff", "--binary", "--no-color", f"{sha}^", sha, "--", *code).stdout.decode("utf-8",
                                                                                                       "replace")
            (root / "reference.patch").write_text(patch)
            prompt = subject.strip()
            if policy is not None:
                body = git(repo, "log", "-1", "--format=%b", sha).stdout.decode("utf-8", "replace")
                stat = git(repo, "diff", "--stat", f"{sha}^", sha, "--", *code).stdout.decode("utf-8", "replace")
                prompt = rewrite_prompt(policy, subject, body, stat)
            (root / "prompt.md").write_text(prompt + "\n")
            files, lines = patch_stats(patch)
            category = "bug_fix" if re.search(r"\b(fix|bug|error|crash|wrong|regression)", subject, re.I) else "feature"
            Task.write_spec(root, TaskSpec(
                id=tid, category=category, source=f"git:{repo.name}@{sha}", base_revision=base, environment=env_spec,
                tags=("git-history",), verifier=VerifierSpec(command=command, fail_to_pass=f2p, pass_to_pass=p2p),
                stats=TaskStats(prompt_chars=len(prompt), files_changed=files, lines_changed=lines)))
            made.append(root)
            say(f"{sha[:8]}: task {tid} ({len(f2p)} fail-to-pass)")
    return made
