"""SWE-bench-style instances and SWE-smith-style mirrors, imported without Docker and gated."""

from __future__ import annotations

import os
import subprocess

from opencomposer.evals.runner import EvalConfig, policy_factory, run_eval
from opencomposer.tasks import gates
from opencomposer.tasks.builders.importers import import_swebench, import_swesmith, node_to_junit
from opencomposer.tasks.format import Task
from opencomposer.tasks.patch import GIT_ENV

CALC_BUG = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_OK = CALC_BUG.replace("a - b", "a + b")
TESTS_OLD = "from pkg.calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
TESTS_NEW = ("import os\nfrom pkg.calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\n"
             "def test_add():\n    assert os.getcwd() == '/testbed'  # the absolute path the tests expect\n"
             "    assert add(2, 3) == 5\n")
FAST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -p no:cacheprovider -o addopts= --junitxml={junit} {tests}"


def sh(repo, *args, input=None):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, input=input,
                          env={**os.environ, **GIT_ENV}).stdout.decode()


def write(repo, files):
    for p, t in files.items():
        (repo / p).parent.mkdir(parents=True, exist_ok=True)
        (repo / p).write_text(t)


def test_node_ids():
    assert node_to_junit("tests/test_x.py::test_y") == "tests.test_x::test_y"
    assert node_to_junit("tests/test_x.py::TestC::test_y[a-1]") == "tests.test_x.TestC::test_y[a-1]"


def test_swebench_instance(tmp_path):
    repo = tmp_path / "proj"
    repo.mkdir()
    sh(repo, "init", "-q")
    write(repo, {"pkg/__init__.py": "", "pkg/calc.py": CALC_BUG, "tests/test_calc.py": TESTS_OLD})
    sh(repo, "add", "-A")
    sh(repo, "commit", "-qm", "base")
    base = sh(repo, "rev-parse", "HEAD").strip()
    write(repo, {"pkg/calc.py": CALC_OK})
    patch = sh(repo, "diff")
    sh(repo, "checkout", "-q", "--", ".")
    write(repo, {"tests/test_calc.py": TESTS_NEW})
    test_patch = sh(repo, "diff")
    sh(repo, "checkout", "-q", "--", ".")
    inst = {"instance_id": "proj__proj-1", "repo": "org/proj", "base_commit": base, "patch": patch,
            "test_patch": test_patch, "FAIL_TO_PASS": '["tests/test_calc.py::test_add"]',
            "PASS_TO_PASS": ["tests/test_calc.py::test_mul"], "problem_statement": "add() subtracts"}
    root = import_swebench(inst, repo, tmp_path / "tasks", command=FAST)
    t = Task.load(root)
    assert t.spec.workdir == "/testbed" and t.prompt == "add() subtracts"
    assert t.spec.verifier.fail_to_pass == ("tests.test_calc::test_add",)
    assert not (t.repo / "tests" / "test_calc.py").exists() and (t.hidden / "tests" / "test_calc.py").exists()
    assert [g for g in gates.validate(root) if not g.ok] == []
    s = run_eval(EvalConfig(tasks=root), policy_factory("oracle"), tmp_path / "ev")
    assert s["accuracy"] == 1.0


def test_swesmith_mirror(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    sh(mirror, "init", "-q", "-b", "main")
    write(mirror, {"pkg/__init__.py": "", "pkg/calc.py": CALC_OK,
                   "tests/test_calc.py": TESTS_NEW.replace("    assert os.getcwd() == '/testbed'  # the absolute path "
                                                           "the tests expect\n", "")})
    sh(mirror, "add", "-A")
    sh(mirror, "commit", "-qm", "clean")
    sh(mirror, "checkout", "-qb", "proj.abc123")
    write(mirror, {"pkg/calc.py": CALC_BUG})
    sh(mirror, "commit", "-qam", "bug")
    sh(mirror, "checkout", "-q", "main")
    inst = {"instance_id": "proj.abc123", "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
            "PASS_TO_PASS": ["tests/test_calc.py::test_mul"]}
    root = import_swesmith(mirror, inst, tmp_path / "tasks", command=FAST)
    t = Task.load(root)
    assert "+    return a + b" in t.reference_patch and "test_add" in t.prompt
    assert [g for g in gates.validate(root) if not g.ok] == []


def test_harbor_task(tmp_path):
    t = tmp_path / "hello-world"
    write(t, {"instruction.md": "Make hello.py greet the world.\n",
              "task.toml": 'version = "1.0"\n[metadata]\ncategory = "scripting"\ntags = ["easy"]\n'
                           '[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 120.0\n',
              "environment/Dockerfile": "FROM python:3.11\nWORKDIR /app\nCOPY hello.py /app/\n",
              "environment/hello.py": "print('hello moon')\n",
              "tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\ncd /app\n"
                               "if [ \"$(python hello.py)\" = 'hello world' ] && [ \"$PWD\" = /app ]; then "
                               "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
              "solution/solve.sh": "#!/bin/bash\nsed -i 's/moon/world/' /app/hello.py\n"})
    from opencomposer.tasks.builders.importers import import_harbor

    root = import_harbor(t, tmp_path / "tasks")
    task = Task.load(root)
    assert task.spec.workdir == "/app" and task.spec.category == "scripting" and task.spec.tags == ("easy",)
    assert task.spec.verifier.reward_file and "+print('hello world')" in task.reference_patch
    assert not (task.repo / "tests").exists() and not (task.repo / "Dockerfile").exists()
    assert [g for g in gates.validate(root) if not g.ok] == []
    assert run_eval(EvalConfig(tasks=root), policy_factory("oracle"), tmp_path / "ev")["accuracy"] == 1.0
    # An agent that writes its own reward file cannot pass: /logs/verifier is the grader's alone.
    cheat = ("diff --git a/cheat.sh b/cheat.sh\nnew file mode 100644\n--- /dev/null\n+++ b/cheat.sh\n@@ -0,0 +1 @@\n"
             "+echo 1 > /logs/verifier/reward.txt\n")
    from opencomposer.tasks.grade import grade_patch

    assert not grade_patch(task, cheat).passed
