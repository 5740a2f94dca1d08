"""The sandbox seam: the protocol every backend implements, its results and its configuration.

A backend (local bubblewrap today; Ray nodes, VMs or hosted sandboxes later) provides `Sandbox`:
run a command, read and write files, snapshot, fork, close. Everything above this layer (the
harness, graders, RL rollouts) talks only to this protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from opencomposer.core.errors import UserError


class SandboxError(RuntimeError, UserError):
    """A sandbox could not do what was asked (its message says why)."""


class WorkspaceError(SandboxError):
    """The workspace directory is missing or unusable."""


class ToolCallError(SandboxError):
    """The tool server refused a request: a bad path, a missing file, an invalid argument."""

    def __init__(self, type_: str, message: str):
        super().__init__(f"{type_}: {message}")
        self.type = type_
        self.message = message


class SandboxDied(SandboxError):
    """The sandbox's processes are gone (killed, crashed, or the sandbox was closed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """Resource limits of one sandbox. `None` disables a limit."""

    memory_mb: int | None = 2048
    """cgroup memory limit for the whole sandbox (all its processes together), MiB."""
    pids: int | None = 256
    """cgroup limit on live processes and threads in the sandbox."""
    cpus: float | None = 1.0
    """cgroup CPU quota, in cores."""
    cpu_s: int | None = 600
    """RLIMIT_CPU per process, seconds of CPU time."""
    address_space_mb: int | None = 8192
    """RLIMIT_AS per process, MiB of virtual memory (a backstop where no memory cgroup exists)."""
    nproc: int | None = 512
    """RLIMIT_NPROC (counted per user namespace, i.e. per sandbox) — a backstop for `pids`."""
    file_size_mb: int | None = 1024
    """RLIMIT_FSIZE: the largest file a process may write, MiB."""
    open_files: int | None = 1024
    """RLIMIT_NOFILE per process."""
    tmp_mb: int = 512
    """Size of the private /tmp (a tmpfs, charged to the memory cgroup), MiB."""

    def rlimits(self) -> dict[str, int | None]:
        mb = 1 << 20
        return {
            "cpu_s": self.cpu_s,
            "address_space_bytes": None if self.address_space_mb is None else self.address_space_mb * mb,
            "nproc": self.nproc,
            "file_size_bytes": None if self.file_size_mb is None else self.file_size_mb * mb,
            "open_files": self.open_files,
            "core_bytes": 0,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxConfig:
    workdir: str = "/workspace"
    """Where the workspace appears inside the sandbox (task importers bind e.g. /app here)."""
    limits: Limits = field(default_factory=Limits)
    layers: Literal["auto", "overlay", "copy"] = "auto"
    """Copy-on-write strategy: kernel overlayfs via bubblewrap, or full copies where it is missing."""
    seccomp: bool = True
    """Deny dangerous syscalls (ptrace, mount, bpf, kexec, keyctl, ...): see sandbox/seccomp.py."""
    ro_binds: tuple[str, ...] = ()
    """Extra host paths visible read-only inside (e.g. a toolchain outside /usr)."""
    mounts: tuple[str, ...] = ()
    """`HOST:SANDBOX[:rw]` binds (read-only unless `:rw`): e.g. a task's tests at the absolute
    path they expect (`hidden/tests:/tests`), or a folder the verifier writes a reward into."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every command."""
    python_env: str | None = None
    """A Python environment folder (a virtualenv; tasks/environment.py builds one per repository)
    that is the sandbox's only Python installation: bound read-only at its own path, first on PATH.
    The harness's own virtualenv is then not visible, the base interpreter's site-packages are
    masked, and the tools' binaries (rg, ruff) come in alone. None: the harness's interpreter and
    venv are visible (`sandbox run` and `agent` on your own repository)."""
    default_timeout_s: float = 120.0
    output_limit_bytes: int = 1 << 20
    """Per stream: stdout and stderr each keep their first and last half of this many bytes."""
    state_dir: Path | None = None
    """Where copy-on-write layers live; default $OPENCOMPOSER_STATE or /tmp/opencomposer-<uid>."""
    server_start_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    """The command's exit status; 128+N when a signal N killed it (shell convention)."""
    stdout: str
    stderr: str
    duration_s: float
    killed_by: str | None = None
    """Why it was stopped: timeout, memory, cpu_time, file_size, output_limit, spawn_failed, signal:NAME."""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    cwd: str | None = None
    """The shell session's directory after the command (session execs only)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_by is None

    @classmethod
    def from_wire(cls, d: Mapping) -> "ExecResult":
        return cls(**{k: d[k] for k in cls.__slots__ if k in d})


@dataclass(frozen=True, slots=True)
class FileInfo:
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable filesystem state: the base directory plus frozen copy-on-write layers
    (bottom to top). Cheap to take, and any number of sandboxes can start from it."""

    id: str
    base: Path
    layers: tuple[Path, ...]
    mode: Literal["overlay", "copy"]

    @property
    def stack(self) -> tuple[Path, ...]:
        """Every directory of the state, bottom first (in copy mode the top one is complete)."""
        return (self.base, *self.layers)


@runtime_checkable
class Sandbox(Protocol):
    def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None: ...

    def list_dir(self, path: str = ".") -> list[FileInfo]: ...

    def snapshot(self) -> Snapshot: ...

    def fork(self, n: int) -> list["Sandbox"]: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Sandbox": ...

    def __exit__(self, *exc: object) -> None: ...
