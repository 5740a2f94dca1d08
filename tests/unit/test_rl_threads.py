"""The cores between the trainer and a replica process (`rl/threads.py`): the replica takes the
trainer's threads while the trainer waits, the trainer takes the replica's during a step once no
rollout is in flight, and each side gets its own share back."""

import copy

import torch

from opencomposer.model.llama import LlamaConfig, LlamaModel
from opencomposer.rl.objective import ObjectiveConfig
from opencomposer.rl.threads import ThreadShare
from opencomposer.rl.trainer import RLTrainer, TrainerConfig
from tests.unit.test_rl_trainer import samples


class FakeReplica:
    """A unit-test fake: records the thread counts a driver asks of it (the real one is
    `ReplicaProcess.set_threads`, POST /admin/threads, tested in tests/integration/test_server.py)."""

    url = "http://fake/v1"

    def __init__(self):
        self.asked: list[int] = []

    def set_threads(self, n: int) -> bool:
        self.asked.append(n)
        return True


def test_the_replica_gets_the_trainers_threads_while_it_waits_and_gives_them_back():
    share, replica = ThreadShare((1, 1), lend=True, borrow=True), FakeReplica()
    share.lend_to(replica)
    share.lend_to(replica)  # unchanged: not asked again
    share.reclaim(replica)
    assert replica.asked == [2, 1]
    lent, borrowed = share.take_seconds()
    assert lent > 0 and borrowed == 0
    assert share.take_seconds() == (0.0, 0.0)
    off, replica = ThreadShare((1, 1), lend=False, borrow=True), FakeReplica()
    off.lend_to(replica)
    assert replica.asked == []


def test_the_trainer_borrows_the_replicas_threads_only_once_no_rollout_is_in_flight():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        share = ThreadShare((1, 1), lend=True, borrow=True)
        busy = [True]
        between = share.borrower(lambda: not busy[0])
        between()
        assert torch.get_num_threads() == 1  # a rollout in flight: the replica's core stays its own
        busy[0] = False
        between()
        assert torch.get_num_threads() == 2
        share.step_ended()
        assert torch.get_num_threads() == 1
        assert share.take_seconds()[1] > 0
        assert ThreadShare((1, 1), lend=True, borrow=False).borrower(lambda: True) is None
        assert ThreadShare((0, 0), lend=False, borrow=True).borrower(lambda: True) is None  # no split: no share
    finally:
        torch.set_num_threads(before)


def test_a_trainer_step_asks_before_each_pass_and_computes_the_same_gradient():
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    twin = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    calls = []
    own = torch.get_num_threads()

    def between():  # as `ThreadShare` does when it borrows: the thread count changes between passes
        calls.append(torch.get_num_threads())
        torch.set_num_threads(1 if len(calls) % 2 else 2)

    a = RLTrainer(model, ObjectiveConfig(group_size=4, kl_coef=0.01), TrainerConfig(lr=1e-3))
    a.between = between
    b = RLTrainer(twin, ObjectiveConfig(group_size=4, kl_coef=0.01), TrainerConfig(lr=1e-3))
    try:
        sa = a.step([samples(200)])
    finally:
        torch.set_num_threads(own)
    sb = b.step([samples(200)])
    # the reference forward, the shared prompt, each of the 4 rollouts, the prompt's backward
    assert len(calls) == 7 and calls[1:] == [1, 2, 1, 2, 1, 2]
    # the same step, up to the float reductions a thread count may reorder
    assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 1e-5 * sb["grad_norm"]
    assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(model.parameters(), twin.parameters()))
    assert any(not torch.equal(p, q0) for p, q0 in zip(model.parameters(), initial))
