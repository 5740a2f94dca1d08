"""run_process: the one implementation of output capping, timeouts and kills (host and sandbox)."""

from __future__ import annotations

import time

from opencomposer.sandbox.toolserver import TRUNCATION_MARKER, CappedBuffer, run_process


def test_plain_run_and_stdin():
    r = run_process(["/bin/sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"hello", timeout_s=10)
    assert r["exit_code"] == 3 and r["stdout"] == "hello" and r["stderr"] == "err\n" and r["killed_by"] is None


def test_truncation_keeps_head_and_tail_with_a_visible_marker():
    r = run_process(["/bin/sh", "-c", "seq 1 100000"], timeout_s=10, output_limit=1000)
    out = r["stdout"]
    assert r["stdout_truncated"] and out.startswith("1\n2\n") and out.rstrip().endswith("100000")
    assert "bytes truncated" in out and len(out) < 1100
    assert r["stdout_bytes"] == len("".join(f"{i}\n" for i in range(1, 100001)))


def test_capped_buffer_exact_accounting():
    b = CappedBuffer(10)
    for _ in range(100):
        b.add(b"abcdefghij")
    text = b.text()
    omitted = 1000 - 10
    assert text == "abcde" + TRUNCATION_MARKER.format(omitted=omitted) + "fghij"


def test_timeout_kills_the_group():
    t = time.monotonic()
    r = run_process(["/bin/sh", "-c", "sleep 30 & sleep 30"], timeout_s=0.5)
    assert r["killed_by"] == "timeout" and time.monotonic() - t < 5


def test_runaway_output_is_stopped():
    r = run_process(["/bin/sh", "-c", "yes"], timeout_s=60, output_limit=1000)
    assert r["killed_by"] == "output_limit" and r["stdout_truncated"]


def test_missing_program_is_a_result_not_an_exception():
    r = run_process(["/no/such/program"], timeout_s=5)
    assert r["exit_code"] == 127 and r["killed_by"] == "spawn_failed"


def test_leftover_background_child_does_not_hang_the_call():
    t = time.monotonic()
    r = run_process(["/bin/sh", "-c", "sleep 30 & echo done"], timeout_s=60)
    assert r["stdout"] == "done\n" and r["exit_code"] == 0 and time.monotonic() - t < 5


def test_binary_output_is_replaced_not_crashing():
    r = run_process(["/bin/sh", "-c", "printf '\\377\\376ok'"], timeout_s=5)
    assert r["stdout"].endswith("ok") and "\ufffd" in r["stdout"]
