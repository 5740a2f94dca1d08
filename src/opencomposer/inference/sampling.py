"""Sampling parameters and the per-row sampler.

The log-probability reported for a sampled token is log softmax(logits / temperature) at that token
— before top-k/top-p truncation — because that is what the trainer recomputes
(`model.loss.token_logprobs(..., temperature)`) for importance ratios (report §4). With temperature
0 (greedy) it is the plain log softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    logp = torch.log_softmax(logits.float() / (t if t > 0 else 1.0), dim=-1)
    top = []
    if params.top_logprobs:
        v, i = logp.topk(params.top_logprobs)
        top = list(zip(i.tolist(), v.tolist()))
    return float(logp[tok]), top


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One index distributed as `probs`, by inverting the CDF with one uniform draw. (torch.multinomial
    draws an exponential per vocabulary entry: 1.9 ms for 49k entries here, against 0.07 ms for a
    cumsum and a binary search — at batch 32 that was 60 ms of every decode step.)"""
    if float(probs.max()) >= 1.0:
        return int(probs.argmax())
    cdf = probs.cumsum(0)
    u = (1.0 - torch.rand((), generator=gen, dtype=cdf.dtype)) * cdf[-1]  # in (0, total]: never a zero-mass entry
    return min(int(torch.searchsorted(cdf, u.view(1))), probs.numel() - 1)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
           ) -> tuple[int, float, list[tuple[int, float]]]:
    """One token from a (V,) row: (token, its log-probability, top alternatives)."""
    tok = draw(distribution(logits, params), gen)
    lp, top = token_info(logits, params, tok)
    return tok, lp, top


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None],
                ) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """`sample` for every row of (B, V) logits, the rows without top-k/top-p in one batched pass
    (the same distribution, the same log-probabilities and the same draws from each row's
    generator as `sample` row by row): about eight passes over the (B, V) logits instead of about
    six small ones per row. On a quiet machine its effect on decode tokens/s was within the noise
    at batch 1 and 8 (docs/inference.md)."""
    v = logits.shape[-1]
    out: list = [None] * len(params)
    plain = [i for i, p in enumerate(params) if not (p.top_k and p.top_k < v) and p.top_p >= 1.0]
    for i in sorted(set(range(len(params))) - set(plain)):
        out[i] = sample(logits[i], params[i], gens[i])
    if not plain:
        return out
    x = logits[plain].float() if len(plain) < len(params) else logits.float()
    temps = [params[i].temperature or 1.0 for i in plain]
    # x / 1.0 is x, bit for bit: at temperature 0 or 1 (greedy evals, RL rollouts) no pass divides.
    # Below, a pass over (rows, V) runs only for the rows that need it (the argmax of the greedy rows
    # and of the one-hot ones), and nothing used whole is copied first: the same tokens, logprobs and
    # draws as before, and at temperature 1 on SmolLM2's 49,152 logits 2.7 -> 1.05 ms a step at 8
    # rows and 10.5 -> 3.8 at 32 on the AMD EPYC (Zen 4); the engine's decode 1.06x / 1.04x there
    # (docs/inference.md).
    scaled = x if all(t == 1.0 for t in temps) else x / torch.tensor(temps, dtype=x.dtype)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    hot = [j for j, i in enumerate(plain) if params[i].temperature > 0]
    cold = sorted(set(range(len(plain))) - set(hot))
    toks = torch.empty(len(plain), dtype=torch.long)
    if cold:
        toks[cold] = (x if len(cold) == len(plain) else x[cold]).argmax(-1)
    if hot:
        probs = torch.softmax(scaled if len(hot) == len(plain) else scaled[hot], dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        keep = (probs.max(-1).values < 1.0).tolist()
        draw_rows = [r for r, m in enumerate(keep) if m]
        one_hot = [r for r, m in enumerate(keep) if not m]
        probs_tok = torch.empty(len(hot), dtype=torch.long)
        if one_hot:  # a one-hot row takes its argmax and draws nothing, as `draw` does
            probs_tok[one_hot] = probs[one_hot].argmax(-1)
        if draw_rows:
            cdf = (probs if len(draw_rows) == len(hot) else probs[draw_rows]).cumsum(-1)
            u = torch.stack([1.0 - torch.rand((), generator=gens[plain[hot[r]]], dtype=cdf.dtype)
                             for r in draw_rows])[:, None] * cdf[:, -1:]
            probs_tok[draw_rows] = torch.searchsorted(cdf, u).clamp(max=v - 1)[:, 0]
        toks[hot] = probs_tok
    picked = logp.gather(1, toks[:, None])[:, 0].tolist()
    for j, i in enumerate(plain):
        top = []
        if params[i].top_logprobs:
            tv, ti = logp[j].topk(params[i].top_logprobs)
            top = list(zip(ti.tolist(), tv.tolist()))
        out[i] = (int(toks[j]), picked[j], top)
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
