"""Mixture of experts, DeepSeek-V3 / Kimi-K2 style (report §1): one shared expert plus routed
experts chosen by sigmoid scores with a load-balancing bias and group limits, and router replay
(report §6.2).

Routing for a token x (DeepSeek-V3 paper, eq. 15-17; `transformers`' DeepseekV3TopkRouter):
    s = sigmoid(W_r x)                       (float32)
    choose top-k of (s + b) within the top `topk_group` of `n_group` groups,
        a group's score being the sum of its two best (s + b)
    g_i = s_i / sum_{j in top-k} s_j  (when norm_topk_prob) * routed_scaling_factor
The bias b only steers selection; gates use the unbiased scores, so gradients reach W_r.

The experts run as one grouped computation: (token, slot) pairs are sorted by expert and three
grouped matrix products run over the contiguous groups — no Python loop over tokens. The products
go through `EXPERT_BACKENDS[config.moe_backend]`, the seam the low-precision kernels plug into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opencomposer.model.layers import MLP


class ReplayError(ValueError):
    pass


@dataclass
class RouterStats:
    """Per MoE layer and forward: expert load (tokens per expert) and, under replay, how often the
    replayed experts disagreed with the router's own choice and how many were replaced as
    implausible."""
    load: torch.Tensor
    mismatch: float | None = None
    replaced: int = 0

    @property
    def imbalance(self) -> float:
        """max load / mean load (1.0 is perfectly balanced)."""
        mean = self.load.float().mean()
        return float(self.load.max() / mean) if mean > 0 else 0.0


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (N, K) rows sorted by group, w (G, K, M), offsets (G,) int32 cumulative ends -> (N, M)."""
    if hasattr(F, "grouped_mm") and x.device.type in ("cpu", "cuda"):
        return F.grouped_mm(x, w, offs=offsets)
    out, start = [], 0  # older torch: a loop over experts (never over tokens)
    for g, end in enumerate(offsets.tolist()):
        out.append(x[start:end] @ w[g])
        start = end
    return torch.cat(out)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward rejects the
    stride-0 gradients that reductions like `.sum()` produce."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def torch_experts(x: torch.Tensor, token: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """The reference expert backend: SwiGLU over the rows `token` of x (sorted by expert) with
    grouped products. gate_up (E, 2I, D) and down (E, D, I) are in nn.Linear (out, in) layout."""
    h = grouped_mm(x[token], gate_up.transpose(1, 2), offsets)
    g, u = h.chunk(2, dim=-1)
    return _ContiguousGrad.apply(grouped_mm(F.silu(g) * u, down.transpose(1, 2), offsets))


def _low_precision() -> dict[str, Callable[..., torch.Tensor]]:
    from opencomposer.kernels.grouped_gemm import experts_backend

    # report §6.1: NVFP4 (per-token scales) forward + MXFP8 backward; all-MXFP8; DeepSeek-V3's
    # FP8 with 1x128 / 128x128 block scales; and bf16. Triton kernels on CUDA, emulation elsewhere.
    return {"nvfp4": experts_backend("nvfp4", "mxfp8"), "mxfp8": experts_backend("mxfp8", "mxfp8"),
            "fp8-block": experts_backend("fp8-block", "fp8-block"), "bf16": experts_backend("bf16", "bf16")}


# name -> fn(x (T, D), token (N,) rows of x sorted by expert, offsets (E,) int32 cumulative ends,
# gate_up (E, 2I, D), down (E, D, I)) -> (N, D). Passing x and the row index rather than the
# gathered copy lets a kernel fuse the gather into its quantiser. `moe_backend` selects one.
EXPERT_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"torch": torch_experts, **_low_precision()}


def use_backend(model: nn.Module, name: str) -> int:
    """Switch every routed-expert layer of a loaded model to backend `name` (how a training
    recipe picks `moe_backend`: it is ours, not part of the Hugging Face config). Returns how many
    layers changed."""
    if name not in EXPERT_BACKENDS:
        raise ValueError(f"moe_backend {name!r} is not registered (have: {sorted(EXPERT_BACKENDS)})")
    layers = [m for m in model.modules() if isinstance(m, Experts)]
    if not layers:
        raise ValueError(f"moe_backend {name!r} needs a mixture-of-experts model; {type(model).__name__} has none")
    for m in layers:
        m.backend = name
    if hasattr(getattr(model, "config", None), "moe_backend"):
        model.config = dataclasses.replace(model.config, moe_backend=name)  # the config stays truthful
    return len(layers)


class Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_experts = cfg.n_routed_experts
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.plausibility = cfg.replay_plausibility
        self.weight = nn.Parameter(torch.zeros(self.n_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts))

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The router's own top-k (N, k) by biased scores within the best groups."""
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1 and self.topk_group < self.n_group:
            per = choice.view(-1, self.n_group, self.n_experts // self.n_group)
            group_scores = per.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.n_experts // self.n_group, dim=1), float("-inf"))
        return choice.topk(self.top_k, dim=-1).indices

    def replay(self, scores: torch.Tensor, own: torch.Tensor, replayed: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Use the sampler's experts, except (a) entries of -1 (not recorded, e.g. a sequence's
        last token) and (b) experts whose score falls below `plausibility` times the lowest score
        among the router's own top-k: both are filled with the router's best candidates not
        already used (report §6.2; the threshold's form is ours, the report does not give it).
        Returns the experts and how many implausible ones were replaced."""
        recorded = replayed >= 0
        keep = recorded.clone()
        own_scores = scores.gather(1, own)
        if self.plausibility > 0:
            tau = self.plausibility * own_scores.min(dim=1, keepdim=True).values
            keep &= scores.gather(1, replayed.clamp(min=0)) >= tau
        if bool(keep.all()):
            return replayed, 0
        k = self.top_k
        # the router's candidates, best first, that are not already kept from the replay
        own_sorted = own.gather(1, own_scores.argsort(dim=1, descending=True))
        used = ((own_sorted[:, :, None] == replayed[:, None, :]) & keep[:, None, :]).any(-1)
        ar = torch.arange(k)[None]
        candidates = own_sorted.gather(1, torch.where(used, ar + k, ar).argsort(dim=1))
        slot = ((~keep).cumsum(dim=1) - 1).clamp(min=0)
        return torch.where(keep, replayed, candidates.gather(1, slot)), int((recorded & ~keep).sum())

    def forward(self, x: torch.Tensor, replayed: torch.Tensor | None = None):
        """x (N, D) -> (indices (N, k), gates (N, k) float32, stats)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        own = self.choose(scores)
        if replayed is None:
            idx, mismatch, replaced = own, None, 0
        else:
            if replayed.shape != own.shape:
                raise ReplayError(f"replayed experts have shape {tuple(replayed.shape)}, expected {tuple(own.shape)}")
            replayed = replayed.to(torch.long)
            if replayed.numel() and (int(replayed.min()) < -1 or int(replayed.max()) >= self.n_experts):
                raise ReplayError(f"replayed expert index outside 0..{self.n_experts - 1} (or -1: not recorded)")
            # mismatch: fraction of recorded (token, expert) pairs the router would not have chosen
            recorded = replayed >= 0
            agree = (replayed[:, :, None] == own[:, None, :]).any(-1)
            n = int(recorded.sum())
            mismatch = float(((~agree) & recorded).sum()) / n if n else 0.0
            idx, replaced = self.replay(scores, own, replayed)
        gates = scores.gather(1, idx)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        load = torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        return idx, gates * self.scaling, RouterStats(load=load, mismatch=mismatch, replaced=replaced)

    @torch.no_grad()
    def balance_(self, load: torch.Tensor, rate: float = 1e-3) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): raise the bias of under-loaded
        experts and lower it for over-loaded ones by `rate`."""
        self.e_score_correction_bias += rate * torch.sign(load.float().mean() - load.float())


class Experts(nn.Module):
    """Routed experts stored fused: gate_up (E, 2I, D), down (E, D, I)."""

    def __init__(self, cfg):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down = nn.Parameter(torch.empty(e, d, i))
        self.backend = cfg.moe_backend
        if self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"moe_backend {self.backend!r} is not registered (have: {sorted(EXPERT_BACKENDS)})")

    def forward(self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        offsets = torch.bincount(flat, minlength=self.gate_up.shape[0]).cumsum(0).to(torch.int32)
        y = EXPERT_BACKENDS[self.backend](x, token, offsets, self.gate_up, self.down)
        y = y * gates.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, replayed: torch.Tensor | None = None):
        """x (B, T, D); replayed (B, T, k) or None -> (out, indices (B, T, k), stats)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, gates, stats = self.gate(flat, None if replayed is None else replayed.reshape(-1, replayed.shape[-1]))
        out = self.experts(flat, idx, gates).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, idx.view(*shape[:-1], -1), stats
