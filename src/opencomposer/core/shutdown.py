"""How a long-running command waits for its stop: a SIGTERM or Ctrl-C, or the death of the process
that started it (an RL replica follows its driver this way)."""

from __future__ import annotations

import os
import signal
import time

POLL_S = 0.5


def wait_for_stop(parent: int = 0, poll_s: float = POLL_S) -> str:
    """Block the main thread until this process gets SIGTERM or SIGINT ("signal"), or, with
    `parent` > 0, until its parent is no longer `parent` ("parent"). The handlers stay installed
    afterwards: a second signal during the shutdown that follows ends the process at once, with
    128 + the signal's number (a second Ctrl-C means now; the shutdown otherwise has a deadline of
    its own, `inference.server.exit_after`).

    The handler appends to a list and takes no lock. CPython runs a handler in the main thread
    between two bytecodes, wherever that thread is: an `Event.set()` handler deadlocks when it runs
    inside the main thread's own `Event.wait()`, which holds the event's lock for a few bytecodes
    around its timed wait, and the process then also ignores every later SIGTERM. That is the
    likely way a replica outlived its SIGKILLed driver in CI (PR_SET_PDEATHSIG sends the SIGTERM;
    that run kept no replica log); the unit test delivers the signal at each point of the loop in
    turn, and finds that deadlock in the Event design. The wait is a timed sleep: a signal the
    kernel hands to another thread (uvicorn's, the engine's) does not interrupt it, and its handler
    runs when the sleep ends."""
    got: list[int] = []

    def handler(signum, _frame) -> None:
        if got:
            os.write(2, b"a second stop signal: exiting now\n")
            os._exit(128 + signum)
        got.append(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not got:
        if parent and os.getppid() != parent:
            return "parent"
        time.sleep(poll_s)
    return "signal"
