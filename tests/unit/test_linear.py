"""The oneDNN product path (`model/linear.py`): the same numbers as `F.linear` (float32 rounding
apart), forward and both gradients, and only where it applies."""

import pytest
import torch
import torch.nn.functional as F

from opencomposer.model import linear as lin
from opencomposer.model.llama import PRESETS, LlamaModel
from opencomposer.model.loss import cross_entropy, token_logprobs

needs_onednn = pytest.mark.skipif(lin._onednn_op() is None, reason="this torch has no oneDNN linear op")


@pytest.fixture
def onednn():
    before = lin.set_backend("onednn")
    yield
    lin.set_backend(before)


def _close(a, b, rel=1e-5):
    assert (a - b).abs().max().item() <= rel * max(1.0, b.abs().max().item()), (a - b).abs().max().item()


@needs_onednn
@pytest.mark.parametrize("shape", [(5, 96), (3, 7, 96), "strided"])
def test_forward_and_gradients_match_f_linear(onednn, shape):
    g = torch.Generator().manual_seed(0)
    if shape == "strided":  # a transposed view, as attention's output reshape can hand over
        x0 = torch.randn(7, 3, 96, generator=g).transpose(0, 1)
    else:
        x0 = torch.randn(*shape, generator=g)
    w0 = torch.randn(80, 96, generator=g)
    up = torch.randn(*x0.shape[:-1], 80, generator=g)
    outs = []
    for fn in (lin.linear, F.linear):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        y.backward(up)
        outs.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*outs):
        _close(a, b)


@needs_onednn
def test_model_and_losses_agree_across_backends(onednn):
    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"])
    ids = torch.randint(0, 512, (2, 33))
    res = {}
    for name in ("onednn", "aten"):
        lin.set_backend(name)
        model.zero_grad()
        h = model(ids, logits=False).hidden
        lp = token_logprobs(h[:, :-1], model.lm_head.weight, ids[:, 1:], 0.7)
        ce = cross_entropy(h[:, :-1], model.lm_head.weight, ids[:, 1:])
        (lp.sum() + ce).backward()
        res[name] = (lp.detach(), ce.detach(), [p.grad.clone() for p in model.parameters()])
    _close(res["onednn"][0], res["aten"][0])
    _close(res["onednn"][1], res["aten"][1])
    for a, b in zip(res["onednn"][2], res["aten"][2]):
        _close(a, b, 1e-4)


class FakeOp:
    """A fake oneDNN op (unit test only): records that it was called, then computes x @ w.T."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, w, *_):
        self.calls += 1
        return x @ w.T


def test_only_float32_cpu_outside_autocast_takes_the_path(monkeypatch):
    fake = FakeOp()
    monkeypatch.setattr(lin, "_OP", fake)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    lin.linear(x, w)
    assert fake.calls == 1
    lin.linear(x.double(), w.double())
    lin.linear(x.bfloat16(), w.bfloat16())
    lin.linear(x, w, torch.zeros(6))  # a bias: F.linear
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin.linear(x, w)
    assert y.dtype == torch.bfloat16 and fake.calls == 1
    monkeypatch.setattr(lin, "_OP", None)  # the aten backend
    lin.linear(x, w)
    assert fake.calls == 1


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown linear backend"):
        lin.set_backend("mkl")


@needs_onednn
@pytest.mark.parametrize("pack", [None, 4])
def test_engine_products_match_and_follow_weight_updates(onednn, pack):
    """An engine's products (`prepare_inference`: fused q/k/v and gate/up, packed weights): the
    same logits as the plain model, new logits after in-place weight updates (no stale copy), and
    no part in a forward under autograd (the parameters get their gradients)."""
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = LlamaModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        plain = model(ids)
        n = lin.prepare_inference(model, pack=pack)
        assert n["fused"] == 2 * cfg.num_hidden_layers
        assert n["packed"] == (0 if pack is None else 7 * cfg.num_hidden_layers + 1)
        _close(model(ids), plain)
        calls = []
        real = lin._product
        lin._product = lambda x, w: calls.append((tuple(w.shape), w.is_mkldnn)) or real(x, w)
        try:
            model(ids)
        finally:
            lin._product = real
        qkv = (cfg.hidden_size + 2 * cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)
        assert sum(s == qkv for s, _ in calls) == cfg.num_hidden_layers  # one product for q, k and v, not three
        assert sum(s == (2 * cfg.intermediate_size, cfg.hidden_size) for s, _ in calls) == cfg.num_hidden_layers
        assert len(calls) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate-up, down; the head
        if pack:
            assert all(packed for _, packed in calls), calls
        model.layers[0].self_attn.k_proj.weight.mul_(3.0)
        model.layers[1].mlp.up_proj.weight.copy_(torch.randn_like(model.layers[1].mlp.up_proj.weight))
        model.layers[1].self_attn.o_proj.weight.mul_(-1.0)
        updated = model(ids)
        lin.prepare_inference(model, fuse=False)
        _close(updated, model(ids))
        assert (updated - plain).abs().max() > 1e-3
    lin.prepare_inference(model, pack=pack)
    model(ids).sum().backward()
    for p in (model.layers[0].self_attn.q_proj.weight, model.layers[0].mlp.gate_proj.weight,
              model.layers[0].self_attn.o_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


@needs_onednn
def test_decode_sized_products_run_on_the_decode_kernel_and_see_weight_updates(onednn):
    """With `decode`, products of at most 8 rows (a decode step) go to `kernels/decode_products.py`
    (fused q/k/v and gate/up in one call, no copy): the same logits as the plain model, and new
    logits at once after an in-place weight update; a larger batch stays on oneDNN."""
    from opencomposer.kernels import decode_products as dp

    if dp.load() is None:
        pytest.skip(dp.unavailable() or "kernel unavailable")
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = LlamaModel(cfg).eval()
    small, large = torch.randint(0, cfg.vocab_size, (2, 3)), torch.randint(0, cfg.vocab_size, (2, 9))
    calls = []
    real = dp.products
    dp.products = lambda x, ws: calls.append((x.numel() // x.shape[-1], len(ws))) or real(x, ws)
    try:
        with torch.no_grad():
            plain_small, plain_large = model(small), model(large)
            n = lin.prepare_inference(model, pack=8, decode=True)
            assert n["decode"] == 7 * cfg.num_hidden_layers + 1
            assert n["packed"] == 0  # packed for 8 rows, the copy would serve only prefill: skipped
            assert lin.prepare_inference(model, pack=32, decode=True)["packed"] == 7 * cfg.num_hidden_layers + 1
            calls.clear()
            _close(model(small), plain_small)
            assert len(calls) == 4 * cfg.num_hidden_layers + 1 and all(rows == 6 for rows, _ in calls)
            assert sum(k == 3 for _, k in calls) == cfg.num_hidden_layers  # q, k and v in one call
            _close(model(large), plain_large)  # 18 rows: oneDNN's packed product (the kernel declines)
            model.layers[0].mlp.down_proj.weight.mul_(-2.0)
            updated = model(small)
            lin.prepare_inference(model, fuse=False)
            _close(updated, model(small))
            assert (updated - plain_small).abs().max() > 1e-3
    finally:
        dp.products = real
