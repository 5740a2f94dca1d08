"""The RL objective (Dr. GRPO, k1 KL, off-policy corrections) and the rollout rewards."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from opencomposer.rl import rewards as rw  # noqa: E402
from opencomposer.rl.objective import ObjectiveConfig, group_advantages, rewards_with_kl, token_loss  # noqa: E402


def test_effort_penalty_is_the_reports_concave_curve():
    C = rw.effort_penalty
    assert C(0.0) == 0.0
    xs = [0, 100, 1000, 10_000, 100_000]
    vals = [C(x, 1e-3, 0.5) for x in xs]
    assert vals == sorted(vals) and C(2000, 1e-3, 0.5) < 2 * C(1000, 1e-3, 0.5)  # increasing, concave
    x, h = 5000.0, 1e-3
    assert (C(x + h) - C(x - h)) / (2 * h) == pytest.approx((1 + 1e-3 * x) ** -0.5, rel=1e-5)  # dC/dx
    assert C(1234.0, 1e-3, 0.0) == pytest.approx(1234.0)  # q = 0: linear
    assert C(1234.0, 1e-3, 1.0) == pytest.approx(math.log1p(1.234) / 1e-3)
    assert C(1234.0, 1e-3, 1.0 - 1e-6) == pytest.approx(C(1234.0, 1e-3, 1.0), rel=1e-4)  # continuous at q = 1
    with pytest.raises(ValueError):
        C(-1.0)


def traj(**kw):
    base = {"segments": [{"completions": [
        {"content": "<scratchpad>think think</scratchpad>ok", "tool_calls": [{"name": "x"}],
         "usage": {"completion_tokens": 20}},
        {"content": "done", "tool_calls": [], "usage": {"completion_tokens": 5}}]}],
        "tool_calls": [{"name": "read_file", "error_type": None, "observation_chars": 350}],
        "turns": 2, "todos": [], "diff": ""}
    base.update(kw)
    return base


def test_rewards_and_behaviour_terms():
    w = rw.EffortWeights()
    x = rw.effort(traj(), w)
    assert x == pytest.approx(w.thinking_tokens * 11 / 3.5 + w.tool_call_tokens * (20 - 11 / 3.5) + w.final_tokens * 5
                              + w.tool_output_tokens * 100 + w.tool_calls + 2 * w.turns)
    good = rw.reward(traj(), True)
    assert 0.9 < good.total < 1.0 and good.verifier == 1.0 and good.effort > 0
    assert rw.reward(traj(), False).total < 0  # effort still costs
    broken = traj(tool_calls=[{"name": "grep", "error_type": "MalformedArguments", "observation_chars": 0}] * 3)
    assert rw.broken_calls(broken) == 3 and rw.reward(broken, True).total < good.total
    todo = traj(todos=[{"id": "1", "status": "pending"}, {"id": "2", "status": "completed"}])
    assert rw.unfinished_todos(todo) == 1
    dump = traj(diff="+++ b/a.py\n" + "".join(f"+# step {i}: I think the bug is ...\n" for i in range(8)) + "+x = 1\n")
    assert rw.comment_dump(dump) and not rw.comment_dump(traj(diff="+++ b/a.py\n+# one note\n+x = 1\n+y = 2\n"))
    term = traj(tool_calls=[{"name": "run_terminal_cmd", "error_type": None, "observation_chars": 10}] * 4)
    assert rw.terminal_collapse(term) and not rw.terminal_collapse(traj())
    # failed edits: counted for edit tools only, and cost only when their weight is on (default off)
    edits = traj(tool_calls=[{"name": "search_replace", "error_type": "NoMatch", "observation_chars": 40},
                             {"name": "search_replace", "error_type": "NotUnique", "observation_chars": 40},
                             {"name": "read_file", "error_type": "NotFound", "observation_chars": 40},
                             {"name": "search_replace", "error_type": None, "observation_chars": 40}])
    assert rw.failed_edits(edits) == 2 and rw.broken_calls(edits) == 0
    on = rw.RewardConfig(failed_edit=0.05)
    assert rw.reward(edits, True, on).total == pytest.approx(rw.reward(edits, True).total - 0.1)
    assert rw.reward(edits, True, on).failed_edits == 2
    # a longer episode costs more, concavely
    long = traj(turns=40)
    assert rw.reward(long, True).effort > good.effort


def test_group_advantages_have_no_std_normalisation():
    adv, zero = group_advantages([1.0, 0.0, 0.0, 0.0], 4)
    assert adv == [0.75, -0.25, -0.25, -0.25] and not zero
    adv, zero = group_advantages([1.0, 1.0, 1.0, 1.0], 4)
    assert zero and adv == [0.0] * 4
    with pytest.raises(ValueError, match="fixed"):
        group_advantages([1.0, 0.0], 4)
    cfg = ObjectiveConfig(kl_coef=0.1)
    assert rewards_with_kl([1.0, 0.0], [2.0, 0.0], cfg) == [0.8, 0.0]


def test_a_token_weighted_baseline_balances_a_groups_token_mass():
    """One pass of 250 tokens and three failures of 500: against the plain mean the failures blame
    375 token-advantages and the pass rewards 187.5; against the token-weighted mean (b = 1/7) both
    sides are 1,500/7, and the signs stay those of pass and failure."""
    rewards, tokens = [1.0, 0.0, 0.0, 0.0], [250, 500, 500, 500]
    plain, _ = group_advantages(rewards, 4)
    assert sum(a * n for a, n in zip(plain, tokens)) == pytest.approx(-187.5)
    adv, zero = group_advantages(rewards, 4, tokens=tokens)
    assert not zero and adv[0] > 0 and all(a < 0 for a in adv[1:])
    assert adv == pytest.approx([1 - 250 / 1750] + [-250 / 1750] * 3)
    assert sum(a * n for a, n in zip(adv, tokens)) == pytest.approx(0.0, abs=1e-9)
    assert group_advantages([0.3] * 4, 4, tokens=tokens)[1]  # equal rewards: still no signal
    assert group_advantages(rewards, 4, tokens=[0] * 4)[0] == plain  # nothing trained: the plain mean
    with pytest.raises(ValueError, match="token counts"):
        group_advantages(rewards, 4, tokens=[1, 2])
    with pytest.raises(ValueError, match="negative"):
        group_advantages(rewards, 4, tokens=[-5, 1, 1, 1])
    with pytest.raises(ValueError, match="baseline"):
        ObjectiveConfig(baseline="median")


def test_negative_advantages_weigh_down_or_drop_what_fell_below_the_mean():
    """PSR at 0, a partial weight between, Dr. GRPO at 1; an all-equal group stays signal-free."""
    assert group_advantages([1.0, 0.0, 0.0, 0.0], 4, negative=0.0) == ([0.75, 0.0, 0.0, 0.0], False)
    assert group_advantages([1.0, 1.0, 0.0, 0.0], 4, negative=0.5) == ([0.5, 0.5, -0.25, -0.25], False)
    assert group_advantages([0.2] * 4, 4, negative=0.0)[1]
    with pytest.raises(ValueError, match="negative_advantages"):
        group_advantages([1.0, 0.0, 0.0, 0.0], 4, negative=-1.0)


def grad_of(mode, logp_values, sampler, adv=1.0, **kw):
    logp = torch.tensor(logp_values, requires_grad=True)
    cfg = ObjectiveConfig(correction=mode, normalizer=10.0, **kw)
    loss, stats = token_loss(logp, torch.tensor(sampler), torch.tensor(adv), cfg)
    loss.backward()
    return logp.grad, stats


def test_token_loss_is_summed_over_tokens_and_corrections_agree_on_policy():
    for mode in ("tis", "ppo", "none"):
        g, _ = grad_of(mode, [-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5])
        assert torch.allclose(g, torch.full((3,), -0.1))  # -A / normalizer per token: no 1/|y|
    long, _ = grad_of("none", [-1.0] * 30, [-1.0] * 30)
    short, _ = grad_of("none", [-1.0] * 3, [-1.0] * 3)
    assert torch.allclose(long[:3], short)  # a token counts the same in a long sequence as in a short one


def test_off_policy_corrections():
    # TIS: a token 3x likelier under the trainer than the sampler is weighed by the cap (2), not 3.
    g, st = grad_of("tis", [math.log(0.3)], [math.log(0.1)], tis_cap=2.0)
    assert g.item() == pytest.approx(-0.2) and st["truncated"] == 1
    # PPO: past 1 + eps with a positive advantage the surrogate is clipped: no gradient.
    g, _ = grad_of("ppo", [math.log(0.3)], [math.log(0.1)], clip_eps=0.2)
    assert g.item() == 0.0
    # k1 in the loss adds beta * (log pi - log pi_ref).
    logp = torch.tensor([-1.0], requires_grad=True)
    cfg = ObjectiveConfig(correction="none", normalizer=1.0, kl_place="loss", kl_coef=0.5)
    loss, st = token_loss(logp, torch.tensor([-1.0]), torch.tensor(0.0), cfg, logp_ref=torch.tensor([-3.0]))
    assert loss.item() == pytest.approx(0.5 * 2.0) and st["kl"] == pytest.approx(2.0)


@pytest.mark.parametrize("lr", [0.1, 0.0])
def test_the_objective_learns_a_bandit_and_the_lr0_control_does_not(lr):
    """Groups of 8 samples from a 4-armed softmax policy, reward 1 for arm 2: the probability of
    arm 2 rises under the objective, and stays put with learning rate 0 (same seeds)."""
    torch.manual_seed(0)
    logits = torch.zeros(4, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=lr)
    cfg = ObjectiveConfig(group_size=8, normalizer=8.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(60):
        with torch.no_grad():
            probs = torch.softmax(logits, -1)
            arms = torch.multinomial(probs, 8, replacement=True, generator=gen)
            sampler = torch.log(probs[arms])
        adv, _ = group_advantages([float(a == 2) for a in arms], cfg.group_size)
        logp = torch.log_softmax(logits, -1)[arms]
        loss, _ = token_loss(logp, sampler, torch.tensor(adv), cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    p2 = torch.softmax(logits, -1)[2].item()
    assert (p2 > 0.8) if lr > 0 else (p2 == pytest.approx(0.25))
