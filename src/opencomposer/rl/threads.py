"""The machine's cores between the trainer (the driver's torch threads) and an inference replica
process on the same machine, which compute at once and so split the cores (`RLConfig.trainer_threads`,
`replica_threads`), and what each side may take while the other has nothing to do:

- lent (`RLConfig.lend_threads`): while the trainer waits for rollouts, the replica computes with the
  trainer's threads as well as its own (POST /admin/threads, applied between the engine's steps), and
  gives them back before each trainer step;
- borrowed (`RLConfig.borrow_threads`): during a trainer step, once no rollout is in flight (the
  reconciler dispatches nothing while the trainer computes, so the replica then stays idle until the
  step ends), the trainer computes with the replica's threads as well as its own, from its next
  forward or backward pass on (`RLTrainer.between`), and goes back to its own share when the step
  ends. In two 30-minute `renames-small` runs with the KL penalty (docs/rl.md) a trainer step on a
  trained group took 76-78 s of a step of 85-90 s in the median, while a group's four rollouts took
  26-54 s: the replica sat idle for the rest of the step, on a core the trainer could use. With this
  (and the shared prompt's activations kept), the trainer ran the same 13 groups 1.21x faster.

Both apply only where the two sides' threads fit on the CPUs this process may use and the replica is
a process of this machine (`services = "processes"`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class ThreadShare:
    """Who computes on which of the machine's cores, and for how long each side held the other's.

    `cores` is (trainer threads, replica threads) as split at the start; `lend` / `borrow` whether
    the replica may take the trainer's threads while it waits, and the trainer the replica's while
    it is idle. Seconds are counted since the last `take_seconds()`."""

    def __init__(self, cores: tuple[int, int], lend: bool, borrow: bool):
        self.cores = cores
        self.lend, self.borrow = lend, borrow
        self._given: tuple[str, int] | None = None  # (replica URL, threads) last set on it
        self._lent_since: float | None = None
        self._borrowed_since: float | None = None
        self.lent_seconds = 0.0
        self.borrowed_seconds = 0.0

    def give(self, replica, n: int) -> None:
        """Set the replica's threads to `n` (only when that changes anything)."""
        if not self.lend or self._given == (replica.url, n) or not replica.set_threads(n):
            return
        self._given = (replica.url, n)
        if n > self.cores[1]:
            self._lent_since = time.monotonic()
        elif self._lent_since is not None:
            self.lent_seconds += time.monotonic() - self._lent_since
            self._lent_since = None

    def lend_to(self, replica) -> None:
        """The trainer waits from here to its next step: the replica may use every core."""
        self.give(replica, self.cores[0] + self.cores[1])

    def reclaim(self, replica) -> None:
        """The trainer's cores back before it trains."""
        self.give(replica, self.cores[1])

    def borrower(self, idle: Callable[[], bool]) -> Callable[[], None] | None:
        """What the trainer calls between its passes in a step (`RLTrainer.between`): takes the
        replica's threads too once `idle()` says no rollout is in flight. None where not allowed."""
        if not self.borrow or not all(self.cores):
            return None

        def between() -> None:
            if self._borrowed_since is None and idle():
                torch.set_num_threads(self.cores[0] + self.cores[1])
                self._borrowed_since = time.monotonic()
        return between

    def step_ended(self) -> None:
        """The trainer back to its own share of the cores."""
        if self._borrowed_since is not None:
            torch.set_num_threads(self.cores[0])
            self.borrowed_seconds += time.monotonic() - self._borrowed_since
            self._borrowed_since = None

    def take_seconds(self) -> tuple[float, float]:
        """(lent, borrowed) seconds since the last call; the counts start again from 0."""
        out = (self.lent_seconds, self.borrowed_seconds)
        self.lent_seconds = self.borrowed_seconds = 0.0
        return out
