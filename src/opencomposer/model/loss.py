"""Language-model losses computed from hidden states without materialising the logits.

The head is the largest matrix product of a small model and its logits the largest activation
(SmolLM2: 49,152 vocabulary entries per token). Both functions below walk the tokens in chunks:
each chunk's logits live only inside the loop, in float32. `cross_entropy` (mean over labelled
tokens: pretraining, SFT) computes the gradients during the forward, so the backward is a scale;
`token_logprobs` (per-token log-probabilities with any upstream gradient: RL) recomputes each
chunk's logits in the backward.
"""

from __future__ import annotations

import torch

from opencomposer.model.linear import times_t

IGNORE = -100


def _chunks(n: int, vocab: int, budget: int = 1 << 25):
    """Row ranges whose float32 logits stay under `budget` elements (128 MiB)."""
    step = max(1, budget // max(1, vocab))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _softmax_logp(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax over the last dim, log-probability of each target). torch's fused softmax kernel is
    several times faster than logsumexp or log_softmax + exp on CPU (their exp slows down on the
    subnormal results of far-below-max logits); log p is read from the probabilities, and rows
    whose target probability underflows are recomputed exactly."""
    p = torch.softmax(logits, dim=-1)
    pt = p.gather(1, targets[:, None])[:, 0]
    logp = pt.clamp_min(1e-30).log()
    low = pt < 1e-30
    if bool(low.any()):
        rows = logits[low]
        logp[low] = rows.gather(1, targets[low][:, None])[:, 0] - rows.logsumexp(-1)
    return p, logp


def _fp32(fn):
    """Run a chunked loss in float32 even under autocast (its precision is the point)."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kw):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kw)
    return wrapped


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    @_fp32
    def forward(ctx, h, w, labels):
        valid = labels != IGNORE
        count = int(valid.sum())
        gh = torch.zeros_like(h, dtype=torch.float32)
        gw = torch.zeros_like(w, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32)
        wf = w.float()
        # Only labelled rows go through the head: SFT labels the assistant's tokens alone (a few
        # hundred of a ~2,000-token agent conversation), and the head's three products over every
        # row were about a fifth of an SFT step's work. The other rows' gradient is zero.
        rows = valid.nonzero().squeeze(1)
        hv, lv = h.index_select(0, rows), labels.index_select(0, rows)
        for a, b in _chunks(count, w.shape[0]):
            hc, lab = hv[a:b].float(), lv[a:b]
            g, logp = _softmax_logp(times_t(hc, wf), lab)
            total -= logp.sum()
            g[torch.arange(b - a), lab] -= 1.0  # d loss / d logits = softmax - onehot
            g /= count
            gh[rows[a:b]] = times_t(g, wf.T)  # g @ wf
            gw += times_t(g.T, hc.T)  # g.T @ hc
        ctx.save_for_backward(gh.to(h.dtype), gw.to(w.dtype))
        return total / max(count, 1)

    @staticmethod
    @_fp32
    def backward(ctx, grad):
        gh, gw = ctx.saved_tensors
        return gh * grad, gw * grad, None


def cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `labels` (IGNORE = -100 skipped) under logits h @ weight.T.
    h (..., D), labels (...)."""
    return _FusedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    @_fp32
    def forward(ctx, h, w, targets, temperature):
        out = torch.empty(h.shape[0], dtype=torch.float32)
        wf = w.float()
        for a, b in _chunks(h.shape[0], w.shape[0]):
            out[a:b] = _softmax_logp(times_t(h[a:b].float(), wf) / temperature, targets[a:b])[1]
        ctx.save_for_backward(h, w, targets)
        ctx.temperature = temperature
        return out

    @staticmethod
    @_fp32
    def backward(ctx, grad):
        h, w, targets = ctx.saved_tensors
        t = ctx.temperature
        wf = w.float()
        gh = torch.empty_like(h, dtype=torch.float32)
        gw = torch.zeros_like(w, dtype=torch.float32)
        for a, b in _chunks(h.shape[0], w.shape[0]):
            hc = h[a:b].float()
            g = torch.softmax(times_t(hc, wf) / t, dim=-1).neg_()  # d logp / d logits = onehot - softmax
            g[torch.arange(b - a), targets[a:b]] += 1.0
            g *= grad[a:b, None] / t
            gh[a:b] = times_t(g, wf.T)
            gw += times_t(g.T, hc.T)
        return gh.to(h.dtype), gw.to(w.dtype), None, None


def token_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   ) -> torch.Tensor:
    """log p(target) per position under softmax(h @ weight.T / temperature); shape of `targets`."""
    out = _TokenLogprobs.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), float(temperature))
    return out.view(targets.shape)


def causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy of a model from `model/` (labels default to the inputs; position t
    predicts label t+1, as in `transformers`). With packed documents (`segments`), attention stays
    within each document and the prediction across a boundary is not trained."""
    targets = (input_ids if labels is None else labels)[:, 1:]
    if segments is not None:
        targets = targets.masked_fill(segments[:, 1:] != segments[:, :-1], IGNORE)
    h = model(input_ids, logits=False, segments=segments).hidden  # via __call__: module hooks fire
    return cross_entropy(h[:, :-1], model.lm_head.weight, targets)
