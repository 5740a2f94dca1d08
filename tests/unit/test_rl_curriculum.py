"""The RL curriculum (`rl/curriculum.py`): later groups are drawn towards tasks whose earlier
rollouts took more turns and tokens, the plan's order stands before that or while nothing is
measured, and a resumed run replays the recorded picks so every group keeps its task. The plan is
a fixed multiset (no prompt more often than `epochs`): the draw pulls hard tasks forward, so the
steps a run trains before its plan ends see more of them."""

from __future__ import annotations

from dataclasses import dataclass

from opencomposer.rl.curriculum import CurriculumConfig, Hardness, Planner


@dataclass
class Rollout:  # the fields of rl.rollout.Sample the curriculum reads
    task: str
    turns: int
    trained_tokens: int
    error: str | None = None
    passed: bool = False


TASKS = ["easy", "hard", "mid"]


def measured() -> Hardness:
    h = Hardness(max_turns=8, turn_tokens=100)
    h.add([Rollout("easy", 1, 20), Rollout("easy", 1, 30), Rollout("hard", 8, 700), Rollout("mid", 4, 300),
           Rollout("hard", 2, 10, error="infra")])  # a failed rollout measures nothing
    return h


def test_hardness_is_turns_and_tokens_of_finished_rollouts():
    h = measured()
    assert h.get("easy") == 1 / 8 + 25 / 800
    assert h.get("hard") == 8 / 8 + 700 / 800
    assert h.get("unknown") is None


def run_plan(planner: Planner, events: list[dict]) -> list[str]:
    out = []
    for g in range(len(planner.plan)):
        swap = planner.choose(g, set())
        if swap is not None:
            events.append({"kind": "planned", **swap})
        events.append({"kind": "queued", "group": g})
        out.append(TASKS[planner.task(g)])
    return out


def test_later_groups_favour_hard_tasks_and_a_resume_replays_the_picks():
    plan = [0, 1, 2] * 40  # three tasks, forty epochs, the plan's own order
    early_hard, late_hard = 0, 0
    for seed in range(5):
        events: list[dict] = []
        planner = Planner(plan, TASKS, CurriculumConfig(after=0.5, strength=2.0), measured(), seed)
        order = run_plan(planner, events)
        assert order[:60] == [TASKS[t] for t in plan[:60]]  # before `after`: untouched
        assert sorted(order) == sorted(TASKS[t] for t in plan)  # a permutation: nothing dropped or repeated
        early_hard += order[40:60].count("hard")
        late_hard += order[60:80].count("hard")  # a run stops before its plan ends: this is what it trains
        # a resumed run: the same plan, the recorded picks replayed, nothing drawn again
        again = Planner(plan, TASKS, CurriculumConfig(after=0.5, strength=2.0), measured(), seed + 100)
        again.replay(events)
        assert [TASKS[again.task(g)] for g in range(len(plan))] == order
        assert all(again.choose(g, set()) is None for g in range(len(plan)))
    # the plan's rate is a third; drawn by hardness, "hard" is pulled forward into the trained window
    assert early_hard == 5 * 7 and late_hard >= 5 * 12


def test_off_by_default_and_nothing_measured_keeps_the_plan():
    plan = [0, 1, 2] * 4
    default = Planner(plan, TASKS, CurriculumConfig(), measured())
    assert run_plan(default, []) == [TASKS[t] for t in plan]
    blind = Planner(plan, TASKS, CurriculumConfig(after=0.0), Hardness(8, 100))
    assert run_plan(blind, []) == [TASKS[t] for t in plan]


def test_settled_tasks_go_behind_those_that_split_and_come_back_when_none_is_left():
    """`skip_settled`: a task whose group all passed ("easy") or all failed ("hard") waits behind
    one whose rollouts split ("mid"); with no unsettled task left in the plan it comes back. A task
    with fewer rollouts than `settle_after` is not settled."""
    h = Hardness(max_turns=8, turn_tokens=100)
    h.add([Rollout("easy", 1, 20, passed=True)] * 4 + [Rollout("hard", 8, 700)] * 4
          + [Rollout("mid", 4, 300, passed=p) for p in (True, False, False, True)])
    plan = [0, 1, 2] * 3
    events: list[dict] = []
    planner = Planner(plan, TASKS, CurriculumConfig(skip_settled=True, settle_after=4), h)
    order = run_plan(planner, events)
    assert order == ["mid", "mid", "mid", "easy", "hard", "hard", "easy", "hard", "easy"]
    assert [e["reason"] for e in events if e["kind"] == "planned"] == ["settled"] * 3
    resumed = Planner(plan, TASKS, CurriculumConfig(skip_settled=True, settle_after=4), h)
    resumed.replay(events)
    assert [TASKS[resumed.task(g)] for g in range(len(plan))] == order
    assert run_plan(Planner(plan, TASKS, CurriculumConfig(), h), []) == [TASKS[t] for t in plan]  # off: as planned
    assert run_plan(Planner(plan, TASKS, CurriculumConfig(skip_settled=True, settle_after=5), h), []) \
        == [TASKS[t] for t in plan]  # four rollouts settle nothing when five are asked
