"""Tasks built from real code (the stdlib's colorsys and its tests), the gates that guard them
(each planted leak must be caught), and hardened grading."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest

from opencomposer.tasks import gates
from opencomposer.tasks.builders.deletion import BuildConfig, build_tasks
from opencomposer.tasks.default import stdlib_sources
from opencomposer.tasks.format import Task, TaskError, load_dataset
from opencomposer.tasks.grade import grade_patch
from opencomposer.tasks.patch import GIT_ENV, apply_patch


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    paths = build_tasks(stdlib_sources()["colorsys"], out, BuildConfig(max_single=4, max_multi=0))
    return paths


@pytest.fixture
def task_dir(built, tmp_path):
    """A private copy of one built deletion task, to plant leaks in."""
    src = next(p for p in built if "delete" in Task.load(p).spec.tags)
    dst = tmp_path / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def failed(results):
    return {g.name for g in results if not g.ok}


def test_built_tasks_pass_every_gate(built):
    assert len(built) >= 3
    kinds = {Task.load(p).spec.category for p in built}
    assert {"feature", "bug_fix"} <= kinds
    for p in built:
        assert failed(gates.validate(p)) == set(), p.name
        t = Task.load(p)
        assert t.spec.verifier.fail_to_pass and t.spec.verifier.pass_to_pass
        assert t.spec.stats.files_changed == 1 and t.spec.stats.lines_changed > 0
        assert len(t.prompt) == t.spec.stats.prompt_chars < 400


def test_rename_tasks_from_real_code_pass_every_gate(tmp_path):
    """Renames of colorsys functions: the hidden tests call the new name, the repository has the
    old one; the reference renames the definition and its `__all__` entry, and every gate holds
    (the oracle passes, the untouched repository fails, nothing leaks)."""
    from opencomposer.tasks.builders.rename import build_renames

    paths = build_renames(stdlib_sources()["colorsys"], tmp_path, max_tasks=2)
    assert len(paths) == 2
    for p in paths:
        assert failed(gates.validate(p)) == set(), p.name
        t = Task.load(p)
        assert t.spec.category == "refactor" and t.prompt.startswith("Rename `")
        old, new = re.findall(r"`([^`]+)`", t.prompt)[0], re.findall(r"`([^`]+)`", t.prompt)[2]
        assert f"def {old}(" in (p / "repo" / "colorsys.py").read_text()
        hidden = (p / "hidden" / "test_colorsys.py").read_text()
        assert f"colorsys.{new}(" in hidden and f"colorsys.{old}(" not in hidden
        assert f"+def {new}(" in t.reference_patch and t.spec.verifier.fail_to_pass
    # The demonstration edits the lines its search showed: no read turn, and it passes.
    from opencomposer.evals.demonstration import demonstration_turns
    from opencomposer.evals.runner import EvalConfig, policy_factory, run_eval

    turns = demonstration_turns(Task.load(paths[0]))
    assert [c["name"] for t in turns for c in t.get("tool_calls", [])][:2] == ["grep", "search_replace"]
    s = run_eval(EvalConfig(tasks=paths[0], passes=1), policy_factory("demonstration"), tmp_path / "demo")
    assert s["accuracy"] == 1.0 and s["tool_error_rate"] == 0


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**__import__("os").environ, **GIT_ENV})


def test_gate_catches_a_future_commit(task_dir):
    t = Task.load(task_dir)
    apply_patch(t.repo, t.reference_patch)
    git(t.repo, "commit", "-qam", "the solution")
    git(t.repo, "reset", "-q", "--hard", "HEAD~1")  # checked out at base, but the future is in the reflog
    assert "history" in failed(gates.validate(task_dir, run_tests=False))


def test_gate_catches_a_future_branch(task_dir):
    t = Task.load(task_dir)
    git(t.repo, "checkout", "-qb", "solution")
    apply_patch(t.repo, t.reference_patch)
    git(t.repo, "commit", "-qam", "the solution")
    git(t.repo, "checkout", "-q", "main")
    assert "history" in failed(gates.validate(task_dir, run_tests=False))


def test_gate_catches_a_stash(task_dir):
    t = Task.load(task_dir)
    apply_patch(t.repo, t.reference_patch)
    git(t.repo, "stash", "-q")
    assert "history" in failed(gates.validate(task_dir, run_tests=False))


def test_gate_catches_bytecode_of_deleted_code(task_dir):
    t = Task.load(task_dir)
    cache = t.repo / "__pycache__"
    cache.mkdir()
    (cache / "colorsys.cpython-311.pyc").write_bytes(b"\x00bytecode of the original module")
    assert failed(gates.validate(task_dir, run_tests=False)) == {"caches"}


def test_gate_catches_a_visible_hidden_test(task_dir):
    t = Task.load(task_dir)
    shutil.copy(t.hidden / "test_colorsys.py", t.repo / "test_colorsys.py")
    assert "hidden_absent" in failed(gates.validate(task_dir, run_tests=False))
    (t.repo / "test_colorsys.py").rename(t.repo / "renamed_copy.py")  # same content under another name
    assert "hidden_absent" in failed(gates.validate(task_dir, run_tests=False))


def test_gate_catches_the_answer_left_in_the_repo(task_dir):
    t = Task.load(task_dir)
    added = [ln[1:] for ln in t.reference_patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    (t.repo / "notes.txt").write_text("\n".join(added))
    assert "reference_leak" in failed(gates.validate(task_dir, run_tests=False))


def test_gate_catches_a_gold_patch_that_prints_passed(task_dir):
    t = Task.load(task_dir)
    fake = ("diff --git a/colorsys.py b/colorsys.py\n--- a/colorsys.py\n+++ b/colorsys.py\n@@ -1,1 +1,3 @@\n"
            "+import os, sys; print('OK: all tests PASSED'); sys.stdout.flush(); os._exit(0)\n+\n"
            f" {(t.repo / 'colorsys.py').read_text().splitlines()[0]}\n")
    (task_dir / "reference.patch").write_text(fake)
    res = {g.name: g for g in gates.validate(task_dir)}
    assert not res["gold_passes"].ok


def test_gate_catches_a_task_that_is_already_solved(task_dir):
    t = Task.load(task_dir)
    apply_patch(t.repo, t.reference_patch)
    git(t.repo, "commit", "-q", "--amend", "-am", "base")
    git(t.repo, "reflog", "expire", "--expire=now", "--all")
    git(t.repo, "gc", "-q", "--prune=now")
    (task_dir / "reference.patch").write_text("")
    res = {g.name: g for g in gates.validate(task_dir)}
    assert not res["noop_fails"].ok


def test_malformed_task_folders(task_dir, tmp_path):
    (task_dir / "prompt.md").unlink()
    assert failed(gates.validate(task_dir)) == {"structure"}
    with pytest.raises(TaskError, match="missing prompt.md"):
        Task.load(task_dir)
    bad = tmp_path / "bad"
    shutil.copytree(task_dir, bad)
    (bad / "prompt.md").write_text("x")
    (bad / "task.toml").write_text("id = 3\nnonsense = true\n")
    with pytest.raises(TaskError, match="task.toml"):
        Task.load(bad)
    with pytest.raises(TaskError, match="not found"):
        load_dataset(tmp_path / "nope")


# -- grading ----------------------------------------------------------------------------------------


def _solution_plus(t: Task, extra_files: dict[str, str]) -> str:
    """The gold patch plus new files (as a patch)."""
    patch = t.reference_patch
    for path, text in extra_files.items():
        body = "".join(f"+{ln}\n" for ln in text.splitlines())
        patch += (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
                  f"@@ -0,0 +1,{len(text.splitlines())} @@\n{body}")
    return patch


def test_grading_ignores_rigged_runner_files_and_fake_reports(task_dir):
    t = Task.load(task_dir)
    rig = "import os\nprint('PASSED')\nos._exit(0)\n"
    # Without the fix, rigging files and a fake report cannot make it pass.
    noop_rigged = _solution_plus(t, {"sitecustomize.py": rig, "conftest.py": rig,
                                     ".oc-junit.xml": "<testsuite><testcase classname='x' name='y'/></testsuite>"})
    noop_rigged = noop_rigged[len(t.reference_patch):]
    r = grade_patch(t, noop_rigged)
    assert not r.passed and r.status == "failed"
    # With the fix plus a rigging file, the rigging is removed and the real tests decide.
    assert grade_patch(t, _solution_plus(t, {"sitecustomize.py": rig})).passed


def test_grading_a_suite_that_does_not_run(task_dir):
    t = Task.load(task_dir)
    crash = "diff --git a/colorsys.py b/colorsys.py\n--- a/colorsys.py\n+++ b/colorsys.py\n@@ -1,1 +1,2 @@\n" \
            f"+raise SystemExit(0)\n {(t.repo / 'colorsys.py').read_text().splitlines()[0]}\n"
    r = grade_patch(t, crash)
    assert not r.passed and r.status in ("no_tests_ran", "failed")


def test_grader_timeout_and_infra_failure(task_dir):
    t = Task.load(task_dir)
    # The verifier's own limit, set in the spec (a text edit of task.toml once missed it: the builder
    # writes 2x the suite's time, and the hang ran into that 60 s limit instead).
    Task.write_spec(task_dir, dataclasses.replace(t.spec, verifier=dataclasses.replace(t.spec.verifier, timeout_s=2.0)))
    hang = "diff --git a/colorsys.py b/colorsys.py\n--- a/colorsys.py\n+++ b/colorsys.py\n@@ -1,1 +1,2 @@\n" \
           f"+while True: pass\n {(t.repo / 'colorsys.py').read_text().splitlines()[0]}\n"
    r = grade_patch(Task.load(task_dir), hang)
    assert r.status == "no_tests_ran" and "timeout" in r.detail
    assert r.duration_s < 30, r.duration_s  # stopped at its 2 s limit, not at a default
    spec = Task.load(task_dir).spec
    Task.write_spec(task_dir, dataclasses.replace(spec, setup=("exit 3",)))
    r = grade_patch(Task.load(task_dir), t.reference_patch)
    assert r.status == "infra_error" and "setup" in r.detail


def test_gate_catches_flaky_tests(task_dir):
    t = Task.load(task_dir)
    # Twenty coin-flip tests: two gradings agree on all of them with probability 2**-20.
    flaky = "import os\nimport unittest\n\n\nclass Flaky(unittest.TestCase):\n" + "".join(
        f"    def test_{i}(self):\n        self.assertTrue(os.urandom(1)[0] % 2)\n\n" for i in range(20))
    (t.hidden / "test_flaky.py").write_text(flaky)
    toml = (task_dir / "task.toml").read_text().replace("test_colorsys\"", "test_colorsys test_flaky\"")
    (task_dir / "task.toml").write_text(toml)
    res = {g.name: g for g in gates.validate(task_dir)}
    assert not res["deterministic"].ok and "flaky" in res["deterministic"].detail


def test_deleting_the_stdlib_named_module_does_not_pass(built, tmp_path):
    """colorsys is also in the interpreter's standard library: a "fix" that deletes the workspace's
    copy must fail, not pass against the stdlib's (the runner's --local check)."""
    src = next(p for p in built if "mutate" in Task.load(p).spec.tags)
    t = Task.load(src)
    assert "--local colorsys" in t.spec.verifier.command
    delete = ("diff --git a/colorsys.py b/colorsys.py\ndeleted file mode 100644\n--- a/colorsys.py\n+++ /dev/null\n"
              + "@@ -1,%d +0,0 @@\n" % len((t.repo / "colorsys.py").read_text().splitlines())
              + "".join(f"-{ln}\n" for ln in (t.repo / "colorsys.py").read_text().splitlines()))
    res = grade_patch(t, delete)
    assert not res.passed and res.status == "failed", res
    # The control: the same command without the check passes the deletion (the leak is real).
    dst = tmp_path / "nocheck"
    shutil.copytree(src, dst, symlinks=True)
    spec = dataclasses.replace(t.spec, verifier=dataclasses.replace(
        t.spec.verifier, command=t.spec.verifier.command.replace("--local colorsys ", "")))
    Task.write_spec(dst, spec)
    assert grade_patch(Task.load(dst), delete).passed


def test_tasks_kept_for_rl_are_not_demonstrated_to_sft(tmp_path):
    """`SpeedrunConfig.rl_share`: a task kept for RL gets no demonstration in SFT's data, and RL
    draws from those tasks only (a task id RL does not have is a clear error)."""
    import json

    from opencomposer.rl.loop import RLConfig, RLError, Run
    from opencomposer.speedrun.agent import AgentSettings, kept_for_rl, run_demonstrations
    from opencomposer.tasks.builders.rename import build_renames

    family = tmp_path / "family"
    paths = build_renames(stdlib_sources()["colorsys"], family, max_tasks=2)
    ids = [Task.load(p).id for p in paths]
    assert [p.name for p in paths] == ids
    (family / "manifest.json").write_text(json.dumps({"tasks": [{"id": i, "split": "train"} for i in ids]}))
    assert kept_for_rl(family, "train", 0.0) == () and sorted(kept_for_rl(family, "train", 1.0)) == sorted(ids)
    assert kept_for_rl(family, "train", 0.5) == kept_for_rl(family, "train", 0.5)  # a fixed partition
    with pytest.raises(ValueError, match="keeps none of the 2 tasks"):
        kept_for_rl(family, "train", 1e-9)
    demos = run_demonstrations(AgentSettings(), family, "train", tmp_path / "demos", exclude=(ids[0],))
    assert [p.name.split(".")[0] for p in demos] == [ids[1]]
    with pytest.raises(RuntimeError, match="2 tasks kept for RL"):
        run_demonstrations(AgentSettings(), family, "train", tmp_path / "demos2", exclude=tuple(ids))
    with pytest.raises(RLError, match="among the 1 task ids given"):
        Run(RLConfig(model=tmp_path / "no-model", tasks=family, split="train", task_ids=("colorsys-missing",)),
            tmp_path / "rl")
