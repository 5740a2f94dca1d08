"""Per-repository Python environments: what the agent's shell and the verifier run in.

A task names what its repository needs (`[environment]` in task.toml: the declared dependencies,
plus the test runner). The environment is a virtualenv built from that list with this machine's
base interpreter, cached under a hash of everything that went into it, and bound read-only into
every sandbox of that repository (`SandboxConfig.python_env`). The harness's own virtualenv is then
not visible to the agent or the tests, and the base interpreter's site-packages are masked
(sandbox/isolation.py). Why it matters: the harness's venv holds this project's dependencies with
their sources (requests, urllib3, jinja2, ...). When the repository under test is one of them, a
"fix" that deletes the repository's package makes the tests import the venv's correct copy — a
reward hack an RL policy finds.

Building runs pip on the host (as `pip install` in a fresh venv would), once per distinct spec; a
build killed half-way leaves no `.complete` marker and is redone by the next caller. Builds of one
spec are serialised with a file lock, so parallel evals build it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from opencomposer.core.errors import UserError
from opencomposer.sandbox.isolation import base_interpreter

BUILDER_VERSION = 1


class EnvBuildError(RuntimeError, UserError):
    """An environment could not be built (the message says which requirement and what pip said)."""


def default_runner() -> tuple[str, ...]:
    """pytest at the version this machine already has (so its wheel is in pip's cache), else any."""
    try:
        return (f"pytest=={metadata.version('pytest')}",)
    except metadata.PackageNotFoundError:
        return ("pytest",)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvironmentSpec:
    requirements: tuple[str, ...] = ()
    """pip requirement specifiers: the repository's declared dependencies (not the repository
    itself: its code is what the agent edits, and runs from the workspace)."""
    runner: tuple[str, ...] | None = None
    """The test runner's requirements; None means `default_runner()` (pytest)."""
    harness: bool = False
    """Run in the harness's own environment instead (no isolation; for tasks that need it)."""

    def resolved(self) -> tuple[str, ...]:
        runner = default_runner() if self.runner is None else self.runner
        return tuple(sorted(set(self.requirements) | set(runner)))


def cache_root() -> Path:
    env = os.environ.get("OPENCOMPOSER_ENV_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "opencomposer" / "envs"


def spec_key(spec: EnvironmentSpec, python: str | None = None) -> str:
    python = python or base_interpreter()
    blob = json.dumps({"python": python, "version": sys.version, "requirements": spec.resolved(),
                       "builder": BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def ensure(spec: EnvironmentSpec, *, root: Path | None = None, timeout_s: float = 1800.0) -> Path:
    """The environment folder for `spec`, built on first use. Raises EnvBuildError with pip's
    last lines if it cannot be built."""
    python = base_interpreter()
    key = spec_key(spec, python)
    root = root or cache_root()
    env = root / key
    if (env / ".complete").exists():
        return env
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (env / ".complete").exists():
            return env  # built by another process while we waited
        shutil.rmtree(env, ignore_errors=True)  # a half-built one from a killed run
        t0 = time.perf_counter()
        _run([python, "-m", "venv", "--without-pip", str(env)], "creating the virtualenv", timeout_s)
        reqs = spec.resolved()
        if reqs:
            # The harness's pip installs into the new venv (`--python`), so the venv needs no pip of
            # its own and the agent cannot `pip install` into a shared, read-only environment.
            _run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q",
                  "--disable-pip-version-check", "--no-input", *reqs], f"installing {' '.join(reqs)}", timeout_s)
        (env / ".complete").write_text(json.dumps({"requirements": reqs, "python": python,
                                                   "build_seconds": round(time.perf_counter() - t0, 2)}) + "\n")
    return env


def _run(argv: list[str], what: str, timeout_s: float) -> None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EnvBuildError(f"{what}: timed out after {timeout_s:.0f}s") from None
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise EnvBuildError(f"{what} failed: {tail}")


def declared_requirements(repo: Path) -> tuple[str, ...]:
    """A repository's declared runtime and test dependencies: `[project].dependencies` and the
    test-like optional groups of pyproject.toml, else requirements*.txt files (plain specifiers
    only: options, URLs and editable lines are skipped, since they need the network or a build)."""
    reqs: list[str] = []
    pyproject = repo / "pyproject.toml"
    if pyproject.is_file():
        try:
            data = tomllib.loads(pyproject.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            data = {}
        project = data.get("project", {})
        reqs += [r for r in project.get("dependencies", []) if isinstance(r, str)]
        for group, items in (project.get("optional-dependencies") or {}).items():
            if group.lower() in ("test", "tests", "testing") and isinstance(items, list):
                reqs += [r for r in items if isinstance(r, str)]
    if not reqs:
        for name in ("requirements.txt", "requirements-test.txt", "requirements_test.txt", "test-requirements.txt"):
            f = repo / name
            if f.is_file():
                for line in f.read_text(errors="replace").splitlines():
                    line = line.split("#", 1)[0].strip()
                    if line and not line.startswith(("-", "git+", "http:", "https:", "file:", ".")):
                        reqs.append(line)
    own = _project_name(repo)
    return tuple(sorted({r for r in reqs if _req_name(r) != own}))


def _req_name(req: str) -> str:
    name = req.split(";")[0]
    for sep in "<>=!~[ (@":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def _project_name(repo: Path) -> str:
    try:
        return str(tomllib.loads((repo / "pyproject.toml").read_text()).get("project", {}).get("name", "")) \
            .lower().replace("_", "-")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return ""


def sandbox_config(spec: EnvironmentSpec, base=None, env: dict[str, str] | None = None):
    """`base` (a SandboxConfig) running in `spec`'s environment: what builders and importers measure
    tests in, so a task is built in the environment it is graded in."""
    import dataclasses

    from opencomposer.sandbox.base import SandboxConfig

    base = base or SandboxConfig()
    python_env = base.python_env if spec.harness else str(ensure(spec))
    return dataclasses.replace(base, python_env=python_env, env={**base.env, **(env or {})})
