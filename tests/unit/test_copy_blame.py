"""Copy blame (`rl/copy_blame.py`): the sampled token where a failed edit's `old_string` left the
file, found from the sampled ids, and its own negative advantage in the trainer."""

import json

import pytest
import torch

from opencomposer.harness.tools.files import matched_prefix
from opencomposer.rl.copy_blame import blame_token, copy_errors, token_copy_blame
from opencomposer.tokenizer.bpe import train_bpe

FILE = 'def _monthlen(year, month):\n        return mdays[month] + (month == February and isleap(year))\n'


def test_matched_prefix_is_the_longest_prefix_found_in_the_file():
    assert matched_prefix("def _monthlen(year, month):\n        return", FILE) == len(
        "def _monthlen(year, month):\n        return")  # the whole of it occurs (not a NoMatch)
    assert matched_prefix("def _monthlen(year, month):\n          return", FILE) == len(
        "def _monthlen(year, month):\n        ")  # two spaces too many
    assert matched_prefix("return mdays[month] + (month == Feb)", FILE) == len("return mdays[month] + (month == Feb")
    assert matched_prefix("zzz", FILE) == 0 and matched_prefix("", FILE) == 0


@pytest.fixture(scope="module")
def tok():
    return train_bpe([FILE * 20, '<tool_call>\n{"name": "search_replace", "arguments": {"file_path": "a.py"}}\n'
                      '</tool_call>' * 20], vocab_size=400)


def completion(calls: list[dict]) -> str:
    return "I will edit it." + "".join(
        '\n<tool_call>\n{"name": "search_replace", "arguments": ' + json.dumps(a) + "}\n</tool_call>"
        for a in calls) + "<|im_end|>"


def brute_force(tok, ids, at):
    """The first token whose decoded prefix is longer than `at`, by decoding every prefix."""
    return next(t for t in range(len(ids)) if len(tok.decode(ids[:t + 1])) > at)


@pytest.mark.parametrize("old,matched", [
    ("def _monthlen(year, month):\n          return", len("def _monthlen(year, month):\n        ")),
    ('say("caf\u00e9 \\"q\\"")\tx', 5),  # escapes (\u00e9, \", \\, \t) before and after the place
    ("zzz", 0),
])
def test_the_blamed_token_writes_the_first_character_past_the_match(tok, old, matched):
    other = {"file_path": "a.py", "old_string": "x = 1", "new_string": "x = 2"}
    text = completion([other, {"file_path": "a.py", "old_string": old, "new_string": "y"}])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    t = blame_token(tok, ids, 1, old, matched)
    raw = json.dumps(old)  # where character `matched` of the value was written in the text
    value_at = text.index(raw, text.index('"old_string"', text.index(json.dumps(other["old_string"])) + 5))
    body = raw[1:-1]
    k, i = 0, 0
    while k < matched:  # skip `matched` characters of the value, escapes counted as one
        i += 6 if body[i:i + 2] == "\\u" else 2 if body[i] == "\\" else 1
        k += 1
    assert t == brute_force(tok, ids, value_at + 1 + i)
    assert len(tok.decode(ids[:t])) <= value_at + 1 + i < len(tok.decode(ids[:t + 1]))
    # the first call's value is another string: no blame for a value that is not the tool's
    assert blame_token(tok, ids, 0, old, matched) is None
    assert blame_token(tok, ids, 2, old, matched) is None
    assert blame_token(tok, ids, 1, old, len(old)) is None


def test_a_key_escaped_inside_another_string_is_not_a_value(tok):
    trap = {"file_path": "a.py", "old_string": 'k = "\\"old_string\\": \\"no\\""', "new_string": "z"}
    ids = tok.encode(completion([trap]))
    assert blame_token(tok, ids, 0, trap["old_string"], 3) == brute_force(
        tok, ids, completion([trap]).index('"old_string": ') + len('"old_string": "') + 3)


def test_copy_errors_read_the_trajectory_and_the_trainer_blames_one_token(tok, tmp_path):
    """From a trajectory's records to the sequence's per-token blame, and in the trainer: a group
    that passed nothing (skipped by the outcome) trains on the copy blame alone, and the blamed
    token's log-probability falls, against the same step at lr 0."""
    from opencomposer.model.llama import LlamaConfig, LlamaModel
    from opencomposer.rl.forward import sequence_logprobs
    from opencomposer.rl.objective import ObjectiveConfig
    from opencomposer.rl.rollout import Sample
    from opencomposer.rl.sequences import RLSequence
    from opencomposer.rl.trainer import RLTrainer, TrainerConfig

    old = "def _monthlen(year, month):\n          return"
    matched = len("def _monthlen(year, month):\n        ")
    calls = [{"file_path": "a.py", "old_string": "x = 1", "new_string": "x = 2"},
             {"file_path": "a.py", "old_string": old, "new_string": "y"}]
    traj = {"segments": [{"completions": [
        {"tool_calls": [{"id": "g", "arguments": json.dumps({"pattern": "x"})}]},
        {"tool_calls": [{"id": f"c{i}", "arguments": json.dumps(a)} for i, a in enumerate(calls)]}]}],
        "tool_calls": [{"segment": 0, "id": "g", "error_type": None},
                       {"segment": 0, "id": "c0", "error_type": None},
                       {"segment": 0, "id": "c1", "error_type": "NoMatch", "detail": {"matched": matched}}]}
    assert copy_errors(traj) == {(0, 1): [[1, old, matched]]}

    first, second = tok.encode("I will grep.<|im_end|>"), tok.encode(completion(calls))
    prompt = tok.encode("<|im_start|>user\nfix it<|im_end|>\n")
    gap = tok.encode("<|im_start|>tool\nok<|im_end|>\n")
    seq = RLSequence(ids=prompt + first + gap + second,
                     loss_mask=[0] * len(prompt) + [1] * len(first) + [0] * len(gap) + [1] * len(second),
                     logprobs=[-1.0] * (len(prompt) + len(first) + len(gap) + len(second)),
                     versions=[0] * (len(prompt) + len(first) + len(gap) + len(second)),
                     completions=[0, 1], completion_tokens=[len(first), len(second)],
                     copy_errors=[[1, *e] for e in copy_errors(traj)[(0, 1)]], sampling={"temperature": 1.0})
    blame, hits = token_copy_blame(seq, tok, 2.0)
    t = len(first) + blame_token(tok, second, 1, old, matched)
    assert hits == 1 and blame[t] == -2.0 and sum(blame) == -2.0 and len(blame) == seq.trained_tokens
    assert token_copy_blame(seq, tok, 0.0) is None

    def model():
        torch.manual_seed(0)
        return LlamaModel(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256))

    def group():
        plain = RLSequence(ids=list(seq.ids), loss_mask=list(seq.loss_mask), logprobs=list(seq.logprobs),
                           versions=list(seq.versions), completions=[0, 1],
                           completion_tokens=list(seq.completion_tokens), sampling={"temperature": 1.0})
        return [Sample(id=f"s{i}", group=0, index=i, task="t", reward=0.0, passed=False,
                       sequences=[seq if i == 0 else plain], trained_tokens=seq.trained_tokens) for i in range(4)]

    cfg = ObjectiveConfig(group_size=4, kl_coef=0.0, unsolved_groups="skip", copy_blame=2.0)
    with pytest.raises(ValueError, match="tokenizer.json"):
        RLTrainer(model(), cfg, TrainerConfig(lr=1e-3), model_dir=tmp_path)
    tok.save(tmp_path / "tokenizer.json")
    after = {}
    for lr in (0.0, 3e-3):
        m = model()
        trainer = RLTrainer(m, cfg, TrainerConfig(lr=lr, share_prompt=False), model_dir=tmp_path)
        for _ in range(3):
            stats = trainer.step([group()])
        assert stats["unsolved_groups_skipped"] == 1 and stats["copy_blamed_tokens"] == 1 and stats["updated"]
        with torch.no_grad():
            after[lr] = sequence_logprobs(m, seq).detach()
    assert float(after[3e-3][t] - after[0.0][t]) < -0.05  # the blamed token fell
    others = [i for i in range(seq.trained_tokens) if i != t]
    assert float((after[3e-3][others] - after[0.0][others]).abs().mean()) < abs(float(after[3e-3][t] - after[0.0][t]))


def test_a_group_the_outcome_skips_runs_no_reference_forward_for_a_kl_in_the_reward(tok, tmp_path):
    """With the KL in the reward, a group that passed nothing (trained here on the copy blame alone)
    has no reward to take it from: the reference model's forward is skipped; a group that passed runs it."""
    from opencomposer.model.llama import LlamaConfig, LlamaModel
    from opencomposer.rl.objective import ObjectiveConfig
    from opencomposer.rl.rollout import Sample
    from opencomposer.rl.sequences import RLSequence
    from opencomposer.rl.trainer import RLTrainer, TrainerConfig

    old, matched = "zzz", 0
    ids = tok.encode(completion([{"file_path": "a.py", "old_string": old, "new_string": "y"}]))
    prompt = tok.encode("<|im_start|>user\nfix it<|im_end|>\n")

    def group(passed: bool):
        return [Sample(id=f"s{i}", group=0, index=i, task="t", reward=float(passed and i == 0), passed=passed and i == 0,
                       sequences=[RLSequence(ids=prompt + ids, loss_mask=[0] * len(prompt) + [1] * len(ids),
                                             logprobs=[-1.0] * (len(prompt) + len(ids)),
                                             versions=[0] * (len(prompt) + len(ids)), completions=[0],
                                             completion_tokens=[len(ids)], copy_errors=[[0, 0, old, matched]],
                                             sampling={"temperature": 1.0})], trained_tokens=len(ids))
                for i in range(4)]

    tok.save(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    m = LlamaModel(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    cfg = ObjectiveConfig(group_size=4, kl_coef=0.01, unsolved_groups="skip", copy_blame=1.0)
    trainer = RLTrainer(m, cfg, TrainerConfig(lr=1e-3, share_prompt=False), model_dir=tmp_path)
    forwards = []
    real = trainer._group_refs
    trainer._group_refs = lambda g: forwards.append(len(g)) or real(g)
    stats = trainer.step([group(False)])
    assert stats["copy_blamed_tokens"] == 4 and stats["updated"] and forwards == []
    trainer.step([group(True)])
    assert forwards == [4]
