from __future__ import annotations

import struct

import pytest

from opencomposer.sandbox import seccomp


def decode(prog: bytes):
    return [struct.unpack("<HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_filter_shape(machine):
    insns = decode(seccomp.build_filter(machine))
    arch = seccomp.ARCHES[machine][0]
    assert insns[0] == (0x20, 0, 0, 4) and insns[1][3] == arch and insns[2][3] == seccomp.RET_KILL_PROCESS
    assert insns[-2][3] == seccomp.RET_ALLOW and insns[-1][3] == seccomp.RET_ERRNO | seccomp.EPERM
    # Every conditional jump lands exactly on the ERRNO return.
    last = len(insns) - 1
    for i, (code, jt, jf, k) in enumerate(insns[4:-2], start=4):
        assert code in (0x15, 0x35) and i + 1 + jt == last and jf == 0


def test_denied_syscalls_are_in_the_filter():
    insns = decode(seccomp.build_filter("x86_64"))
    ks = {k for code, _, _, k in insns if code == 0x15}
    assert {101, 165, 272, 321, 250} <= ks  # ptrace, mount, unshare, bpf, keyctl
    assert 0 not in ks and 1 not in ks  # read and write stay allowed


def test_unknown_machine():
    with pytest.raises(seccomp.SeccompUnsupported):
        seccomp.build_filter("sparc")


def emulate(prog: bytes, arch: int, nr: int) -> int:
    """A tiny classic-BPF interpreter for the instructions the builder uses."""
    insns = decode(prog)
    pc, acc = 0, 0
    data = {0: nr, 4: arch}
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = data[k]
            pc += 1
        elif code == 0x15:
            pc += 1 + (jt if acc == k else jf)
        elif code == 0x35:
            pc += 1 + (jt if acc >= k else jf)
        elif code == 0x06:
            return k


def test_emulated_decisions():
    prog = seccomp.build_filter("x86_64")
    x86 = seccomp.ARCHES["x86_64"][0]
    assert emulate(prog, x86, 0) == seccomp.RET_ALLOW  # read
    assert emulate(prog, x86, 101) == seccomp.RET_ERRNO | 1  # ptrace
    assert emulate(prog, x86, 0x40000000 + 101) == seccomp.RET_ERRNO | 1  # x32 ABI door
    assert emulate(prog, 0x40000003, 0) == seccomp.RET_KILL_PROCESS  # i386 audit arch
