"""The group's shared prompt computed once in the training forward equals G full forwards: the same
logprobs and the same gradient on every parameter, for the dense family and for the MoE family
with router replay, with and without activation checkpointing; and the prefix is never stretched
past what the sequences share."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.model.deepseek import DeepseekModel, preset  # noqa: E402
from opencomposer.model.llama import LlamaConfig, LlamaModel  # noqa: E402
from opencomposer.rl.forward import SharedPromptForward, sequence_logprobs, shared_prefix  # noqa: E402
from opencomposer.rl.sequences import RLSequence  # noqa: E402


def dense():
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def moe():
    torch.manual_seed(0)
    model = DeepseekModel(preset("tiny-moe"))
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def group(model, prompt_len=23, suffixes=(7, 12, 9), seed=1) -> list[RLSequence]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    seqs = []
    for n in suffixes:
        ids = prompt + torch.randint(0, vocab, (n,), generator=g).tolist()
        mask = [0] * prompt_len + [1] * n
        experts = None
        if isinstance(model, DeepseekModel):  # what the sampler would have routed, recorded per position
            with torch.no_grad():
                experts = model.eval().run(torch.tensor([ids]), logits=False).routed_experts[0, :-1].tolist()
        seqs.append(RLSequence(ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                               experts=experts, sampling={"temperature": 0.8}))
    return seqs


def run(model, seqs, shared: bool, checkpoint: bool = False):
    model.zero_grad(set_to_none=True)
    weights = [1.0, -0.5, 2.0]
    out = []
    sp = SharedPromptForward(model, seqs, shared_prefix(seqs), checkpoint=checkpoint) if shared else None
    for w, seq in zip(weights, seqs):
        logp = sp.logprobs(seq) if sp is not None else sequence_logprobs(model, seq, checkpoint=checkpoint)
        (w * logp).sum().backward()
        out.append(logp.detach())
    if sp is not None:
        sp.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", [dense, moe], ids=["dense", "moe-replay"])
def test_shared_prompt_equals_full_forwards(family):
    model = family()
    seqs = group(model)
    assert shared_prefix(seqs) == 22  # the prompt up to its last token, which predicts the first trained one
    full_lp, full_g = run(model, seqs, shared=False)
    lp, g = run(model, seqs, shared=True)
    for a, b in zip(full_lp, lp):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert full_g.keys() == g.keys() and len(g) > 5
    for name in full_g:
        torch.testing.assert_close(g[name], full_g[name], rtol=1e-4, atol=1e-6, msg=name)
    # the prompt's part of the gradient is there: an embedding row used only by the prompt moved
    prompt_only = set(seqs[0].ids[:22]) - {t for s in seqs for t in s.ids[22:]}
    row = next(iter(prompt_only))
    emb = next(k for k in g if "embed" in k)
    assert g[emb][row].abs().sum() > 0


class CountingBlocks:
    """Counts block forwards (each block's `forward` wrapped; torch's recompute does not fire
    forward hooks): checkpointing shows as forwards run again in the backward."""

    def __init__(self, model):
        self.calls = 0
        self.blocks = list(model.layers)
        for b in self.blocks:
            b.forward = self._counting(b.forward)

    def _counting(self, forward):
        def counted(*args, **kw):
            self.calls += 1
            return forward(*args, **kw)
        return counted

    def close(self):
        for b in self.blocks:
            del b.forward


@pytest.mark.parametrize("family", [dense, moe], ids=["dense", "moe-replay"])
@pytest.mark.parametrize("shared", [False, True], ids=["full", "shared-prompt"])
def test_activation_checkpointing_changes_no_number(family, shared):
    model = family()
    seqs = group(model)
    ref_lp, ref_g = run(model, seqs, shared=shared)
    counter = CountingBlocks(model)
    try:
        plain = counter.calls
        run(model, seqs, shared=shared, checkpoint=False)
        plain, counter.calls = counter.calls - plain, 0
        lp, g = run(model, seqs, shared=shared, checkpoint=True)
    finally:
        counter.close()
    assert counter.calls > plain  # the blocks really ran again in the backward
    for a, b in zip(ref_lp, lp):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert g.keys() == ref_g.keys()
    for name in ref_g:
        torch.testing.assert_close(g[name], ref_g[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_shared_prompt_checkpoints_only_forwards_from_the_threshold():
    model = dense()
    seqs = group(model, prompt_len=23, suffixes=(7, 12, 9))
    counter = CountingBlocks(model)
    try:
        sp = SharedPromptForward(model, seqs, shared_prefix(seqs), checkpoint=10)  # prefix 22: checkpointed
        after_prefix = counter.calls
        short, long_ = sp.logprobs(seqs[0]), sp.logprobs(seqs[1])  # suffixes of 8 and 13 tokens
        forwards = counter.calls
        short.sum().backward()
        assert counter.calls == forwards  # 8 < 10: its activations were kept
        long_.sum().backward()
        assert counter.calls == forwards + len(model.layers)  # 13 >= 10: recomputed
        sp.backward()
        assert counter.calls == forwards + 2 * len(model.layers)  # the prefix's blocks, recomputed once
        assert after_prefix == len(model.layers)
    finally:
        counter.close()


def test_the_prefix_stops_where_the_sequences_differ_or_route_differently():
    model = moe()
    seqs = group(model, prompt_len=10, suffixes=(5, 5))
    assert shared_prefix(seqs) == 9
    seqs[1].ids[4] = (seqs[1].ids[4] + 1) % model.config.vocab_size
    assert shared_prefix(seqs) == 4
    seqs = group(model, prompt_len=10, suffixes=(5, 5))
    seqs[1].experts[2] = [[(e + 1) % 8 for e in layer] for layer in seqs[1].experts[2]]
    assert shared_prefix(seqs) == 0  # sampled by another version: its prompt's experts differ
    assert shared_prefix(seqs[:1]) == 0


@pytest.mark.parametrize("kv_heads", [3, 9])
def test_suffix_attention_runs_on_the_fused_kernel_with_its_mask_and_equals_the_padded_causal_one(monkeypatch, kv_heads):
    """A suffix over a prefix attends through SDPA's fused CPU kernel with an explicit lower-right
    mask (not padded queries, which compute every padded row too): the same output and gradients."""
    from opencomposer.model import cache

    g = torch.Generator().manual_seed(0)
    t, s = 5, 13
    q, k, v = (torch.randn(1, h, n, 8, generator=g, requires_grad=True)
               for h, n in ((9, t), (kv_heads, s), (kv_heads, s)))
    explicit = torch.arange(s)[None] <= torch.arange(s - t, s)[:, None]
    assert cache._fused_with_mask(q, k, v, explicit, kv_heads != 9)  # the fast path is the one taken here

    def run():
        out = cache.attend(q, k, v, cache.LowerRightCausal(s - t))
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
        return out.detach(), grads

    masked = run()
    monkeypatch.setattr(cache, "_fused_with_mask", lambda *a: False)
    padded = run()
    torch.testing.assert_close(masked[0], padded[0], atol=1e-6, rtol=1e-5)
    for a, b in zip(masked[1], padded[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
