"""The RL trainer's lr = 0 control: a step at learning rate 0 computes the whole gradient and
changes no weight, bit for bit. That is why the speedrun's control stage evaluates the SFT weights
again instead of running RL at lr 0 for half an hour (docs/rl.md): what such a run exports is the
SFT model itself."""

import copy

import pytest
import torch

from opencomposer.model.llama import LlamaConfig, LlamaModel
from opencomposer.rl.objective import ObjectiveConfig
from opencomposer.rl.rollout import Sample
from opencomposer.rl.sequences import RLSequence
from opencomposer.rl.trainer import RLTrainer, TrainerConfig


def samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (20,), generator=g).tolist()
    out = []
    for i, reward in enumerate((1.0, 0.0, 0.0, 1.0)):
        comp = torch.randint(0, vocab, (6 + i,), generator=g).tolist()
        seq = RLSequence(ids=prompt + comp, loss_mask=[0] * 20 + [1] * len(comp),
                         logprobs=[-1.0] * (20 + len(comp)), versions=[0] * (20 + len(comp)),
                         sampling={"temperature": 1.0})
        out.append(Sample(id=f"s{i}", group=0, index=i, task="t", reward=reward, sequences=[seq],
                          trained_tokens=len(comp)))
    return out


@pytest.mark.parametrize("lr", [0.0, 1e-3])
def test_a_step_at_lr_0_changes_no_weight(lr):
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    before = copy.deepcopy(model.state_dict())
    trainer = RLTrainer(model, ObjectiveConfig(group_size=4, kl_coef=0.01), TrainerConfig(lr=lr))
    for _ in range(3):
        stats = trainer.step([samples(200)])
        assert stats["grad_norm"] > 0 and stats["trained_tokens"] > 0  # a real gradient each step
        assert stats["updated"]  # an Adam step was taken, at lr 0 too: the control makes the same versions
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert (changed == []) if lr == 0 else len(changed) == len(before)


def test_frozen_parameters_keep_their_bits_and_the_rest_train():
    """`TrainerConfig.frozen`: the tied embedding (and so the head) stays bit for bit, every other
    weight moves, Adam holds state for the trained ones only; a name that matches nothing is refused."""
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    assert model.lm_head.weight is model.embed_tokens.weight
    before = copy.deepcopy(model.state_dict())
    trainer = RLTrainer(model, ObjectiveConfig(group_size=4, kl_coef=0.0),
                        TrainerConfig(lr=1e-3, frozen=("embed_tokens",), checkpoint_tokens=8))
    for _ in range(2):
        assert trainer.step([samples(200)])["updated"]
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == set(before) - {"embed_tokens.weight", "lm_head.weight"}
    assert model.embed_tokens.weight.grad is None and len(trainer.opt.state) == len(changed)
    with pytest.raises(ValueError, match="names no parameter"):
        RLTrainer(model, ObjectiveConfig(group_size=4), TrainerConfig(frozen=("embedding",)))


def one_pass_step(**objective) -> dict:
    """One step on a group where only the first rollout (6 tokens) passed, against failures of 7, 8
    and 9 tokens."""
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    group = samples(200)
    for s, r in zip(group, (1.0, 0.0, 0.0, 0.0)):
        s.reward = r
    cfg = ObjectiveConfig(group_size=4, kl_coef=0.0, **objective)
    return RLTrainer(model, cfg, TrainerConfig(lr=1e-3)).step([group])


def test_the_step_reports_the_advantage_mass_its_tokens_carry():
    """Advantages summed over trained tokens, the rewarded and the blamed apart: the pass at +0.75
    against the failures at -0.25 each."""
    assert one_pass_step()["advantage_mass"] == pytest.approx([0.75 * 6, -0.25 * (7 + 8 + 9)])


def test_a_token_mean_baseline_makes_the_rewarded_and_blamed_mass_equal():
    """The same group under `baseline = "token_mean"`: b = 6 / 30, so the pass carries 0.8 * 6 and
    the failures -0.2 * 24, equal and opposite."""
    assert one_pass_step(baseline="token_mean")["advantage_mass"] == pytest.approx([0.8 * 6, -0.2 * 24])


def test_unsolved_and_solved_groups_train_on_their_behaviour_terms_or_are_skipped():
    """A group where nothing passed, or where everything did, but the behaviour terms differ:
    "train" moves the weights on those terms, "skip" (`unsolved_groups`, `solved_groups`) leaves
    every weight as it was and counts the group; a group that splits trains either way."""
    def model_and_state():
        torch.manual_seed(0)
        m = LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        return m, copy.deepcopy(m.state_dict())

    unsolved = samples(200)
    for s, r in zip(unsolved, (0.0, -0.05, -0.1, 0.0)):  # no pass; broken calls cost 0.05 each
        s.reward, s.passed = r, False
    solved = samples(200)
    for s in solved:
        s.passed = s.reward > 0
    all_passed = samples(200)
    for s, r in zip(all_passed, (1.0, 0.95, 0.9, 1.0)):  # every rollout passed; broken calls cost 0.05 each
        s.reward, s.passed = r, True
    for mode, solved_mode, group, moves in (
            ("train", "train", unsolved, True), ("skip", "train", unsolved, False), ("skip", "skip", solved, True),
            ("skip", "train", all_passed, True), ("train", "skip", all_passed, False),
            ("train", "skip", unsolved, True)):
        model, before = model_and_state()
        trainer = RLTrainer(model, ObjectiveConfig(group_size=4, kl_coef=0.0, unsolved_groups=mode,
                                                   solved_groups=solved_mode), TrainerConfig(lr=1e-3))
        stats = trainer.step([group])
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        assert bool(changed) == moves, (mode, solved_mode)
        assert stats["updated"] == moves  # the loop makes a new version only for a step that moved
        assert stats["trained"] == ([0] if moves else [])  # the loop's staleness counts only these
        assert stats["unsolved_groups_skipped"] == (not moves and group is unsolved)
        assert stats["solved_groups_skipped"] == (not moves and group is all_passed)
        assert stats["zero_advantage_groups"] == 0


def test_rollouts_at_advantage_0_are_not_forwarded_and_the_gradient_is_the_same():
    """Under `negative_advantages = 0` the rollouts below the mean have advantage 0: the step skips
    their forward and backward (counted), and its gradient equals the one computed by hand from the
    other rollouts alone, through the shared-prompt path."""
    from opencomposer.rl.forward import sequence_logprobs
    from opencomposer.rl.objective import token_loss
    from opencomposer.rl.trainer import sampled

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    group = samples(200)  # rewards 1, 0, 0, 1: advantages 0.5, -0.5, -0.5, 0.5 -> 0.5, 0, 0, 0.5
    cfg = ObjectiveConfig(group_size=4, kl_coef=0.0, negative_advantages=0.0)
    trainer = RLTrainer(model, cfg, TrainerConfig(lr=1e-3))
    grads = {}
    trainer.opt.step = lambda: grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    stats = trainer.step([group])
    assert stats["zero_advantage_rollouts"] == 2
    assert stats["trained_tokens"] == group[0].trained_tokens + group[3].trained_tokens

    ref = copy.deepcopy(model)
    for s in (group[0], group[3]):
        seq = s.sequences[0]
        loss, _ = token_loss(sequence_logprobs(ref, seq), sampled(seq), torch.tensor(0.5), cfg)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_a_passing_rollouts_failed_calls_get_no_credit_and_a_failing_rollouts_keep_their_blame():
    """`failed_call_credit = 0`: the tokens of a policy call that failed a tool call get no share of
    a positive advantage (the gradient equals the one computed by hand with those tokens' advantage
    at 0), while a negative advantage still reaches every token of its rollout."""
    from opencomposer.rl.forward import sequence_logprobs
    from opencomposer.rl.objective import token_loss
    from opencomposer.rl.trainer import sampled

    def model():
        torch.manual_seed(0)
        return LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

    group = samples(200)  # rewards 1, 0, 0, 1: advantages 0.5, -0.5, -0.5, 0.5
    for s in group:  # two policy calls each: the first 3 trained tokens, then the rest
        q = s.sequences[0]
        q.completions, q.completion_tokens, q.failed_calls = [0, 1], [3, q.trained_tokens - 3], [1]
    cfg = ObjectiveConfig(group_size=4, kl_coef=0.0, failed_call_credit=0.0)
    got = {}
    for credit in (0.0, 1.0):
        m = model()
        trainer = RLTrainer(m, ObjectiveConfig(group_size=4, kl_coef=0.0, failed_call_credit=credit),
                            TrainerConfig(lr=1e-3, share_prompt=False))
        trainer.opt.step = lambda m=m, c=credit: got.update({c: {n: p.grad.clone() for n, p in m.named_parameters()}})
        stats = trainer.step([group])
        assert stats.get("scaled_tokens", 0) == (sum(group[i].trained_tokens - 3 for i in (0, 3)) if credit == 0 else 0)
        rewarded = 0.5 * (2 * 3 if credit == 0 else group[0].trained_tokens + group[3].trained_tokens)
        assert stats["advantage_mass"] == pytest.approx([rewarded, -0.5 * (group[1].trained_tokens +
                                                                            group[2].trained_tokens)])
    assert any(not torch.allclose(got[0.0][n], got[1.0][n]) for n in got[0.0])  # the setting changes the step

    ref = model()
    for s, a in zip(group, (0.5, -0.5, -0.5, 0.5)):
        q = s.sequences[0]
        adv = torch.full((q.trained_tokens,), a)
        if a > 0:
            adv[3:] = 0.0
        loss, _ = token_loss(sequence_logprobs(ref, q), sampled(q), adv, cfg)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[0.0][n], p.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_call_advantages_compare_calls_of_one_tool_and_train_groups_without_an_outcome_signal():
    """`call_advantage`: each tool-calling policy call gets c (ok - m_tool) on its own tokens, m_tool
    the share of ok calls of that tool in the group. It trains a group that passed nothing (skipped
    otherwise), its gradient equals the one computed by hand, and a group whose calls of each tool
    all agree trains nothing."""
    from opencomposer.rl.forward import sequence_logprobs
    from opencomposer.rl.objective import call_advantages, token_loss
    from opencomposer.rl.trainer import sampled

    got = call_advantages([("a", "grep", True), ("b", "search_replace", False), ("c", "search_replace", True),
                           ("d", "search_replace", True), ("e", "grep", True)], 0.5)
    assert got == pytest.approx({"a": 0.0, "b": -0.5 * 2 / 3, "c": 0.5 / 3, "d": 0.5 / 3, "e": 0.0})

    def model():
        torch.manual_seed(0)
        return LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

    group = samples(200)
    for s in group:  # nothing passed: under "skip" only the call term can train this group
        s.reward, s.passed = 0.0, False
        q = s.sequences[0]  # two policy calls each: a grep (3 tokens), then an edit (the rest)
        q.completions, q.completion_tokens, q.calls = [0, 1], [3, q.trained_tokens - 3], ["grep", "search_replace"]
    group[1].sequences[0].failed_calls = [1]  # one of four edits failed: m = 3/4
    cfg = ObjectiveConfig(group_size=4, kl_coef=0.0, unsolved_groups="skip", call_advantage=1.0)
    m = model()
    trainer = RLTrainer(m, cfg, TrainerConfig(lr=1e-3, share_prompt=False))
    grads = {}
    trainer.opt.step = lambda: grads.update({n: p.grad.clone() for n, p in m.named_parameters()})
    stats = trainer.step([group])
    assert stats["unsolved_groups_skipped"] == 1 and stats["call_only_groups"] == 1 and stats["updated"]
    edits = [group[i].trained_tokens - 3 for i in range(4)]
    assert stats["call_mass"] == pytest.approx([0.25 * (edits[0] + edits[2] + edits[3]), -0.75 * edits[1]])

    ref = model()
    for i, s in enumerate(group):
        q = s.sequences[0]
        adv = torch.zeros(q.trained_tokens)
        adv[3:] = -0.75 if i == 1 else 0.25
        loss, _ = token_loss(sequence_logprobs(ref, q), sampled(q), adv, cfg)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)

    group[1].sequences[0].failed_calls = []  # every edit applied: no verdict tells the calls apart
    trainer = RLTrainer(model(), cfg, TrainerConfig(lr=1e-3, share_prompt=False))
    stats = trainer.step([group])
    assert not stats["updated"] and stats.get("call_only_groups", 0) == 0


def test_failed_calls_left_out_of_the_outcome_either_way():
    """`failed_call_credit = 0` and `failed_call_blame = 0`: the tokens of a policy call that broke a
    call or failed an edit get no share of the rollout's advantage, positive or negative (the
    gradient equals the one computed by hand with those tokens at 0); the rest keep it."""
    from opencomposer.rl.forward import sequence_logprobs
    from opencomposer.rl.objective import token_loss
    from opencomposer.rl.trainer import sampled

    def model():
        torch.manual_seed(0)
        return LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

    group = samples(200)  # advantages 0.5, -0.5, -0.5, 0.5
    for s in group:
        q = s.sequences[0]
        q.completions, q.completion_tokens, q.failed_calls = [0, 1], [3, q.trained_tokens - 3], [1]
    cfg = ObjectiveConfig(group_size=4, kl_coef=0.0, failed_call_credit=0.0, failed_call_blame=0.0)
    m = model()
    trainer = RLTrainer(m, cfg, TrainerConfig(lr=1e-3, share_prompt=False))
    grads = {}
    trainer.opt.step = lambda: grads.update({n: p.grad.clone() for n, p in m.named_parameters()})
    stats = trainer.step([group])
    assert stats["scaled_tokens"] == sum(s.trained_tokens - 3 for s in group)
    assert stats["advantage_mass"] == pytest.approx([0.5 * 6, -0.5 * 6])
    ref = model()
    for s, a in zip(group, (0.5, -0.5, -0.5, 0.5)):
        q = s.sequences[0]
        adv = torch.full((q.trained_tokens,), a)
        adv[3:] = 0.0
        loss, _ = token_loss(sequence_logprobs(ref, q), sampled(q), adv, cfg)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="failed_call_blame"):
        ObjectiveConfig(failed_call_blame=1.5)


@pytest.mark.parametrize("kl_coef", [0.0, 0.01])
def test_bf16_runs_the_blocks_products_in_bfloat16_and_steps_near_float32(kl_coef):
    """`TrainerConfig.bf16`: the training forward's products (shared prompt, suffixes, their
    checkpointed recompute, the reference model's) run in bfloat16, the weights stay float32, and the
    step's update points where float32's does without being it (so autocast really ran)."""
    def run(bf16: bool):
        torch.manual_seed(0)
        model = LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        before = copy.deepcopy(model.state_dict())
        seen = []
        model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        trainer = RLTrainer(model, ObjectiveConfig(group_size=4, kl_coef=kl_coef),
                            TrainerConfig(lr=1e-3, bf16=bf16, checkpoint_tokens=8))
        stats = trainer.step([samples(200)])
        assert stats["updated"] and stats["bf16"] is bf16
        assert all(p.dtype == torch.float32 for p in model.parameters())
        delta = torch.cat([(v - before[k]).flatten() for k, v in model.state_dict().items()])
        return delta, set(seen)

    d32, seen32 = run(False)
    d16, seen16 = run(True)
    assert seen32 == {torch.float32} and seen16 == {torch.bfloat16}
    assert not torch.equal(d16, d32)
    assert float(torch.nn.functional.cosine_similarity(d16, d32, dim=0)) > 0.9


def test_bf16_auto_follows_the_cpu(monkeypatch):
    from opencomposer.kernels import bf16

    for native in (True, False):
        monkeypatch.setattr(bf16, "native_bf16", lambda native=native: native)
        assert bf16.resolve_bf16("auto") is native
    assert bf16.resolve_bf16(True) is True and bf16.resolve_bf16(False) is False
    with pytest.raises(ValueError, match="auto"):
        bf16.resolve_bf16("yes")
