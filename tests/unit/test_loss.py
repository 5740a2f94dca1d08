"""Chunked losses from hidden states equal the materialised-logits versions, values and gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import opencomposer.model.loss as loss  # noqa: E402


@pytest.fixture
def small_chunks(monkeypatch):
    """Force many chunks so that chunk boundaries are exercised."""
    real = loss._chunks
    monkeypatch.setattr(loss, "_chunks", lambda n, v, budget=0: real(n, v, budget=7 * v))


def _inputs():
    torch.manual_seed(0)
    return torch.randn(37, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)


@pytest.mark.parametrize("ignored", [[3, 20], [*range(10), *range(19, 30), *range(31, 37)]],
                         ids=["few-ignored", "sft-like"])
def test_cross_entropy_matches_torch(small_chunks, ignored):
    h, w = _inputs()
    labels = torch.randint(0, 50, (37,))
    labels[ignored] = loss.IGNORE
    ours = loss.cross_entropy(h, w, labels)
    (2 * ours).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.nn.functional.cross_entropy(h @ w.T, labels)
    (2 * ref).backward()
    assert abs(ours.item() - ref.item()) < 1e-5
    assert torch.allclose(gh, h.grad, atol=1e-6) and torch.allclose(gw, w.grad, atol=1e-6)


def test_cross_entropy_puts_only_labelled_rows_through_the_head(monkeypatch):
    """SFT labels the assistant's few hundred tokens of a ~2,000-token conversation: the head's
    products run on those rows alone, and a sequence with no label costs nothing and trains nothing."""
    rows = []
    real = loss.times_t
    monkeypatch.setattr(loss, "times_t", lambda a, b: rows.append(a.shape[0]) or real(a, b))
    h, w = _inputs()
    labels = torch.full((37,), loss.IGNORE)
    labels[12:17] = torch.randint(0, 50, (5,))
    loss.cross_entropy(h, w, labels)
    assert rows[0] == 5  # the logits product; the gradient products follow on the same rows
    labels[:] = loss.IGNORE
    rows.clear()
    out = loss.cross_entropy(h, w, labels)
    out.backward()
    assert rows == [] and out.item() == 0.0 and not h.grad.any() and not w.grad.any()


def test_token_logprobs_match_log_softmax(small_chunks):
    h, w = _inputs()
    targets, upstream = torch.randint(0, 50, (37,)), torch.randn(37)
    ours = loss.token_logprobs(h, w, targets, temperature=0.7)
    (ours * upstream).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.log_softmax(h @ w.T / 0.7, -1).gather(1, targets[:, None])[:, 0]
    (ref * upstream).sum().backward()
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)


def test_causal_lm_loss_equals_the_logits_path():
    from opencomposer.model.llama import PRESETS, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"])
    ids = torch.randint(0, 512, (2, 12))
    ref = torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
    assert abs(loss.causal_lm_loss(model, ids).item() - ref.item()) < 1e-5
