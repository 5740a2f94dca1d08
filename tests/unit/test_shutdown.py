"""core/shutdown.py: a stop signal ends the wait wherever in the loop the main thread is when its
handler runs, and a parent that is gone ends it with no signal at all."""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Deliver SIGTERM at the n-th profiled event (a call or return) inside the wait, for each n in turn,
# so the handler runs at every point of the loop; a watchdog ends the process with exit 3 when one
# delivery does not end the wait (a deadlock cannot be unwound).
PROBE = """
import os, signal, sys, threading, time
from opencomposer.core.shutdown import wait_for_stop

def event_wait(poll_s):  # the design wait_for_stop replaced: an Event set from the handler
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(poll_s):
        pass
    return "signal"

wait = event_wait if sys.argv[1] == "event" else wait_for_stop
for n in range(1, int(sys.argv[2]) + 1):
    done, seen = threading.Event(), [0]

    def watchdog(n=n):
        if not done.wait(float(sys.argv[3])):
            print(f"the wait did not end: SIGTERM at event {n}", flush=True)
            os._exit(3)

    def profile(frame, event, arg, n=n):
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # not waiting yet
            return
        seen[0] += 1
        if seen[0] == n:
            signal.raise_signal(signal.SIGTERM)

    threading.Thread(target=watchdog, daemon=True).start()
    sys.setprofile(profile)
    got = wait(poll_s=0.01)
    sys.setprofile(None)
    done.set()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert got == "signal", got
print("ended every time")
"""


def _probe(design: str, deadline_s: float, events: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, design, str(events), str(deadline_s)], check=False,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC})


def test_a_sigterm_at_any_point_of_the_wait_ends_it():
    r = _probe("wait_for_stop", deadline_s=60)  # a delivery ends it in milliseconds
    assert r.returncode == 0 and "ended every time" in r.stdout, r.stdout + r.stderr[-2000:]


def test_the_probe_finds_the_deadlock_of_an_event_set_in_the_handler():
    """The control: the same probe on the design it replaced (Event.set() in the handler, Event.wait()
    in the loop) finds a point where the handler runs while the main thread holds the event's lock."""
    r = _probe("event", deadline_s=3)
    assert r.returncode == 3 and "did not end" in r.stdout, r.stdout + r.stderr[-2000:]


def test_a_parent_that_is_gone_ends_the_wait():
    code = ("import os; from opencomposer.core.shutdown import wait_for_stop; "
            "print(wait_for_stop(parent=os.getppid() + 1, poll_s=0.01))")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.stdout.strip() == "parent", r.stdout + r.stderr


def test_a_second_signal_during_the_shutdown_ends_the_process_at_once():
    code = ("import signal, threading, time; from opencomposer.core.shutdown import wait_for_stop; "
            "threading.Timer(0.2, signal.raise_signal, (signal.SIGTERM,)).start(); "
            "print(wait_for_stop(poll_s=0.01), flush=True); "
            "signal.raise_signal(signal.SIGINT); time.sleep(30); print('still running')")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 128 + 2 and r.stdout.split() == ["signal"], r.stdout + r.stderr
    assert "a second stop signal" in r.stderr
