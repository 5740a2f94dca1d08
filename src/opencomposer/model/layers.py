"""Layers both model families share: RMSNorm, rotary embeddings (both layouts), the SwiGLU MLP,
and the forward result type. Numerics follow the Hugging Face implementations op for op (norms in
float32, RoPE tables in float32 then cast), because logit parity with `transformers` is tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from opencomposer.model.linear import FusedProducts, Linear


@dataclass
class ForwardOut:
    """What `model.run(...)` returns. `routed_experts` is (B, T, n_moe_layers, top_k) — the expert
    indices each token used at each MoE layer, what the sampler returns and the trainer replays
    (report §6.2, router replay). `mtp_logits[d]` is (B, T-1-d, V): position i predicts token
    i+2+d (depth d+1 of Multi-Token Prediction)."""
    logits: torch.Tensor | None
    hidden: torch.Tensor
    routed_experts: torch.Tensor | None = None
    router: list = field(default_factory=list)
    mtp_logits: list[torch.Tensor] = field(default_factory=list)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused op computes exactly the steps below in float32 (bit-identical here), as one
            # call instead of seven, 61 times in a decode step of SmolLM2
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(dim: int, theta: float, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (..., T, dim) for integer positions (..., T), in the `cat(freqs, freqs)` layout."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    ang = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Rotary:
    """Rotate-half RoPE (the Hugging Face layout) with its tables prepared once per forward, for
    every layer: cos and sin broadcast over heads (B, 1, T, D), sin's first half negated, so that
    x * cos + rotate_half(x) * sin = x * cos + roll(x, D/2) * sin'. The result is bit-identical to
    the `cat(-x2, x1)` form (negation is exact), in four calls instead of nine per tensor."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        half = cos.shape[-1] // 2
        self.cos = cos[:, None]
        self.sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, H, T, D)."""
        return x * self.cos + x.roll(x.shape[-1] // 2, -1) * self.sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout). x: (B, H, T, D); cos/sin: (B, T, D)."""
    return Rotary(cos, sin)(x)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3)… — DeepSeek's checkpoint layout. The result is
    written de-interleaved (evens then odds); queries and keys get the same permutation, so their
    dot products are unchanged."""
    c, s = cos[..., : cos.shape[-1] // 2][:, None], sin[..., : sin.shape[-1] // 2][:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Gate and up run as one product in an engine's model
    (`linear.prepare_inference`)."""

    FUSE = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.fused: FusedProducts | None = None

    def forward(self, x):
        gu = self.fused(x) if self.fused is not None else None
        gate, up = gu or (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)


class CausalLM(nn.Module):
    """What both model families share around their `run`: where positions and masks come from,
    the head, `forward`, and bookkeeping. Subclasses define `embed_tokens`, `lm_head`, `config`
    and `run`."""

    @staticmethod
    def _block(layer: nn.Module, checkpoint: bool, *args):
        """One block's forward; with `checkpoint` (and gradients on), activation checkpointing:
        only the block's input is kept and its activations are recomputed in the backward, so a
        training forward's memory no longer grows with every intermediate of every layer (about
        1.5 MB per token on SmolLM2-135M without it) at the price of one more forward. The recompute
        must see what the first forward saw: a block has no side effects other than a cache's
        `write`, which returns the same tensors again (`model.prefix_kv.PrefixKV` makes sure of it)."""
        if checkpoint and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint as recompute

            return recompute(layer, *args, use_reentrant=False)
        return layer(*args)

    @staticmethod
    def _positions(input_ids: torch.Tensor, cache, rows, segments):
        """(positions (B, T), attention mask or None, cache rows or None) for a forward: packed
        documents restart positions and close attention across documents; a cache continues each
        row from its own length."""
        from opencomposer.model.cache import segment_positions_and_mask

        b, t = input_ids.shape
        if cache is None and segments is not None:
            return segment_positions_and_mask(segments)
        if cache is None:
            return torch.arange(t)[None].expand(b, t), None, None
        r = cache.rows_tensor(rows)
        return cache.positions(r, t), cache.mask(r, t), r

    def _head(self, h: torch.Tensor, which: bool | str) -> torch.Tensor | None:
        """Logits for every position (True), only the last ("last": what sampling needs), or none."""
        if which == "last":
            return self.lm_head(h[:, -1:])
        return self.lm_head(h) if which else None

    def forward(self, input_ids: torch.Tensor, **options):
        """Logits; with any `run` option, the full ForwardOut. Training calls the model (not
        `run`) so that module hooks — FSDP2's all-gathers — fire."""
        return self.run(input_ids, **options) if options else self.run(input_ids).logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def optional_hf_keys(self) -> set[str]:
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()
