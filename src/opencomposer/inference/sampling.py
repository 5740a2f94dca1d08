"""Sampling parameters and the per-row sampler.

The log-probability reported for a sampled token is log softmax(logits / temperature) at that token
— before top-k/top-p truncation — because that is what the trainer recomputes
(`model.loss.token_logprobs(..., temperature)`) for importance ratios (report §4). With temperature
0 (greedy) it is the plain log softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opencomposer.kernels import logit_stats


class SamplingError(ValueError):
    """Invalid sampling parameters (the server answers 400)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0

    def validate(self) -> "SamplingParams":
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise SamplingError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if len(self.stop) > 8:
            raise SamplingError("at most 8 stop strings")
        return self


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: softmax(logits / T) after top-k and top-p, or a
    one-hot argmax at temperature 0. Speculative decoding compares these for target and draft."""
    logits = logits.float()
    if params.temperature == 0:
        return torch.zeros_like(logits).scatter_(0, logits.argmax().view(1), 1.0)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.numel():
        kth = probs.topk(params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        cum = sp.cumsum(0)
        sp[cum - sp > params.top_p * cum[-1]] = 0.0  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return probs / probs.sum()


def token_info(logits: torch.Tensor, params: SamplingParams, tok: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `tok`, top alternatives) as reported to clients and the trainer."""
    t = params.temperature
    x = (logits.float() / (t if t > 0 else 1.0))[None]
    st = logit_stats.stats(x)
    return float(logit_stats.logprobs(x, st, torch.tensor([[tok]]))[0, 0]), _top(x[0], st, 0, params.top_logprobs)


def _top(x: torch.Tensor, st, row: int, k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens of row x (its logits over the temperature) and their log-probabilities,
    from `logit_stats.stats`' row `row`: log_softmax is monotonic, so the largest logits are the ones."""
    if not k:
        return []
    v, i = x.topk(k)
    return list(zip(i.tolist(), ((v - st[0][row]) - st[2][row]).tolist()))


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One index distributed as `probs`, by inverting the CDF with one uniform draw: rows with top-k
    or top-p, and speculative decoding's residuals (plain rows draw in `sample_rows`). (torch.multinomial
    draws an exponential per vocabulary entry: 1.9 ms for 49k entries here, against 0.07 ms for a
    cumsum and a binary search — at batch 32 that was 60 ms of every decode step.)"""
    if float(probs.max()) >= 1.0:
        return int(probs.argmax())
    cdf = probs.cumsum(0)
    u = (1.0 - torch.rand((), generator=gen, dtype=cdf.dtype)) * cdf[-1]  # in (0, total]: never a zero-mass entry
    return min(int(torch.searchsorted(cdf, u.view(1))), probs.numel() - 1)


def _plain(params: SamplingParams, v: int) -> bool:
    """No top-k or top-p truncation: the row samples softmax(logits / temperature) as it is."""
    return not (params.top_k and params.top_k < v) and params.top_p >= 1.0


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
           ) -> tuple[int, float, list[tuple[int, float]]]:
    """One token from a (V,) row: (token, its log-probability, top alternatives). A row without top-k
    or top-p is `sample_rows`' (the same token and draw as in any batch); one with them is drawn
    from `distribution` by `draw`."""
    if _plain(params, logits.shape[-1]):
        return sample_rows(logits[None], [params], [gen])[0]
    tok = draw(distribution(logits, params), gen)
    lp, top = token_info(logits, params, tok)
    return tok, lp, top


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None],
                ) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """`sample` for every row of (B, V) logits, the rows without top-k/top-p in one batched pass
    (the same distribution, the same log-probabilities and the same draws from each row's
    generator as `sample` row by row): the log-probabilities and greedy tokens from two passes over
    the (B, V) logits, and a drawing row's token from a walk along its running sum, which stops where
    the draw lands (`kernels/logit_stats.py`). On a quiet machine batching rows was within the noise
    of decode tokens/s at batch 1 and 8; the kernels' effect is in docs/inference.md."""
    v = logits.shape[-1]
    out: list = [None] * len(params)
    plain = [i for i, p in enumerate(params) if _plain(p, v)]
    for i in sorted(set(range(len(params))) - set(plain)):
        out[i] = sample(logits[i], params[i], gens[i])
    if not plain:
        return out
    x = logits[plain].float() if len(plain) < len(params) else logits.float()
    temps = [params[i].temperature or 1.0 for i in plain]
    # x / 1.0 is x, bit for bit: at temperature 0 or 1 (greedy evals, RL rollouts) no pass divides.
    scaled = x if all(t == 1.0 for t in temps) else x / torch.tensor(temps, dtype=x.dtype)[:, None]
    # the max, its first index and the log of the softmax's sum, for every row in two passes
    # (`kernels/logit_stats.py`): no (rows, V) of log-probabilities is written (`log_softmax` did), and a
    # greedy row's token is its first index of the max (its temperature counts as 1: `scaled` is its logits)
    st = logit_stats.stats(scaled)
    hot = [j for j, i in enumerate(plain) if params[i].temperature > 0]
    cold = sorted(set(range(len(plain))) - set(hot))
    toks = torch.empty(len(plain), dtype=torch.long)
    if cold:
        toks[cold] = st[1] if len(cold) == len(plain) else st[1][cold]
    if hot:
        # a row whose max has probability 1 in float32 (1 / sum rounds to 1: the rest of its mass is tiny)
        # takes its argmax and draws nothing, as `draw` does; the others draw by one uniform from
        # their generator, walked along the running sum of exp(x - max) (`logit_stats.draw`)
        hot_t = torch.tensor(hot)
        keep = (torch.exp(-st[2][hot_t]) < 1.0).tolist()
        draw_rows = [hot[r] for r, k in enumerate(keep) if k]
        one_hot = [hot[r] for r, k in enumerate(keep) if not k]
        if one_hot:
            toks[one_hot] = st[1][one_hot]
        if draw_rows:
            u = torch.stack([1.0 - torch.rand((), generator=gens[plain[j]]) for j in draw_rows])  # in (0, 1]
            if len(draw_rows) == len(plain):
                toks[draw_rows] = logit_stats.draw(scaled, st, u)
            else:
                d = torch.tensor(draw_rows)
                toks[draw_rows] = logit_stats.draw(scaled[d], tuple(t[d] for t in st), u)
    picked = logit_stats.logprobs(scaled, st, toks[:, None])[:, 0].tolist()
    for j, i in enumerate(plain):
        out[i] = (int(toks[j]), picked[j], _top(scaled[j], st, j, params[i].top_logprobs))
    return out


def speculative_accept(p: torch.Tensor, q: torch.Tensor, draft: int, gen: torch.Generator | None,
                       ) -> tuple[bool, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): keep the draft with
    probability min(1, p/q), else draw from the normalised residual max(0, p - q). The emitted
    token is distributed exactly as p. Returns (accepted, token)."""
    qd = float(q[draft])
    ratio = 1.0 if qd <= 0 else min(1.0, float(p[draft]) / qd)
    u = float(torch.rand((), generator=gen))
    if u < ratio:
        return True, draft
    residual = (p - q).clamp(min=0)
    total = float(residual.sum())
    return False, draw(residual / total if total > 0 else p, gen)
