"""Harbor / Terminal-Bench task folders, imported without Docker.

A Harbor task is `instruction.md`, `task.toml`, `environment/` (a Dockerfile and the files it
copies), `tests/test.sh` (the verifier; it writes a reward to /logs/verifier/reward.txt) and
optionally `solution/solve.sh`. Imported:
- the environment's files become the repository exactly as shipped, at the Dockerfile's WORKDIR
  (default /app) — a `tests/test_app.py` the environment ships stays, even where the verifier has a
  file of the same name: the verifier's tests live in hidden/tests and are mounted at /tests only
  while grading;
- `RUN pip install ...` lines of the Dockerfile become the task environment's requirements (other
  RUN steps are not executed: tasks that need them fail the gates and are rejected, saying so);
- the gold change is what `solve.sh` does, run in a sandbox of the task's environment. Without a
  solution, or when it fails, the task is written with that note (`import.json`) and the gold gate
  rejects it with the note and the solution's output, not a bare "reward 0".
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import tempfile
import tomllib
from pathlib import Path

from opencomposer.tasks.builders.importers import ImportConfig, ImportRejected, environment_for, neutral_id, write_task
from opencomposer.tasks.format import Task

DOCKER_FILES = ("Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore")


def dockerfile_facts(dockerfile: Path) -> tuple[str, tuple[str, ...]]:
    """(WORKDIR, requirements from `RUN pip install` lines) of a Dockerfile."""
    workdir, reqs = "/app", []
    if not dockerfile.is_file():
        return workdir, ()
    text = dockerfile.read_text(errors="replace").replace("\\\n", " ")
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if not words:
            continue
        if words[0].upper() == "WORKDIR" and len(words) == 2:
            workdir = words[1].strip()
        if words[0].upper() == "RUN" and len(words) == 2:
            for step in words[1].split("&&"):
                try:
                    toks = shlex.split(step)
                except ValueError:
                    continue
                for i in range(len(toks) - 1):
                    if toks[i] in ("pip", "pip3", "uv") and toks[i + 1] == "install" or \
                            toks[i:i + 3] == ["uv", "pip", "install"]:
                        start = i + (3 if toks[i] == "uv" else 2)
                        reqs += [t for t in toks[start:] if not t.startswith("-") and "/" not in t and t != "."]
                        break
    return workdir, tuple(reqs)


def import_harbor(task_dir: str | Path, out_dir: Path, cfg: ImportConfig = ImportConfig()) -> Path:
    from opencomposer.harness.agent import ensure_git_baseline, final_diff
    from opencomposer.sandbox.base import SandboxConfig
    from opencomposer.sandbox.local import Workspace
    from opencomposer.tasks import environment

    task_dir = Path(task_dir)
    for need in ("instruction.md", "tests/test.sh"):
        if not (task_dir / need).exists():
            raise ImportRejected(f"{task_dir}: not a Harbor task (missing {need})")
    try:
        meta = tomllib.loads((task_dir / "task.toml").read_text()) if (task_dir / "task.toml").exists() else {}
    except tomllib.TOMLDecodeError as e:
        raise ImportRejected(f"{task_dir / 'task.toml'}: invalid TOML: {e}") from None
    env_dir = task_dir / "environment"
    workdir, docker_reqs = dockerfile_facts(env_dir / "Dockerfile")
    problems: dict = {}
    with tempfile.TemporaryDirectory(prefix="oc-harbor-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        if env_dir.is_dir():
            for p in env_dir.iterdir():
                if p.name in DOCKER_FILES:
                    continue
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, base / p.name)
        spec = environment_for(base, cfg)
        if cfg.requirements is None:
            spec = dataclasses.replace(spec, requirements=tuple(sorted({*spec.requirements, *docker_reqs})))
        gold = ""
        solve = task_dir / "solution" / "solve.sh"
        if not solve.exists():
            problems["solution"] = "no solution: the task has no solution/solve.sh, so no gold change can be made"
        else:
            box = environment.sandbox_config(spec, SandboxConfig(workdir=workdir, mounts=(
                f"{task_dir / 'solution'}:/solution",)), dict(cfg.env))
            with Workspace(base, box) as ws, ws.sandbox() as sb:
                ensure_git_baseline(sb)
                r = sb.exec("bash /solution/solve.sh", timeout_s=float(meta.get("agent", {}).get("timeout_sec", 600)))
                if r.exit_code == 0 and not r.killed_by:
                    gold = final_diff(sb)
                    if not gold.strip():
                        problems["solution"] = "solution/solve.sh ran but changed nothing in the environment"
                else:
                    tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-10:])
                    problems["solution"] = (f"solution/solve.sh exited {r.exit_code}"
                                            + (f" ({r.killed_by})" if r.killed_by else "") + f": {tail}")
        tests = {f"tests/{p.relative_to(task_dir / 'tests')}": p.read_bytes()
                 for p in (task_dir / "tests").rglob("*") if p.is_file()}
        md = meta.get("metadata", {})
        root = write_task(out_dir, neutral_id(task_dir.name, task_dir.name), base, tests, gold,
                          (task_dir / "instruction.md").read_text(), (), (), cfg.test_cmd or "bash /tests/test.sh",
                          source=f"harbor:{task_dir.name}", category=str(md.get("category") or "terminal"),
                          cfg=cfg, workdir=workdir, remove_hidden=False, tags=tuple(md.get("tags") or ("harbor",)),
                          problems=problems, environment=spec)
    task = Task.load(root)
    timeout = float(meta.get("verifier", {}).get("timeout_sec", task.spec.verifier.timeout_s))
    Task.write_spec(root, dataclasses.replace(task.spec, verifier=dataclasses.replace(
        task.spec.verifier, copy_hidden=False, mounts=("hidden/tests:/tests",),
        reward_file="/logs/verifier/reward.txt", timeout_s=timeout)))
    return root
