"""What a restarted RL run resumes from (`rl/progress.py`): the trainer's state is saved only by a
step that moved a weight, the groups taken by every step, and a run killed between the two writes
resumes from the state alone."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from opencomposer.model.llama import LlamaConfig, LlamaModel  # noqa: E402
from opencomposer.rl.objective import ObjectiveConfig  # noqa: E402
from opencomposer.rl.progress import STATE, TAKEN, load_progress, save_progress  # noqa: E402
from opencomposer.rl.trainer import RLTrainer, TrainerConfig  # noqa: E402


def trainer(seed: int) -> RLTrainer:
    torch.manual_seed(seed)
    m = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    return RLTrainer(m, ObjectiveConfig(group_size=2), TrainerConfig(lr=1e-3))


def test_a_step_that_moved_nothing_writes_only_the_groups_it_took(tmp_path):
    assert load_progress(tmp_path, trainer(0)) == (0, set())
    t = trainer(0)
    save_progress(tmp_path, t, 1, {0}, moved=True)
    state = (tmp_path / STATE).stat().st_mtime_ns
    saved = {k: v.clone() for k, v in t.model.state_dict().items()}
    save_progress(tmp_path, t, 1, {0, 1}, moved=False)
    save_progress(tmp_path, t, 1, {0, 1, 2}, moved=False)
    assert (tmp_path / STATE).stat().st_mtime_ns == state  # the 1.6 GB file was not written again
    fresh = trainer(1)  # other weights: the load must bring back the saved ones
    assert load_progress(tmp_path, fresh) == (1, {0, 1, 2})
    assert all(torch.equal(v, saved[k]) for k, v in fresh.model.state_dict().items())


def test_a_run_killed_between_the_two_writes_resumes_from_the_state(tmp_path):
    t = trainer(0)
    save_progress(tmp_path, t, 1, {0, 1}, moved=False)  # no state yet: the first step saves it anyway
    assert (tmp_path / STATE).exists()
    save_progress(tmp_path, t, 2, {0, 1, 2}, moved=True)
    # killed after the state was written and before the groups were: trained.json is a version behind
    (tmp_path / TAKEN).write_text(json.dumps({"version": 1, "trained_groups": [0, 1]}) + "\n")
    assert load_progress(tmp_path, trainer(0)) == (2, {0, 1, 2})
