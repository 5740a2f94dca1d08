"""Tasks from real git history: a repository made here, commit by commit."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from opencomposer.tasks import gates
from opencomposer.tasks.builders.git_history import GitHistoryConfig, build_from_git, is_test_path
from opencomposer.tasks.format import Task
from opencomposer.tasks.patch import GIT_ENV


def commit(repo, files: dict[str, str], message: str) -> None:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    env = {**os.environ, **GIT_ENV}
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", message], check=True, env=env)


def make_history(repo):
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    commit(repo, {"pkg/__init__.py": "", "pkg/calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
                  "    return a * b\n", "tests/test_calc.py": "from pkg.calc import mul\n\n\ndef test_mul():\n"
                  "    assert mul(2, 3) == 6\n"}, "initial")
    commit(repo, {"pkg/calc.py": "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
                  "tests/test_calc.py": "from pkg.calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
                  "\n\ndef test_add():\n    assert add(2, 3) == 5\n"}, "Fix add returning the difference")
    commit(repo, {"README.md": "calc\n"}, "docs")
    commit(repo, {"pkg/text.py": "def shout(s):\n    return s.upper() + '!'\n",
                  "tests/test_text.py": "from pkg.text import shout\n\n\ndef test_shout():\n"
                  "    assert shout('hi') == 'HI!'\n"}, "Add shout()")
    commit(repo, {"tests/test_calc.py": "from pkg.calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 2) == 4\n"
                  "\n\ndef test_add():\n    assert add(2, 3) == 5\n"}, "tests only")


def test_test_path_heuristic():
    assert is_test_path("tests/test_x.py") and is_test_path("pkg/test_y.py") and is_test_path("a/b_test.py")
    assert not is_test_path("pkg/testing_utils.py") and not is_test_path("pkg/calc.py")


FAST = GitHistoryConfig(test_command="PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + GitHistoryConfig().test_command)


def test_build_from_history(tmp_path):
    repo = tmp_path / "proj"
    make_history(repo)
    made = build_from_git(repo, tmp_path / "tasks", FAST)
    tasks = sorted((Task.load(p) for p in made), key=lambda t: t.prompt)
    assert [t.prompt for t in tasks] == ["Add shout()", "Fix add returning the difference"]
    shout, fix = tasks
    assert fix.spec.category == "bug_fix" and shout.spec.category == "feature"
    assert fix.spec.verifier.fail_to_pass == ("tests.test_calc::test_add",)
    assert fix.spec.verifier.pass_to_pass == ("tests.test_calc::test_mul",)
    assert "return a + b" in fix.reference_patch and "tests/" not in fix.reference_patch
    assert not (fix.repo / "tests" / "test_calc.py").exists()  # no version of the hidden tests is visible
    assert "a - b" in (fix.repo / "pkg" / "calc.py").read_text()
    for t in tasks:
        assert [g for g in gates.validate(t.root) if not g.ok] == []


def test_prompt_rewrite_through_a_policy(tmp_path):
    from opencomposer.harness.policy import ScriptedPolicy

    repo = tmp_path / "proj"
    make_history(repo)
    policy = ScriptedPolicy([{"content": "add a shout helper"}])
    made = build_from_git(repo, tmp_path / "tasks", dataclasses.replace(FAST, max_tasks=1), policy=policy)
    assert [Task.load(p).prompt for p in made] == ["add a shout helper"]
    assert "Add shout()" in policy.seen[0][1]["content"]


def test_cli_build_git(tmp_path):
    repo = tmp_path / "proj"
    make_history(repo)
    r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "tasks", "build-git", "--repo", str(repo),
                        "--out", str(tmp_path / "t"), "--max-tasks", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 validated tasks" in r.stdout, r.stderr
