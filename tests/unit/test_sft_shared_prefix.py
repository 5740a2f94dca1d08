"""SFT rows that share a prompt, trained with the prompt computed once, give the padded batch's loss
and the same gradient on every parameter; the prefix stops before the first labelled token; the
trainer takes either kind of batch to the same weights, and SFT uses the shared one for batches of
more than one row."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from opencomposer.model.llama import LlamaConfig, LlamaModel
from opencomposer.model.loss import IGNORE
from opencomposer.train import shared_prefix
from opencomposer.train.sft import Example, collate
from opencomposer.train.shared_prefix import SharedPrefixBatch
from opencomposer.train.trainer import OptimConfig, PhaseConfig, Trainer


def dense():
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def rows(prompt_len=30, tails=((8, 5), (15, 9), (11, 0)), seed=1) -> list[tuple[list[int], list[int]]]:
    """A shared prompt, then per row an unlabelled stretch (a tool output) and a labelled one (the
    assistant's reply); the labels sit on the reply's tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 300, (prompt_len,), generator=g).tolist()
    out = []
    for user, reply in tails:
        tail = torch.randint(0, 300, (user + reply,), generator=g).tolist()
        ids = prompt + tail
        labels = [IGNORE] * (prompt_len + user) + tail[user:]
        out.append((ids, labels))
    return out


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def padded_step(model, batch_rows):
    model.zero_grad(set_to_none=True)
    ids, _, labels = collate([Example(i, lab) for i, lab in batch_rows], pad=0)
    from opencomposer.model.loss import cross_entropy

    loss = cross_entropy(model(ids, logits=False).hidden[:, :-1], model.lm_head.weight, labels)
    loss.backward()
    return float(loss.detach()), grads(model)


def test_same_loss_and_gradients_as_the_padded_batch():
    model = dense().train()
    batch_rows = rows()
    batch = SharedPrefixBatch.of(batch_rows)
    assert batch.prefix == 30  # the whole prompt: the first labelled token comes after the tool output
    assert batch.labelled() == 5 + 9
    assert batch.tokens() == 30 + 13 + 24 + 11
    loss, want = padded_step(model, batch_rows)
    model.zero_grad(set_to_none=True)
    got_loss = shared_prefix.backward(model, batch)
    got = grads(model)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    # a different batch gives a different gradient: the comparison above can fail
    _, other = padded_step(model, rows(seed=2))
    assert not torch.allclose(other["layers.0.self_attn.q_proj.weight"], want["layers.0.self_attn.q_proj.weight"])


def test_the_loss_before_and_after_training_is_the_padded_batchs(monkeypatch):
    """SFT's evaluation (`mean_loss`) with the prompt computed once gives the padded batches' mean."""
    from opencomposer.train.sft import mean_loss

    model = dense().train()
    examples = [Example(i, lab) for i, lab in rows()]
    padded = mean_loss(model, examples, pad=0, batch_size=2)
    calls, loss_sum = [], shared_prefix.loss_sum
    monkeypatch.setattr(shared_prefix, "loss_sum", lambda m, b: calls.append(b.prefix) or loss_sum(m, b))
    shared = mean_loss(model, examples, pad=0, batch_size=2, share_prefix=True)
    assert calls == [30] and model.training  # the prompt computed once; the mode put back as it was
    assert shared == pytest.approx(padded, rel=1e-5)
    other = mean_loss(model, [Example(i, lab) for i, lab in rows(seed=2)], pad=0, batch_size=2, share_prefix=True)
    assert other != pytest.approx(padded, rel=1e-3)  # the comparison above can fail
    # rows that share nothing are evaluated padded
    apart = [examples[0], Example([7] + examples[1].ids[1:], examples[1].labels)]
    assert mean_loss(model, apart, pad=0, batch_size=1, share_prefix=True) == mean_loss(model, apart, pad=0,
                                                                                         batch_size=1)


def test_prefix_stops_before_the_first_labelled_token_and_at_the_first_difference():
    a = ([1, 2, 3, 4, 5, 6], [IGNORE, IGNORE, IGNORE, 4, 5, 6])  # label 3 is predicted from position 2
    b = ([1, 2, 3, 4, 9, 9], [IGNORE] * 4 + [9, 9])
    assert SharedPrefixBatch.of([a, b]).prefix == 2
    c = ([1, 7, 3, 4, 5, 6], [IGNORE] * 5 + [6])
    assert SharedPrefixBatch.of([b, c]).prefix == 1
    assert SharedPrefixBatch.of([a]).prefix == 0  # one row: nothing to share
    d = ([5, 2, 3], [IGNORE, IGNORE, 3])
    assert SharedPrefixBatch.of([a, d]).prefix == 0
    with pytest.raises(ValueError):
        SharedPrefixBatch.of([])


def test_a_batch_without_a_shared_prefix_still_matches():
    model = dense().train()
    batch_rows = rows() + [([7] + rows(seed=3)[0][0][1:], [IGNORE] + rows(seed=3)[0][1][1:])]
    batch = SharedPrefixBatch.of(batch_rows)
    assert batch.prefix == 0
    loss, want = padded_step(model, batch_rows)
    model.zero_grad(set_to_none=True)
    assert shared_prefix.backward(model, batch) == pytest.approx(loss, rel=1e-5)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_takes_shared_prefix_batches(tmp_path):
    batch_rows = rows()
    results = []
    for kind in ("padded", "shared"):
        model = dense()
        trainer = Trainer(model, OptimConfig(batch_size=3, ckpt_every=10**6, checkpoint_at_end=False),
                          (PhaseConfig(name="sft", steps=2, seq_len=64, lr=1e-3, warmup=0, schedule="constant"),),
                          tmp_path / kind)

        def batches(pi, phase, kind=kind):
            if kind == "shared":
                return SharedPrefixBatch.of(batch_rows)
            return collate([Example(i, lab) for i, lab in batch_rows], pad=0)

        hist = trainer.run(batches, dict)
        results.append(([h["loss"] for h in hist], [h["tokens"] for h in hist],
                        torch.cat([p.detach().flatten() for p in model.parameters()])))
    (loss_a, tok_a, w_a), (loss_b, tok_b, w_b) = results
    assert tok_a == tok_b == [14, 14]
    assert loss_b == pytest.approx(loss_a, rel=1e-4)
    assert loss_a[1] < loss_a[0]  # it trained
    # Adam divides by the gradient's own size, so where a weight's gradient is ~0 a float-order
    # difference moves it by a visible share of lr (1e-3): within 5% of one step, not 1e-6
    torch.testing.assert_close(w_b, w_a, rtol=0, atol=5e-5)
    w0 = torch.cat([p.detach().flatten() for p in dense().parameters()])
    assert float((w_a - w0).abs().max()) > 1e-3  # two steps at lr 1e-3 moved them: the check can fail


def test_sft_uses_shared_prefix_batches_for_more_than_one_row(tmp_path, monkeypatch):
    """`sft.run`'s batches: shared-prefix batches at batch size 2, padded ones at 1 or when off."""
    from opencomposer.train import sft

    seen = []
    real = Trainer.run

    def spy(self, batches, data_state, on_progress=None, stop_at=None):
        def wrapped(pi, phase):
            b = batches(pi, phase)
            seen.append(type(b).__name__)
            return b
        return real(self, wrapped, data_state, on_progress, stop_at)

    monkeypatch.setattr(Trainer, "run", spy)
    model = dense()
    monkeypatch.setattr(sft, "load_base", lambda *a, **k: (model, FakeTokenizer(), tmp_path))
    monkeypatch.setattr(sft, "export", lambda model, folder, out: out)
    monkeypatch.setattr(sft, "default_tool_schemas", list)
    monkeypatch.setattr("opencomposer.tokenizer.chat.ChatRenderer", FakeRenderer)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": str(i)},
                                                       {"role": "assistant", "content": "ok"}]}) for i in range(4)))
    for batch_size, share, want in ((2, True, "SharedPrefixBatch"), (1, True, "tuple"), (2, False, "tuple")):
        seen.clear()
        cfg = sft.SFTConfig(model="x", data=(str(data),), share_prefix=share, heldout_fraction=0.0,
                            phases=(PhaseConfig(name="sft", steps=2, seq_len=64, lr=1e-4, warmup=0),),
                            optim=OptimConfig(batch_size=batch_size, ckpt_every=10**6, checkpoint_at_end=False),
                            out_dir=tmp_path / f"runs{batch_size}{share}")
        sft.run(cfg)
        assert seen == [want, want]


class FakeTokenizer:
    """A fake for this unit test: only the pad id SFT reads."""
    eos_id = 0


class FakeRenderer:
    """A fake for this unit test: a shared 20-token 'system prompt', then the user's digit, then a
    labelled 3-token reply."""

    def __init__(self, tok):
        pass

    def encode(self, messages, tools):
        from types import SimpleNamespace

        user = int(messages[0]["content"])
        ids = list(range(1, 21)) + [100 + user, 7, 8, 9]
        return SimpleNamespace(ids=ids, loss_mask=[0] * 21 + [1, 1, 1])


def test_trainer_refuses_a_shared_prefix_batch_across_processes(tmp_path):
    """Its backward runs once a row and once more for the prefix, which FSDP's hooks are not built for:
    more than one process gets a clear error, not a silently wrong gradient."""
    from opencomposer.train.trainer import TrainError

    trainer = Trainer(dense(), OptimConfig(batch_size=3, ckpt_every=10**6, checkpoint_at_end=False),
                      (PhaseConfig(name="sft", steps=1, seq_len=64, lr=1e-3, warmup=0),), tmp_path)
    trainer.world = 2  # as distributed.setup() would report under torchrun
    with pytest.raises(TrainError, match="one process"):
        trainer.run(lambda pi, phase: SharedPrefixBatch.of(rows()), dict)
    assert trainer.step == 0
