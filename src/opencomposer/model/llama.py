"""The dense Llama-style family: GQA attention with RoPE, SwiGLU MLP, RMSNorm, optional tied
embeddings. It loads and writes Hugging Face `LlamaForCausalLM` folders (config.json +
safetensors), so SmolLM2, Llama and similar checkpoints work, and `transformers` loads what we
write. One implementation serves training and (later) our inference engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class ModelLoadError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        if d.get("model_type", "llama") not in ("llama", "mistral") and "LlamaForCausalLM" not in d.get("architectures", []):
            raise ModelLoadError(f"not a Llama-family config (model_type {d.get('model_type')!r})")
        if d.get("rope_scaling"):
            raise ModelLoadError(f"rope_scaling {d['rope_scaling']} is not supported yet")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_hf(self) -> dict:
        d = asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
                 mlp_bias=False, torch_dtype="float32")
        return d


# Presets from a few million parameters (tests) upward.
PRESETS = {
    "tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "smollm2-135m": LlamaConfig(rope_theta=100000.0),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cache(cfg: LlamaConfig, positions: torch.Tensor, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim))
    ang = positions.to(torch.float32)[..., None] * inv  # (..., T, D/2)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout), x: (B, H, T, D)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)

    def forward(self, x, cos, sin, kv: tuple | None = None):
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None and kv[0] is not None:
            k = torch.cat([kv[0], k], dim=2)
            v = torch.cat([kv[1], v], dim=2)
        new_kv = (k, v)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        past = kk.shape[2] - t
        if past == 0:
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        else:  # queries at positions past..past+t-1 see keys up to their own position
            mask = torch.ones(t, kk.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), new_kv


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv=None):
        h, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new_kv


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        std = 0.02
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)

    def forward(self, input_ids: torch.Tensor, past: list | None = None, start_pos: int = 0):
        """Logits (B, T, V); with `past` (one (k, v) per layer or None) also the updated cache."""
        x = self.embed_tokens(input_ids)
        pos = torch.arange(start_pos, start_pos + input_ids.shape[1], device=input_ids.device)
        cos, sin = rope_cache(self.config, pos[None], x.device, x.dtype)
        new_past = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, past[i] if past is not None else None)
            new_past.append(kv)
        logits = self.lm_head(self.norm(x))
        return (logits, new_past) if past is not None else logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def load_hf(folder: str | Path, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A `LlamaForCausalLM` folder (config.json + *.safetensors) -> LlamaModel. Mismatched or
    missing tensors are errors that name the file and the tensor."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json")
    cfg = LlamaConfig.from_hf(json.loads(cfg_path.read_text()))
    model = LlamaModel(cfg)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    expected = {k: v for k, v in model.state_dict().items()}
    seen = set()
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelLoadError(f"{f}: unreadable safetensors ({e})") from None
        for name, t in tensors.items():
            key = name.removeprefix("model.")
            if key not in expected:
                raise ModelLoadError(f"{f}: unexpected tensor {name}")
            if tuple(t.shape) != tuple(expected[key].shape):
                raise ModelLoadError(f"{f}: {name} has shape {tuple(t.shape)}, config says {tuple(expected[key].shape)}")
            expected[key].copy_(t)
            seen.add(key)
    missing = set(expected) - seen - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise ModelLoadError(f"{folder}: missing tensors {sorted(missing)[:5]}")
    return model.to(dtype)


def save_hf(model: LlamaModel, folder: str | Path) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {("model." + k if not k.startswith("lm_head") else k): v.detach().contiguous()
             for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    return folder
