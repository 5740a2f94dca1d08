"""The DeepSeek-V3 / Kimi-K2 family (report §1: Composer 2 is Kimi K2.5, a DeepSeek-V3-architecture
MoE, plus Multi-Token Prediction layers added for speculative decoding, report §3.1).

- MLA attention: queries through a low-rank bottleneck (q_lora_rank), keys and values from one
  compressed latent (kv_lora_rank) that is what the KV cache stores, plus a decoupled rotary key
  shared by all heads (qk_rope_head_dim).
- MoE layers after the first `first_k_dense_replace` dense ones (`model/moe.py`).
- MTP modules (DeepSeek-V3 §2.2): depth d combines the previous depth's hidden state with the
  embedding of the token d positions ahead, runs one more block, and predicts with the shared head.

Parameters carry Hugging Face `DeepseekV3ForCausalLM` names, except the routed experts, which are
stored fused and split per expert on save; MTP modules are saved as `model.layers.{L+d}` like the
DeepSeek-V3 release, which vLLM's MTP loader reads and `transformers` skips.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import nn

from opencomposer.model.cache import KVCache, attend
from opencomposer.model.errors import ModelLoadError
from opencomposer.model.layers import (
    MLP,
    CausalLM,
    ForwardOut,
    RMSNorm,
    apply_rope,
    apply_rope_interleaved,
    init_weights,
    rope_tables,
)
from opencomposer.model.linear import Linear
from opencomposer.model.moe import MoE


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepseekConfig:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    # ours (not in the Hugging Face config): the expert backend and the router-replay threshold
    moe_backend: str = "torch"
    replay_plausibility: float = 0.5

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    def __post_init__(self):
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in 1..n_group ({self.n_group})")
        if self.num_experts_per_tok > self.n_routed_experts // self.n_group * self.topk_group:
            raise ValueError("num_experts_per_tok exceeds the experts reachable in topk_group groups")

    @classmethod
    def from_hf(cls, d: dict) -> DeepseekConfig:
        if d.get("quantization_config"):
            raise ModelLoadError(f"quantized checkpoints ({d['quantization_config'].get('quant_method')}) are not "
                                 "supported: dequantize to bf16/fp32 first")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ModelLoadError(f"rope scaling {rope} is not supported yet")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
            kw["num_nextn_predict_layers"] = d["num_mtp_layers"]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        try:
            return cls(**kw)
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"invalid DeepSeek-V3 config: {e}") from None

    def to_hf(self) -> dict:
        d = asdict(self)
        for ours in ("moe_backend", "replay_plausibility"):
            d.pop(ours)
        d.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_act="silu",
                 num_key_value_heads=self.num_attention_heads, attention_bias=False, topk_method="noaux_tc",
                 scoring_func="sigmoid", num_mtp_layers=self.num_nextn_predict_layers,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta}, torch_dtype="float32")
        return d

    def num_parameters(self, *, include_mtp: bool = True) -> int:
        """Analytic parameter count (checked against instantiated models and the published sizes)."""
        d, h = self.hidden_size, self.num_attention_heads
        q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim) \
            if self.q_lora_rank else d * h * self.qk_head_dim
        attn = q + d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * d
        dense = 3 * d * self.intermediate_size
        moe = self.n_routed_experts * 3 * d * self.moe_intermediate_size + self.n_routed_experts * d \
            + 3 * d * self.moe_intermediate_size * self.n_shared_experts
        norms = 2 * d
        k = self.first_k_dense_replace
        body = k * (attn + dense + norms) + self.num_moe_layers * (attn + moe + norms)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        total = self.vocab_size * d + body + d + head
        if include_mtp:
            ffn = moe if self.num_hidden_layers >= k else dense
            total += self.num_nextn_predict_layers * (attn + ffn + norms + 2 * d + 2 * d * d + d)
        return total


    def active_parameters(self) -> int:
        """Parameters used per token (the main model): all but the unchosen routed experts."""
        unused = (self.n_routed_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_parameters(include_mtp=False) - self.num_moe_layers * unused


# Presets from a few million parameters (tests) upward, and the real models' shapes.
PRESETS = {
    "tiny-moe": DeepseekConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                               n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
                               num_nextn_predict_layers=1),
    # the benchmark's small MoE: SmolLM2's vocabulary, 90M parameters (+10M MTP), 49M active per token
    "small-moe": DeepseekConfig(vocab_size=49152, hidden_size=384, intermediate_size=1024, moe_intermediate_size=256,
                                num_hidden_layers=6, num_attention_heads=6, n_routed_experts=32, num_experts_per_tok=4,
                                n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=192,
                                qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, max_position_embeddings=8192,
                                num_nextn_predict_layers=1),
    "deepseek-v3": DeepseekConfig(max_position_embeddings=163840, num_nextn_predict_layers=1),
    # Kimi K2 (what K2.5, Composer 2's base, shares): 384 experts, one group, one dense layer, 64 heads
    "kimi-k2": DeepseekConfig(vocab_size=163840, num_attention_heads=64, n_routed_experts=384, n_group=1,
                              topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827,
                              rope_theta=50000.0, max_position_embeddings=131072, bos_token_id=163584,
                              eos_token_id=163585),
}


class MLAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, h = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = Linear(d, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(h * cfg.v_head_dim, d, bias=False)
        self.scale = cfg.qk_head_dim ** -0.5

    def forward(self, x, cos, sin, cache: KVCache | None, rows, mask):
        cfg = self.cfg
        b, t, _ = x.shape
        h, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = q.view(b, t, h, cfg.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([dn, dr], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, dr], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (B, 1, t, r)
        k_rot = k_rot[:, None]                         # (B, 1, t, dr)
        rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        q_rot, k_rot = rope(q_rot, cos, sin), rope(k_rot, cos, sin)
        if cache is not None:  # the cache holds the compressed latent, not per-head keys and values
            latent, k_rot = cache.write(self.layer, rows, latent, k_rot)
        s = latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(b, s, h, dn + cfg.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([dn, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(b, h, s, dr)], dim=-1)
        out = attend(torch.cat([q_nope, q_rot], dim=-1), k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * cfg.v_head_dim))


class Block(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = layer >= cfg.first_k_dense_replace
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache, rows, mask, replayed=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, rows, mask)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), None, None
        out, idx, stats = self.mlp(h, replayed)
        return x + out, idx, stats


class MTPModule(nn.Module):
    """One Multi-Token Prediction depth (DeepSeek-V3 §2.2): h' = block(eh_proj([enorm(emb); hnorm(h)]))."""

    def __init__(self, cfg: DeepseekConfig, layer: int):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.block = Block(cfg, layer)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h, emb, cos, sin, cache=None, rows=None, mask=None):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        x, _, _ = self.block(x, cos, sin, cache, rows, mask)
        return x


class DeepseekModel(CausalLM):
    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.num_hidden_layers + i) for i in range(cfg.num_nextn_predict_layers))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        init_weights(self)
        for m in self.modules():
            if hasattr(m, "gate_up"):
                nn.init.normal_(m.gate_up, std=0.02)
                nn.init.normal_(m.down, std=0.02)
            if hasattr(m, "e_score_correction_bias"):
                nn.init.normal_(m.weight, std=0.02)

    def new_cache(self, slots: int, max_len: int | None = None) -> KVCache:
        """A cache for the main layers and the MTP layers (which speculative decoding runs)."""
        return KVCache(len(self.layers) + len(self.mtp), slots, max_len or self.config.max_position_embeddings)

    def _rope(self, pos, dtype):
        return rope_tables(self.config.qk_rope_head_dim, self.config.rope_theta, pos, dtype)

    def run(self, input_ids: torch.Tensor, *, cache: KVCache | None = None, rows=None,
            replay: torch.Tensor | None = None, mtp: bool = False, logits: bool | str = True,
            segments: torch.Tensor | None = None, checkpoint: bool = False) -> ForwardOut:
        """The full forward. `replay` (B, T, n_moe_layers, top_k) overrides the routing with the
        sampler's experts (router replay); `mtp=True` also returns the MTP heads' logits (no cache);
        `checkpoint`: activation checkpointing per block in a training forward (`CausalLM._block`)."""
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids)
        pos, mask, r = self._positions(input_ids, cache, rows, segments)
        if replay is not None and tuple(replay.shape[:3]) != (b, t, self.config.num_moe_layers):
            raise ValueError(f"replay has shape {tuple(replay.shape)}, expected ({b}, {t}, "
                             f"{self.config.num_moe_layers}, {self.config.num_experts_per_tok})")
        cos, sin = self._rope(pos, x.dtype)
        routed, stats = [], []
        for layer in self.layers:
            rep = replay[:, :, len(routed)] if (replay is not None and layer.is_moe) else None
            x, idx, st = self._block(layer, checkpoint, x, cos, sin, cache, r, mask, rep)
            if idx is not None:
                routed.append(idx)
                stats.append(st)
        if cache is not None:
            cache.advance(r, t)
        h = self.norm(x)
        out = ForwardOut(logits=self._head(h, logits), hidden=h, router=stats,
                         routed_experts=torch.stack(routed, dim=2) if routed else None)
        if mtp:
            out.mtp_logits = self.mtp_forward(h, input_ids, pos, mask)
        return out

    def mtp_forward(self, h: torch.Tensor, input_ids: torch.Tensor, pos: torch.Tensor,
                    mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time MTP over a whole sequence: depth d sees hidden states at positions
        0..T-2-d and the embeddings of the tokens at 1+d..T-1, and predicts tokens 2+d..T."""
        logits = []
        for d, module in enumerate(self.mtp):
            n = h.shape[1] - 1
            if n <= 0:
                break
            emb = self.embed_tokens(input_ids[:, 1 + d: 1 + d + n])
            cos, sin = self._rope(pos[:, :n], h.dtype)
            h = module(h[:, :n], emb, cos, sin, None, None, None if mask is None else mask[:, :, :n, :n])
            logits.append(self.lm_head(module.norm(h)))
        return logits

    def mtp_step(self, h: torch.Tensor, next_ids: torch.Tensor, cache: KVCache, rows) -> torch.Tensor:
        """Incremental depth-1 MTP for speculative decoding: main hidden states h (R, t, D) at the
        MTP cache's next positions and the tokens that followed them (R, t) -> logits (R, t, V)
        for the token after those. `cache` is the MTP's own cache (it runs one position behind
        the main model's)."""
        module = self.mtp[0]
        r = cache.rows_tensor(rows)
        t = next_ids.shape[1]
        pos, mask = cache.positions(r, t), cache.mask(r, t)
        cos, sin = self._rope(pos, h.dtype)
        x = module(h, self.embed_tokens(next_ids), cos, sin, cache, r, mask)
        cache.advance(r, t)
        return self.lm_head(module.norm(x))

    # -- Hugging Face names -------------------------------------------------------------------------
    _EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    _MTP = re.compile(r"model\.layers\.(\d+)\.(.*)")

    def _hf_names(self) -> dict[str, str]:
        """HF name -> our state-dict key, for everything but the routed experts (computed once)."""
        if "_hf_map" in self.__dict__:
            return self.__dict__["_hf_map"]
        names, L = {}, self.config.num_hidden_layers
        for key in self.state_dict():
            if ".experts." in key:
                continue
            if key.startswith("mtp."):
                _, i, rest = key.split(".", 2)
                rest = {"norm.weight": "shared_head.norm.weight"}.get(rest, rest.removeprefix("block."))
                names[f"model.layers.{L + int(i)}.{rest}"] = key
            elif key == "lm_head.weight":
                names[key] = key
            else:
                names["model." + key] = key
        self.__dict__["_hf_map"] = names
        return names

    def to_hf_state(self) -> dict[str, torch.Tensor]:
        sd = self.state_dict()
        state = {hf: sd[ours].detach() for hf, ours in self._hf_names().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        isz = self.config.moe_intermediate_size
        for i, layer in enumerate(list(self.layers) + [m.block for m in self.mtp]):
            if not layer.is_moe:
                continue
            ex = layer.mlp.experts
            for e in range(ex.gate_up.shape[0]):
                p = f"model.layers.{i}.mlp.experts.{e}."
                state[p + "gate_proj.weight"] = ex.gate_up.detach()[e, :isz]
                state[p + "up_proj.weight"] = ex.gate_up.detach()[e, isz:]
                state[p + "down_proj.weight"] = ex.down.detach()[e]
        # DeepSeek-V3's MTP layers carry their own copies of the embedding and head
        for d in range(len(self.mtp)):
            p = f"model.layers.{self.config.num_hidden_layers + d}."
            state[p + "embed_tokens.weight"] = self.embed_tokens.weight.detach()
            state[p + "shared_head.head.weight"] = self.lm_head.weight.detach()
        return state

    def hf_target(self, name: str, state: dict | None = None) -> torch.Tensor | None:
        """The tensor a Hugging Face tensor name loads into (None: not ours); `state` is this
        model's state_dict, passed by a loader that resolves many names."""
        m = self._EXPERTS.fullmatch(name)
        if m:
            i, e, which = int(m[1]), int(m[2]), m[3]
            blocks = list(self.layers) + [mod.block for mod in self.mtp]
            if i >= len(blocks) or not blocks[i].is_moe or e >= self.config.n_routed_experts:
                return None
            ex, isz = blocks[i].mlp.experts, self.config.moe_intermediate_size
            return {"gate": ex.gate_up.data[e, :isz], "up": ex.gate_up.data[e, isz:], "down": ex.down.data[e]}[which]
        m = self._MTP.fullmatch(name)
        if m and int(m[1]) >= self.config.num_hidden_layers and m[2] in ("embed_tokens.weight",
                                                                         "shared_head.head.weight"):
            if int(m[1]) - self.config.num_hidden_layers >= len(self.mtp):
                return None
            # copies of the shared embedding/head: loaded into a scratch tensor and ignored
            src = self.embed_tokens.weight if m[2] == "embed_tokens.weight" else self.lm_head.weight
            return torch.empty_like(src)
        key = self._hf_names().get(name)
        return None if key is None else (state if state is not None else self.state_dict())[key]



def preset(name: str, **overrides) -> DeepseekConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r} (have: {sorted(PRESETS)})")
    return replace(PRESETS[name], **overrides)
