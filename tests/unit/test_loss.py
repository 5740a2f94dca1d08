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


def test_cross_entropy_matches_torch(small_chunks):
    h, w = _inputs()
    labels = torch.randint(0, 50, (37,))
    labels[[3, 20]] = loss.IGNORE
    ours = loss.cross_entropy(h, w, labels)
    (2 * ours).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.nn.functional.cross_entropy(h @ w.T, labels)
    (2 * ref).backward()
    assert abs(ours.item() - ref.item()) < 1e-5
    assert torch.allclose(gh, h.grad, atol=1e-6) and torch.allclose(gw, w.grad, atol=1e-6)


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
