"""A seccomp-BPF filter against syscalls a coding sandbox never needs, built without libseccomp.

bubblewrap loads a compiled classic-BPF program from a file descriptor (`--seccomp FD`) right
before it executes the sandboxed command, after setting no_new_privs. The program here:

    load arch;     arch != native                  -> KILL_PROCESS  (no 32-bit / x32 side doors)
    load nr;       nr >= 0x40000000 (x86-64 only)  -> ERRNO(EPERM)  (the x32 ABI bit)
                   nr in DENIED                    -> ERRNO(EPERM)
                   otherwise                       -> ALLOW

EPERM rather than a kill keeps programs that probe for features (e.g. `perf_event_open`) working.
The deny list follows Docker's default profile and nsjail's: tracing, mounting, kernel modules,
kexec, BPF, keyrings, namespaces, clock changes, reboot, swap, userfaultfd, process memory
access across processes, and handle-based opens (a known container escape).
"""

from __future__ import annotations

import os
import platform
import struct

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
EPERM = 1

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "perf_event_open",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    "unshare", "setns",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "keyctl", "add_key", "request_key",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "userfaultfd", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "iopl", "ioperm", "fanotify_init", "personality",
)

# (audit arch, syscall table) per machine. Numbers from the kernel's syscall tables.
_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "perf_event_open": 298,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "move_mount": 429, "open_tree": 428,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "unshare": 272, "setns": 308,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "bpf": 321, "keyctl": 250, "add_key": 248, "request_key": 249,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "syslog": 103, "vhangup": 153,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "userfaultfd": 323, "open_by_handle_at": 304, "name_to_handle_at": 303, "lookup_dcookie": 212,
    "iopl": 172, "ioperm": 173, "fanotify_init": 300, "personality": 135,
}
_AARCH64 = {
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "perf_event_open": 241,
    "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "move_mount": 429, "open_tree": 428,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "unshare": 97, "setns": 268,
    "init_module": 105, "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294,
    "bpf": 280, "keyctl": 219, "add_key": 217, "request_key": 218,
    "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "syslog": 116, "vhangup": 58,
    "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
    "userfaultfd": 282, "open_by_handle_at": 265, "name_to_handle_at": 264, "lookup_dcookie": 18,
    "fanotify_init": 262, "personality": 92,
}
ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}


class SeccompUnsupported(RuntimeError):
    pass


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def build_filter(machine: str | None = None, denied: tuple[str, ...] = DENIED) -> bytes:
    """The compiled filter for `machine` (default: this one), as bwrap's `--seccomp` expects."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise SeccompUnsupported(f"no syscall table for {machine!r}; known: {', '.join(ARCHES)}")
    arch, table = ARCHES[machine]
    numbers = sorted({table[name] for name in denied if name in table})
    # Layout: [0] ld arch, [1] jeq arch, [2] kill, [3] ld nr, [4] (x32 check), [5..] jeq nr,
    # then ALLOW, then ERRNO. Jump offsets are relative to the next instruction.
    prog = [_insn(_LD_W_ABS, 0, 0, 4), _insn(_JEQ_K, 1, 0, arch), _insn(_RET_K, 0, 0, RET_KILL_PROCESS),
            _insn(_LD_W_ABS, 0, 0, 0)]
    checks = []
    if machine == "x86_64":
        checks.append((_JGE_K, 0x40000000))
    checks += [(_JEQ_K, nr) for nr in numbers]
    for i, (code, k) in enumerate(checks):
        to_errno = len(checks) - i  # skip the remaining checks and the ALLOW
        if to_errno > 255:
            raise SeccompUnsupported("deny list too long for one jump")
        prog.append(_insn(code, to_errno, 0, k))
    prog.append(_insn(_RET_K, 0, 0, RET_ALLOW))
    prog.append(_insn(_RET_K, 0, 0, RET_ERRNO | EPERM))
    return b"".join(prog)


def filter_fd(program: bytes) -> int:
    """A readable fd holding `program` (a memfd: nothing touches the disk). The caller closes it."""
    fd = os.memfd_create("opencomposer-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
