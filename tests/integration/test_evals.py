"""The eval runner on the bundled benchmark's smallest split: oracle 100%, noop 0%, resumable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opencomposer.evals.runner import EvalConfig, policy_factory, run_eval
from opencomposer.tasks.builders.deletion import BuildConfig
from opencomposer.tasks.default import DefaultBenchmarkConfig, build_default
from tests.conftest import foreground_sigint


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("default")
    m = build_default(out, DefaultBenchmarkConfig(sources=("colorsys",), build=BuildConfig(max_single=4, max_multi=0)))
    assert m.splits().get("smoke"), m.splits()
    return out


def test_manifest_and_split_stats(smoke):
    m = json.loads((smoke / "manifest.json").read_text())
    stats = m["extra"]["split_stats"]
    assert set(stats) == set(m["splits"]) and all(v["tasks"] > 0 for v in stats.values())
    assert all(v["median_prompt_chars"] > 0 and v["median_lines_changed"] > 0 for v in stats.values())


@pytest.mark.parametrize("model,expect", [("oracle", 1.0), ("noop", 0.0)])
def test_calibration_on_the_smoke_split(smoke, tmp_path, model, expect):
    s = run_eval(EvalConfig(tasks=smoke, split="smoke", passes=2, concurrency=2), policy_factory(model), tmp_path)
    assert s["accuracy"] == expect and s["pass@1"] == expect and s["best_of_2"] == expect
    assert s["infra_errors"] == 0 and s["episodes"] == 2 * s["tasks"]
    assert (tmp_path / "report.html").read_text().count("<svg") >= 2
    assert len(list((tmp_path / "trajectories").iterdir())) == s["episodes"]



def test_demonstrations_solve_every_task_in_several_turns_of_real_tool_use(smoke, tmp_path):
    """A demonstration (grep, read around the change, edit, compile, answer) passes like the oracle,
    but through five turns whose every tool call succeeds: what SFT before RL should show."""
    import json as _json

    from opencomposer.evals.demonstration import _identifier, shown_by_search
    from opencomposer.tasks.format import Task

    s = run_eval(EvalConfig(tasks=smoke, passes=1, concurrency=2), policy_factory("demonstration"), tmp_path)
    assert s["accuracy"] == 1.0 and s["infra_errors"] == 0
    for line in (tmp_path / "results.jsonl").read_text().splitlines():
        r = _json.loads(line)
        task = Task.load(smoke / r["task"])
        read = shown_by_search(task, _identifier(task.prompt)) is None  # else the search shows the lines
        assert r["turns"] >= (5 if read else 4) and r["tool_errors"] == 0 and r["tool_calls"] >= 4, r

def test_resume_runs_only_what_is_missing(smoke, tmp_path):
    cfg = EvalConfig(tasks=smoke, split="smoke", passes=1, concurrency=1)
    first = run_eval(cfg, policy_factory("oracle"), tmp_path)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # lose the last episode
    seen = []
    again = run_eval(cfg, policy_factory("oracle"), tmp_path, progress=seen.append)
    assert len(seen) == 1 and again["episodes"] == first["episodes"] and again["accuracy"] == 1.0


def test_cli_eval_run(smoke, tmp_path):
    r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "eval", "run", "--tasks", str(smoke),
                        "--split", "smoke", "--model", "noop", "--out", str(tmp_path / "ev")],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["accuracy"] == 0.0
    r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "tasks", "validate", str(smoke)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "rejected" not in r.stdout


def test_rubric_judge_over_http(smoke, tmp_path):
    from opencomposer.harness.openai_policy import OpenAIPolicy
    from opencomposer.tasks.rubric import CRITERIA, parse_scores
    from tests.integration.fake_openai_server import FakeOpenAIServer

    reply = {"scores": {k: {"score": 4, "reason": "fine"} for k in CRITERIA}}
    with FakeOpenAIServer([{"content": json.dumps(reply)}] * 10) as srv:
        judge = OpenAIPolicy(base_url=srv.base_url, model="judge")
        s = run_eval(EvalConfig(tasks=smoke, split="smoke", passes=1), policy_factory("oracle"), tmp_path,
                     judge=judge)
        assert "```diff" in srv.requests[0]["messages"][1]["content"]
    assert s["mean_rubric"] == 0.8 and s["accuracy"] == 1.0
    bad = parse_scores('{"scores": {"correctness": 9}}', CRITERIA)
    assert bad.scores == {} and "missing or invalid" in bad.error
    assert parse_scores("no json here", CRITERIA).error.startswith("judge reply has no JSON")


def test_pypi_source_layout(tmp_path):
    """The code/tests split of an unpacked sdist (no download: the cache already holds it)."""
    from opencomposer.tasks.default import pypi_source

    root = tmp_path / "toolz-0.12.1"
    for rel in ("toolz/__init__.py", "toolz/itertoolz.py", "toolz/tests/test_itertoolz.py", "toolz/tests/__init__.py",
                "setup.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    src = pypi_source("toolz", tmp_path)
    assert sorted(src.code) == ["toolz/__init__.py", "toolz/itertoolz.py"]
    assert list(src.tests) == ["toolz/tests"] and src.test_modules == ("toolz.tests.test_itertoolz",)
    assert "pytest" in src.verifier_command()


@pytest.mark.slow
def test_build_from_a_pypi_sdist(tmp_path):
    m = build_default(tmp_path / "t", DefaultBenchmarkConfig(sources=("more-itertools",),
                                                              build=BuildConfig(max_single=2, max_multi=0)))
    assert m.tasks and not m.extra["rejected"]


def test_oracle_uses_compact_hunks(smoke):
    from opencomposer.evals.runner import oracle_policy
    from opencomposer.tasks.format import load_dataset
    from opencomposer.tasks.patch import hunks_by_file

    task = load_dataset(smoke, "smoke")[0]
    calls = oracle_policy(task).complete([], [])
    names = {c.name for c in calls.tool_calls}
    assert names == {"search_replace"}  # a deletion task: the function comes back as one hunk
    patch = ("diff --git a/f.py b/f.py\n--- a/f.py\n+++ b/f.py\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n"
             "\\ No newline at end of file\n")
    assert hunks_by_file(patch) == {"f.py": [("a\nb\n", "a\nc")]}  # only the new side lacks the newline


def test_ctrl_c_keeps_finished_results_and_a_resume_skips_them(smoke, tmp_path):
    """An eval against a model that answers the first two episodes at once and then stalls: SIGINT
    exits 130 with the finished results on disk, queued episodes never start, and the same command
    again runs only what is missing."""
    import signal
    import time

    from tests.integration.fake_openai_server import FakeOpenAIServer

    tasks = json.loads((smoke / "manifest.json").read_text())["tasks"]
    n = len(tasks)
    assert n >= 3
    out = tmp_path / "ev"
    cmd = [sys.executable, "-m", "opencomposer.cli", "eval", "run", "--tasks", str(smoke), "--out", str(out),
           "--concurrency", "1", "--max-tokens", "64"]
    with FakeOpenAIServer([{"content": "no"}, {"content": "no"}] + [{"content": "slow", "delay_s": 20}] * n) as srv:
        p = subprocess.Popen([*cmd, "--model", srv.base_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "COLUMNS": "200"}, preexec_fn=foreground_sigint)
        deadline = time.monotonic() + 300
        while len(srv.requests) < 3 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert len(srv.requests) == 3
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert srv.requests[0]["max_tokens"] == 64  # the sampling flag reached the policy
    assert p.returncode == 130, err
    done = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    # The episode whose call was in flight finishes that call (the policy's own deadline) and counts.
    assert len(done) in (2, 3) and all(r["status"] == "failed" for r in done)
    with FakeOpenAIServer([{"content": "no"}] * n) as srv:
        r = subprocess.run([*cmd, "--model", srv.base_url], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 0, r.stderr
        assert len(srv.requests) == n - len(done)  # only the missing episodes ran
    assert json.loads(r.stdout)["episodes"] == n


def test_dataset_build_is_reused_and_an_interrupted_rebuild_keeps_the_last_good_one(smoke, tmp_path, monkeypatch):
    import shutil
    import time

    from opencomposer.tasks import default

    out = tmp_path / "ds"
    shutil.copytree(smoke, out)
    cfg = DefaultBenchmarkConfig(sources=("colorsys",), build=BuildConfig(max_single=4, max_multi=0))
    before = (out / "manifest.json").read_text()
    t0 = time.perf_counter()
    m = build_default(out, cfg)  # same inputs: reused, not rebuilt
    assert time.perf_counter() - t0 < 5 and (out / "manifest.json").read_text() == before
    assert m.tasks == json.loads(before)["tasks"]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(default.gates, "keep_valid", interrupted)
    with pytest.raises(KeyboardInterrupt):  # a different config must rebuild; it is stopped half-way
        build_default(out, DefaultBenchmarkConfig(sources=("colorsys",), build=BuildConfig(max_single=2, max_multi=0)))
    assert (out / "manifest.json").read_text() == before  # the last good dataset, whole
    assert all(p.name == "ds" or not p.name.startswith(".ds") for p in tmp_path.iterdir())  # no staging left


def test_sources_are_built_side_by_side_into_the_same_dataset(tmp_path):
    """`workers` builds sources at once; the dataset (tasks, order, splits) is the one a build of
    one source at a time makes, and the fingerprint does not depend on it."""
    import threading

    from opencomposer.tasks.default import fingerprint

    def build(workers: int) -> tuple[list[dict], set[str]]:
        threads = set()
        cfg = DefaultBenchmarkConfig(sources=("colorsys", "graphlib"), workers=workers, held_out_fraction=0.5,
                                     build=BuildConfig(max_single=0, max_multi=0, renames=2, rename_sites=2))
        m = build_default(tmp_path / f"w{workers}", cfg,
                          progress=lambda _m: threads.add(threading.current_thread().name))
        return m.tasks, {t for t in threads if t.startswith("build")}  # the main thread reports acceptances

    (one, t1), (two, t2) = build(1), build(2)
    assert len(t1) == 1 and len(t2) == 2  # the second build ran two sources at once
    assert [t["id"] for t in one] == [t["id"] for t in two] and one == two and len(one) >= 3
    assert {t["id"].rsplit("-", 1)[0] for t in one} == {"colorsys", "graphlib"}
    assert fingerprint(DefaultBenchmarkConfig(workers=1)) == fingerprint(DefaultBenchmarkConfig(workers=2))
