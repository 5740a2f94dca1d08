"""The curriculum: later in a run, the next group's task is drawn by how hard its earlier rollouts
were (report §4: "In later stages of training, we use simple heuristics—such as number of turns and
thinking tokens of rollouts—to upsample increasingly harder data points").

A task's hardness is the mean over its finished rollouts of turns / max_turns plus completion
tokens / (max_turns x turn_tokens): this family writes its thinking into the completion (the
`<scratchpad>` part), so completion tokens stand for thinking tokens. Only tasks that come back
(`epochs` > 1) have a measurement; while none of the tasks still planned has one, the plan's own
order stands. A pick is a swap of two entries of the plan, recorded in the event log and replayed
on resume, so a restarted run maps every group to the task it had.

`skip_settled` moves a task whose earlier rollouts (a whole group's at least) all passed or all
failed behind the tasks that still split their rollouts: such a group's rewards are all equal
under the verifier, so it trains nothing under `unsolved_groups = "skip"` or only on the behaviour
terms. DAPO filters those groups after sampling them (dynamic sampling); here a run's own history
decides before it spends the rollouts. In the default speedrun at 5c39d18 (before this existed), 14
of 26 groups had all-equal outcomes (11 passed nothing, 3 everything). A settled task still comes back once no unsettled one is left in the plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, kw_only=True, slots=True)
class CurriculumConfig:
    after: float = 1.0
    """From this fraction of the plan on, tasks are drawn by hardness (1.0: never)."""
    strength: float = 2.0
    """Draw probability proportional to hardness ** strength."""
    skip_settled: bool = False
    """Move a task whose earlier rollouts all passed or all failed (at least `settle_after` of
    them) behind the tasks that still split (see the module's docstring)."""
    settle_after: int = 4


def rollout_hardness(turns: int, completion_tokens: int, max_turns: int, turn_tokens: int) -> float:
    return turns / max(1, max_turns) + completion_tokens / max(1, max_turns * turn_tokens)


class Hardness:
    """Running mean hardness per task id."""

    def __init__(self, max_turns: int, turn_tokens: int):
        self.max_turns, self.turn_tokens = max_turns, turn_tokens
        self._sum: dict[str, float] = {}
        self._n: dict[str, int] = {}
        self._passed: dict[str, int] = {}

    def add(self, samples: Iterable) -> None:
        for s in samples:
            if getattr(s, "error", None) is not None or not s.task:
                continue
            h = rollout_hardness(s.turns, s.trained_tokens, self.max_turns, self.turn_tokens)
            self._sum[s.task] = self._sum.get(s.task, 0.0) + h
            self._n[s.task] = self._n.get(s.task, 0) + 1
            self._passed[s.task] = self._passed.get(s.task, 0) + bool(s.passed)

    def get(self, task: str) -> float | None:
        return self._sum[task] / self._n[task] if task in self._n else None

    def settled(self, task: str, after: int) -> bool:
        """At least `after` rollouts of the task, and all of them passed or none did."""
        n = self._n.get(task, 0)
        return n >= after and self._passed.get(task, 0) in (0, n)


def pick(candidates: list[tuple[int, str]], hardness: Hardness, strength: float, rng: random.Random,
         ) -> tuple[int, dict[str, float]]:
    """Among (plan position, task id) candidates, the first being the plan's own choice, the
    position to take: drawn with probability proportional to hardness ** strength (a task not yet
    measured counts as the mean of those that are). With nothing measured, the first."""
    known = {t: h for _, t in candidates if (h := hardness.get(t)) is not None}
    if not known:
        return candidates[0][0], {}
    mean = sum(known.values()) / len(known)
    weights = [max(known.get(t, mean), 1e-6) ** strength for _, t in candidates]
    return rng.choices([p for p, _ in candidates], weights=weights, k=1)[0], known


class Planner:
    """Which task each group (a position of the plan) gets. Past `after` of the plan, the task of
    a group not yet decided is drawn by hardness from the positions no group has taken yet and
    swapped into place; `replay` applies the swaps a run recorded, so a resumed run maps every
    group as before."""

    def __init__(self, plan: list[int], task_ids: list[str], cfg: CurriculumConfig, hardness: Hardness,
                 seed: int = 0):
        self.plan, self.task_ids, self.cfg, self.hardness, self.seed = list(plan), task_ids, cfg, hardness, seed
        self.decided: set[int] = set()

    def task(self, g: int) -> int:
        return self.plan[g] % len(self.task_ids)

    def _settled(self, p: int) -> bool:
        return self.hardness.settled(self.task_ids[self.task(p)], self.cfg.settle_after)

    def replay(self, events: Iterable[dict]) -> None:
        for e in events:
            if e["kind"] == "planned":
                a, b = e["group"], e["swapped_with"]
                self.plan[a], self.plan[b] = self.plan[b], self.plan[a]
            if e.get("group") is not None and e["kind"] in ("queued", "planned"):
                self.decided.add(e["group"])

    def choose(self, g: int, unavailable: set[int]) -> dict | None:
        """Decide group g's task; returns the `planned` event's fields when it swapped."""
        if g not in self.decided and self.cfg.skip_settled and self._settled(g):
            later = [p for p in range(g + 1, len(self.plan))
                     if p not in self.decided and p not in unavailable and not self._settled(p)]
            if later:
                self.decided.add(g)
                self.plan[g], self.plan[later[0]] = self.plan[later[0]], self.plan[g]
                return {"group": g, "swapped_with": later[0], "task": self.task_ids[self.task(g)],
                        "reason": "settled", "settled_task": self.task_ids[self.task(later[0])]}
        if g in self.decided or g < self.cfg.after * len(self.plan):
            self.decided.add(g)
            return None
        free = [p for p in range(g, len(self.plan)) if p == g or (p not in self.decided and p not in unavailable)]
        cands = [(p, self.task_ids[self.task(p)]) for p in free]
        j, known = pick(cands, self.hardness, self.cfg.strength, random.Random(f"{self.seed}/{g}"))
        self.decided.add(g)
        if j == g:
            return None
        self.plan[g], self.plan[j] = self.plan[j], self.plan[g]
        task = self.task_ids[self.task(g)]
        return {"group": g, "swapped_with": j, "task": task,
                "hardness": round(known[task], 4) if task in known else None, "measured_tasks": len(known)}
