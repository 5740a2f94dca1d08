"""Published task layouts (SWE-bench instances, SWE-smith mirrors, Harbor folders), each built here
from a small real repository, imported without Docker, gated, and calibrated: the oracle (gold
change through the harness's own tools, parallel calls on) scores 100%, noop 0%."""

from __future__ import annotations

import json
import os
import subprocess

from opencomposer.evals.runner import EvalConfig, policy_factory, run_eval
from opencomposer.harness.agent import AgentConfig
from opencomposer.sandbox import reaper
from opencomposer.tasks import gates
from opencomposer.tasks.builders.harbor import dockerfile_facts, import_harbor
from opencomposer.tasks.builders.importers import ImportConfig, import_swebench, import_swesmith, node_to_junit
from opencomposer.tasks.format import Task
from opencomposer.tasks.grade import grade_patch, grading_config
from opencomposer.tasks.patch import GIT_ENV

CALC_BUG = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_OK = CALC_BUG.replace("a - b", "a + b")
TESTS_OLD = "from pkg.calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
TESTS_NEW = ("import os\nfrom pkg.calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\n"
             "def test_add():\n    assert os.getcwd() == '/testbed'  # the absolute path the tests expect\n"
             "    assert add(2, 3) == 5\n")
FAST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -p no:cacheprovider -o addopts= --junitxml={junit} {tests}"
CFG = ImportConfig(test_cmd=FAST)


def sh(repo, *args, input=None):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, input=input,
                          env={**os.environ, **GIT_ENV}).stdout.decode()


def write(repo, files):
    for p, t in files.items():
        (repo / p).parent.mkdir(parents=True, exist_ok=True)
        (repo / p).write_text(t)


def calibrate(root, tmp_path):
    """Gates pass; oracle with parallel tool calls scores 1.0; noop 0.0."""
    assert [g for g in gates.validate(root) if not g.ok] == []
    par = EvalConfig(tasks=root, agent=AgentConfig(parallel_tool_calls=True))
    assert run_eval(par, policy_factory("oracle"), tmp_path / "ev-oracle")["accuracy"] == 1.0
    assert run_eval(par, policy_factory("noop"), tmp_path / "ev-noop")["accuracy"] == 0.0


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
    root = import_swebench(inst, repo, tmp_path / "tasks", CFG)
    t = Task.load(root)
    assert t.spec.workdir == "/testbed" and t.prompt == "add() subtracts"
    assert t.spec.verifier.fail_to_pass == ("tests.test_calc::test_add",)
    assert not (t.repo / "tests" / "test_calc.py").exists() and (t.hidden / "tests" / "test_calc.py").exists()
    assert "proj__proj-1" not in t.id and t.spec.source.endswith("#proj__proj-1")
    calibrate(root, tmp_path)


# A SWE-smith mirror as published: main is clean; the instance branch's parent commit plants the
# bug (two hunks in one file, so the oracle edits one file twice in one parallel turn); its tip
# only deletes the fail-to-pass test file.
MATH_OK = ("def add(a, b):\n    return a + b\n\n\n" + "".join(f"def pad{i}():\n    return {i}\n\n\n" for i in range(6))
           + "def mul(a, b):\n    return a * b\n")
MATH_BUG = MATH_OK.replace("return a + b", "return a - b").replace("return a * b", "return a * b + 1")
F2P_TESTS = "from pkg.calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n" \
            "def test_mul():\n    assert mul(2, 3) == 6\n"
P2P_TESTS = "from pkg.calc import pad1\n\n\ndef test_pad():\n    assert pad1() == 1\n"
MUTATION = "proj.abc123.func_pm_op_swap__x1y2"


def make_mirror(tmp_path, *, with_removal=True):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    sh(mirror, "init", "-q", "-b", "main")
    write(mirror, {"pkg/__init__.py": "", "pkg/calc.py": MATH_OK, "tests/test_calc.py": F2P_TESTS,
                   "tests/test_pad.py": P2P_TESTS})
    sh(mirror, "add", "-A")
    sh(mirror, "commit", "-qm", "clean")
    sh(mirror, "checkout", "-qb", MUTATION)
    write(mirror, {"pkg/calc.py": MATH_BUG})
    sh(mirror, "commit", "-qam", "Bug Patch")
    if with_removal:
        sh(mirror, "rm", "-q", "tests/test_calc.py")
        sh(mirror, "commit", "-qm", "Remove F2P Tests")
    sh(mirror, "checkout", "-q", "main")
    return mirror


def test_swesmith_published_mirror(tmp_path):
    mirror = make_mirror(tmp_path)
    inst = {"instance_id": MUTATION, "repo": "swesmith/org__proj.abc123",
            "FAIL_TO_PASS": ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"],
            "PASS_TO_PASS": ["tests/test_pad.py::test_pad"]}
    root = import_swesmith(mirror, inst, tmp_path / "tasks", CFG)
    t = Task.load(root)
    # The bug is at the branch's parent; the gold restores main's code; the deleted tests are hidden.
    assert "+    return a + b" in t.reference_patch and "+    return a * b\n" in t.reference_patch
    assert "tests/test_calc.py" not in t.reference_patch
    assert (t.hidden / "tests" / "test_calc.py").read_text() == F2P_TESTS
    assert not (t.repo / "tests" / "test_calc.py").exists() and (t.repo / "tests" / "test_pad.py").exists()
    assert "a - b" in (t.repo / "pkg" / "calc.py").read_text()
    # Nothing inside the sandbox names the mutation: not the id (it shows in mount paths), not git.
    assert "func_pm" not in t.id and "func_pm" not in sh(t.repo, "log", "--format=%B")
    assert MUTATION in t.spec.source  # the host side keeps the published id
    calibrate(root, tmp_path)


def test_swesmith_tests_derived_without_an_instances_file(tmp_path):
    mirror = make_mirror(tmp_path)
    root = import_swesmith(mirror, {"instance_id": MUTATION}, tmp_path / "tasks", CFG)
    spec = Task.load(root).spec.verifier
    assert spec.fail_to_pass == ("tests.test_calc::test_add", "tests.test_calc::test_mul")
    assert spec.pass_to_pass == ("tests.test_pad::test_pad",)
    assert [g for g in gates.validate(root) if not g.ok] == []


def test_swesmith_older_layout_tip_is_the_bug(tmp_path):
    mirror = make_mirror(tmp_path, with_removal=False)
    inst = {"instance_id": MUTATION, "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
            "PASS_TO_PASS": ["tests/test_pad.py::test_pad"]}
    root = import_swesmith(mirror, inst, tmp_path / "tasks", CFG)
    t = Task.load(root)
    assert (t.hidden / "tests" / "test_calc.py").exists() and not (t.repo / "tests" / "test_calc.py").exists()
    assert [g for g in gates.validate(root) if not g.ok] == []


def smith_mirror(tmp_path, branch: str, clean: dict, bug: dict, f2p_file: str):
    """A SWE-smith mirror as published, for one instance: main clean, the branch's parent plants
    `bug`, its tip deletes `f2p_file`."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    sh(mirror, "init", "-q", "-b", "main")
    write(mirror, clean)
    sh(mirror, "add", "-A")
    sh(mirror, "commit", "-qm", "clean")
    sh(mirror, "checkout", "-qb", branch)
    write(mirror, bug)
    sh(mirror, "commit", "-qam", "Bug Patch")
    sh(mirror, "rm", "-q", f2p_file)
    sh(mirror, "commit", "-qm", "Remove F2P Tests")
    return mirror


def test_src_layout_needs_its_environment(tmp_path):
    """A src-layout package: without PYTHONPATH the tests cannot import it (gold fails); with
    `--env PYTHONPATH=/testbed/src` it imports, and the oracle passes."""
    mirror = smith_mirror(tmp_path, "srcpkg.1", {
        "pyproject.toml": '[project]\nname = "srcpkg"\nversion = "0"\ndependencies = []\n',
        "src/srcpkg/__init__.py": "def double(x):\n    return 2 * x\n",
        "tests/test_double.py": "from srcpkg import double\n\n\ndef test_double():\n"
                                "    assert double(2) == 4\n",
        "tests/test_import.py": "import srcpkg\n\n\ndef test_import():\n    assert srcpkg\n"},
        {"src/srcpkg/__init__.py": "def double(x):\n    return 3 * x\n"}, "tests/test_double.py")
    inst = {"instance_id": "srcpkg.1", "FAIL_TO_PASS": ["tests/test_double.py::test_double"],
            "PASS_TO_PASS": ["tests/test_import.py::test_import"]}
    bare = import_swesmith(mirror, inst, tmp_path / "bare", CFG)
    gold = [g for g in gates.validate(bare) if g.name == "gold_passes"][0]
    assert not gold.ok and "missing" in gold.detail
    cfg = ImportConfig(test_cmd=FAST, env={"PYTHONPATH": "/testbed/src"})
    root = import_swesmith(mirror, inst, tmp_path / "tasks", cfg)
    assert Task.load(root).spec.env["PYTHONPATH"] == "/testbed/src"
    calibrate(root, tmp_path)


def test_harness_packages_are_not_visible_planted_leak(tmp_path):
    """The repository is a package the harness itself has installed (idna). A "fix" that deletes the
    repository's package must fail: the tests may not fall back to the harness's copy. The control
    (the same task in the harness's environment) shows the leak is real."""
    mirror = smith_mirror(tmp_path, "idna.1", {
        "idna/__init__.py": "def encode(s, **kw):\n    return s.encode('ascii')\n",
        "tests/test_encode.py": "import idna\n\n\ndef test_encode():\n"
                                "    assert idna.encode('example.com') == b'example.com'\n",
        "tests/test_other.py": "def test_other():\n    assert True\n"},
        {"idna/__init__.py": "def encode(s, **kw):\n    return s.upper().encode('ascii')\n"}, "tests/test_encode.py")
    inst = {"instance_id": "idna.1", "FAIL_TO_PASS": ["tests/test_encode.py::test_encode"],
            "PASS_TO_PASS": ["tests/test_other.py::test_other"]}
    hack = ("diff --git a/idna/__init__.py b/idna/__init__.py\ndeleted file mode 100644\n--- a/idna/__init__.py\n"
            "+++ /dev/null\n@@ -1,2 +0,0 @@\n-def encode(s, **kw):\n-    return s.upper().encode('ascii')\n")
    root = import_swesmith(mirror, inst, tmp_path / "tasks", CFG)
    task = Task.load(root)
    assert grade_patch(task, task.reference_patch).passed
    assert not grade_patch(task, hack).passed
    leaky = import_swesmith(mirror, inst, tmp_path / "leaky", ImportConfig(test_cmd=FAST, harness_env=True))
    assert grade_patch(Task.load(leaky), hack).passed  # the control: the harness's idna answers


HARBOR_TEST_SH = ("#!/bin/bash\nmkdir -p /logs/verifier\ncd /app\n"
                  "if python -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then echo 1 > /logs/verifier/reward.txt;"
                  " else echo 0 > /logs/verifier/reward.txt; fi\n")


def harbor_task(tmp_path, name="hello-world", solution=True):
    t = tmp_path / name
    files = {"instruction.md": "Make hello.py greet the world.\n",
             "task.toml": 'version = "1.0"\n[metadata]\ncategory = "scripting"\ntags = ["easy"]\n'
                          '[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 120.0\n',
             "environment/Dockerfile": "FROM python:3.11\nWORKDIR /app\nCOPY . /app/\nRUN apt-get update && "
                                       "pip install --no-cache-dir 'iniconfig' \\\n    && echo done\n",
             "environment/hello.py": "def greet():\n    return 'hello moon'\n",
             # The environment ships its own tests/ beside the verifier's: it must stay as shipped.
             "environment/tests/test_app.py": "from hello import greet\n\n\ndef test_shape():\n"
                                              "    assert greet().startswith('hello')\n",
             "tests/test.sh": HARBOR_TEST_SH,
             "tests/test_outputs.py": "import sys\nsys.path.insert(0, '/app')\nfrom hello import greet\n\n\n"
                                      "def test_world():\n    assert greet() == 'hello world'\n"}
    if solution:
        files["solution/solve.sh"] = "#!/bin/bash\nsed -i 's/moon/world/' /app/hello.py\n"
    write(t, files)
    return t


def test_harbor_task(tmp_path):
    assert dockerfile_facts(harbor_task(tmp_path) / "environment" / "Dockerfile") == ("/app", ("iniconfig",))
    root = import_harbor(tmp_path / "hello-world", tmp_path / "tasks")
    task = Task.load(root)
    assert task.spec.workdir == "/app" and task.spec.category == "scripting" and task.spec.tags == ("easy",)
    assert task.spec.verifier.reward_file and "+    return 'hello world'" in task.reference_patch
    assert (task.repo / "tests" / "test_app.py").exists() and not (task.repo / "Dockerfile").exists()
    assert "iniconfig" in task.spec.environment.requirements
    calibrate(root, tmp_path)
    # The reward folder is this process's sandbox state (the reaper removes it if we are SIGKILLed
    # mid-grade), and gone after grading.
    with grading_config(task, task.sandbox_config()) as (_, reward_dir):
        assert reward_dir.is_dir() and reward_dir.parent.name == f"owner-{reaper.owner_id()}"
    assert not reward_dir.exists()
    # An agent that writes its own reward file cannot pass: /logs/verifier is the grader's alone.
    cheat = ("diff --git a/cheat.sh b/cheat.sh\nnew file mode 100644\n--- /dev/null\n+++ b/cheat.sh\n@@ -0,0 +1 @@\n"
             "+echo 1 > /logs/verifier/reward.txt\n")
    assert not grade_patch(task, cheat).passed


def test_harbor_gate_failures_say_why(tmp_path):
    root = import_harbor(harbor_task(tmp_path, "nosol", solution=False), tmp_path / "tasks")
    gold = [g for g in gates.validate(root) if g.name == "gold_passes"][0]
    assert not gold.ok and "no solution" in gold.detail
    t = harbor_task(tmp_path, "badsol")
    (t / "solution" / "solve.sh").write_text("#!/bin/bash\necho cannot do it >&2\nexit 3\n")
    gold = [g for g in gates.validate(import_harbor(t, tmp_path / "tasks")) if g.name == "gold_passes"][0]
    assert not gold.ok and "exited 3" in gold.detail and "cannot do it" in gold.detail
    # A verifier failure shows what the verifier printed.
    noop = grade_patch(Task.load(import_harbor(harbor_task(tmp_path, "ok"), tmp_path / "tasks")), "")
    assert not noop.passed and "hello moon" in noop.detail


def test_cli_import_table_env_flags_and_keep_rejected(tmp_path, capsys):
    from opencomposer.cli import main

    mirror = make_mirror(tmp_path)
    (tmp_path / "inst.jsonl").write_text(json.dumps({"instance_id": MUTATION}) + "\n"
                                         + json.dumps({"instance_id": "no.such.branch"}) + "\n")
    out = tmp_path / "tasks"
    rc = main(["tasks", "import", "swesmith", str(mirror), "--instances", str(tmp_path / "inst.jsonl"),
               "--out", str(out), "--test-cmd", FAST, "--env", "FOO=bar", "--setup", "true", "--keep-rejected"])
    text = capsys.readouterr().out
    assert rc == 0 and "1 of 2 accepted" in text and "no branch" in text and "no.such.branch" in text
    (task_dir,) = [p for p in out.iterdir() if (p / "task.toml").exists()]
    spec = Task.load(task_dir).spec
    assert spec.env["FOO"] == "bar" and spec.setup == ("true",) and spec.verifier.command.startswith("PYTEST_DISABLE")
    # A task that fails a gate is kept for inspection with --keep-rejected, with its reason shown.
    harbor_task(tmp_path / "h", "nosol", solution=False)
    rc = main(["tasks", "import", "harbor", str(tmp_path / "h"), "--out", str(tmp_path / "ht"), "--keep-rejected"])
    text = capsys.readouterr().out
    assert rc == 1 and "no solution" in text and any((tmp_path / "ht" / ".rejected").iterdir())
