"""The task format: one folder per task, a dataset is a folder of tasks with a manifest.

    <task>/
      task.toml         id, category, source, base revision, setup, limits, verifier, tags, stats
      prompt.md         the request, terse (CursorBench's median is 390 characters; report §7)
      repo/             the repository state the agent starts from (a git repo with one commit)
      hidden/           verifier files: tests and helpers, copied into the workspace only at grading
      reference.patch   the gold change (git diff of repo/ -> solved)

    <dataset>/manifest.json   {"name", "version", "tasks": [{"id", "split", "category", "stats"}], "splits"}
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opencomposer.core.config import ConfigError, from_dict, to_dict
from opencomposer.core.errors import UserError
from opencomposer.tasks.environment import EnvironmentSpec


class TaskError(ValueError, UserError):
    """A task folder is malformed (its message names the file and what is wrong)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifierSpec:
    command: str
    """Runs in the workspace root; `{junit}` is replaced by the report's path at grading time."""
    fail_to_pass: tuple[str, ...] = ()
    """Test ids that fail before the change and must pass after it."""
    pass_to_pass: tuple[str, ...] = ()
    """Test ids that pass before and must still pass."""
    timeout_s: float = 600.0
    protected: tuple[str, ...] = ("conftest.py", "pytest.ini", "tox.ini", "sitecustomize.py", "usercustomize.py")
    """File names restored to their base state before grading (a solution must not rig the runner)."""
    copy_hidden: bool = True
    """Copy hidden/ into the workspace before the run (off when `mounts` place it elsewhere)."""
    mounts: tuple[str, ...] = ()
    """`TASK_RELATIVE:/ABS` read-only binds at grading time, e.g. `hidden/tests:/tests` (Harbor)."""
    reward_file: str = ""
    """If set (e.g. `/logs/verifier/reward.txt`), the outcome is this file's number (>= 1 passes),
    written into a fresh folder mounted at its parent; no JUnit report is needed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskStats:
    prompt_chars: int = 0
    files_changed: int = 0
    lines_changed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpec:
    id: str
    category: str
    """bug_fix, feature, refactor, ... (free text; datasets report per category)."""
    source: str
    """Where the code came from (e.g. `stdlib:json@3.11.7`, a git URL and commit)."""
    base_revision: str = ""
    workdir: str = "/workspace"
    """Where the repository appears in the sandbox: the absolute path the task's tests expect
    (SWE-bench images use /testbed, Harbor tasks /app)."""
    setup: tuple[str, ...] = ()
    """Commands run in the workspace before the agent starts (and before grading)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables for the agent's shell and the verifier (e.g. PYTHONPATH=/testbed/src)."""
    environment: EnvironmentSpec = field(default_factory=EnvironmentSpec)
    """The Python environment the repository needs (tasks/environment.py), built once and shared."""
    timeout_s: float = 1800.0
    memory_mb: int = 2048
    tags: tuple[str, ...] = ()
    verifier: VerifierSpec
    stats: TaskStats = field(default_factory=TaskStats)


@dataclass(frozen=True)
class Task:
    root: Path
    spec: TaskSpec
    prompt: str

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def repo(self) -> Path:
        return self.root / "repo"

    @property
    def hidden(self) -> Path:
        return self.root / "hidden"

    def sandbox_config(self, base=None):
        """`base` (a SandboxConfig) with this task's workdir, memory limit, environment variables and
        Python environment (built on first use; tasks/environment.py)."""
        import dataclasses

        from opencomposer.sandbox.base import SandboxConfig
        from opencomposer.tasks import environment

        base = base or SandboxConfig()
        limits = dataclasses.replace(base.limits, memory_mb=self.spec.memory_mb)
        cfg = environment.sandbox_config(self.spec.environment, base, dict(self.spec.env))
        return dataclasses.replace(cfg, workdir=self.spec.workdir, limits=limits)

    @property
    def reference_patch(self) -> str:
        return (self.root / "reference.patch").read_text()

    @classmethod
    def load(cls, root: str | Path) -> "Task":
        root = Path(root)
        toml = root / "task.toml"
        for need in (toml, root / "prompt.md", root / "repo", root / "hidden", root / "reference.patch"):
            if not need.exists():
                raise TaskError(f"{root}: missing {need.name}")
        try:
            data = tomllib.loads(toml.read_text())
        except tomllib.TOMLDecodeError as e:
            raise TaskError(f"{toml}: invalid TOML: {e}") from None
        try:
            spec = from_dict(TaskSpec, data)
        except ConfigError as e:
            raise TaskError(f"{toml}: {e}") from None
        prompt = (root / "prompt.md").read_text().strip()
        if not prompt:
            raise TaskError(f"{root / 'prompt.md'}: empty prompt")
        return cls(root, spec, prompt)

    @staticmethod
    def write_spec(root: Path, spec: TaskSpec) -> None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "task.toml").write_text(dumps_toml(to_dict(spec)))


def dumps_toml(d: dict, prefix: str = "") -> str:
    """A small TOML writer for task specs (scalars, lists of scalars, nested tables)."""
    lines, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif v is not None:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    out = "\n".join(lines)
    for k, v in tables:
        name = f"{prefix}{k}"
        out += f"\n\n[{name}]\n" + dumps_toml(v, prefix=f"{name}.")
    return out.strip() + "\n"


def _toml_key(k: str) -> str:
    return k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else json.dumps(k)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


@dataclass
class Manifest:
    name: str
    version: str = "1"
    tasks: list[dict] = field(default_factory=list)
    """{"id", "split", "category", "stats"} per task."""
    extra: dict = field(default_factory=dict)

    def splits(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in self.tasks:
            out.setdefault(t["split"], []).append(t["id"])
        return out

    def save(self, root: Path) -> None:
        d = asdict(self)
        d["splits"] = self.splits()
        (root / "manifest.json").write_text(json.dumps(d, indent=1) + "\n")


def load_dataset(root: str | Path, split: str | None = None) -> list[Task]:
    """Tasks of a dataset folder (optionally one split), in manifest order. A folder without a
    manifest is read as a plain folder of tasks."""
    root = Path(root)
    if not root.is_dir():
        raise TaskError(f"dataset folder not found: {root}")
    if (root / "task.toml").exists():
        return [Task.load(root)]
    manifest = root / "manifest.json"
    if manifest.exists():
        m = json.loads(manifest.read_text())
        ids = [t["id"] for t in m["tasks"] if split is None or t["split"] == split or
               (split == "all")]
        if split is not None and not ids and split != "all":
            raise TaskError(f"{root}: no split {split!r}; splits: {sorted({t['split'] for t in m['tasks']})}")
        return [Task.load(root / i) for i in ids]
    return [Task.load(p) for p in sorted(root.iterdir()) if (p / "task.toml").exists()]
