"""The dense Llama-style family: GQA attention with RoPE, SwiGLU MLP, RMSNorm, optional tied
embeddings. It loads and writes Hugging Face `LlamaForCausalLM` folders (config.json +
safetensors), so SmolLM2, Llama and similar checkpoints work, and `transformers` loads what we
write. One implementation serves training and (later) our inference engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from opencomposer.kernels import decode_layer
from opencomposer.model.cache import KVCache, attend
from opencomposer.model.errors import ModelLoadError
from opencomposer.model.linear import FusedProducts, Linear
from opencomposer.model.layers import MLP, CausalLM, ForwardOut, RMSNorm, Rotary, init_weights, rope_tables


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
    def from_hf(cls, d: dict) -> LlamaConfig:
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


class Attention(nn.Module):
    FUSE = ("q_proj", "k_proj", "v_proj")  # one product in an engine's model (`linear.prepare_inference`)

    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = Linear(cfg.num_attention_heads * hd, d, bias=False)
        self.fused: FusedProducts | None = None

    def forward(self, x, rope: Rotary, cache: KVCache | None, rows, mask):
        b, t, _ = x.shape
        hq, hk, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        qkv = self.fused.product(x) if self.fused is not None else None
        if qkv is not None:
            # queries and keys are adjacent in the fused product: one rotation for both
            heads = qkv.view(b, t, hq + 2 * hk, hd).transpose(1, 2)
            qk = rope(heads[:, :hq + hk])
            q, k, v = qk[:, :hq], qk[:, hq:], heads[:, hq + hk:]
        else:
            q = rope(self.q_proj(x).view(b, t, hq, hd).transpose(1, 2))
            k = rope(self.k_proj(x).view(b, t, hk, hd).transpose(1, 2))
            v = self.v_proj(x).view(b, t, hk, hd).transpose(1, 2)
        if cache is not None and t == 1 and not torch.is_grad_enabled():
            out = cache.decode_attend(self.layer, rows, q, k, v)
        else:
            if cache is not None:
                k, v = cache.write(self.layer, rows, k, v)
            out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, cache, rows, mask):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, rows, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(CausalLM):
    fused_decode = False  # decode steps on `kernels/decode_layer` (set by `linear.prepare_inference`)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        init_weights(self)

    def new_cache(self, slots: int, max_len: int | None = None) -> KVCache:
        return KVCache(len(self.layers), slots, max_len or self.config.max_position_embeddings)

    def run(self, input_ids: torch.Tensor, *, cache: KVCache | None = None, rows=None, logits: bool | str = True,
            segments: torch.Tensor | None = None, checkpoint: bool = False, **_) -> ForwardOut:
        """The full forward. With a cache, `rows` are the cache slots of the batch rows (default:
        all slots) and each row continues from its own length. `checkpoint`: activation
        checkpointing per block in a training forward (`CausalLM._block`)."""
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids)
        pos, mask, r = self._positions(input_ids, cache, rows, segments)
        fused = self.fused_decode and cache is not None and decode_layer.applies(x, self.config.head_dim)
        ws = self._decode_weights() if fused else None
        if ws is not None:
            x = self._decode_fused(x, pos, cache, r, ws)
        else:
            rope = Rotary(*rope_tables(self.config.head_dim, self.config.rope_theta, pos, x.dtype))
            for layer in self.layers:
                x = self._block(layer, checkpoint, x, rope, cache, r, mask)
        if cache is not None:
            cache.advance(r, t)
        h = self.norm(x)
        return ForwardOut(logits=self._head(h, logits), hidden=h)

    _DECODE_PATHS = (("input_layernorm",), ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                     ("self_attn", "o_proj"), ("post_attention_layernorm",), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                     ("mlp", "down_proj"))

    def _decode_weights(self) -> list[list[torch.Tensor]] | None:
        """Each layer's weights in the fused op's order, or None where one is not a contiguous
        float32 tensor (the op reads them as such; the eager layers take any).

        The lists are kept between steps with every link they were reached by (each submodule in its
        parent's `_modules`, each weight in its module's `_parameters`) and used again only while all
        of those are the same objects: a weight or module replaced gets new lists. Checking those links
        with dict lookups took a 32-row decode step's Python here from ~0.9 ms to ~0.1 (gathering them
        through `nn.Module.__getattr__`, ~600 calls a step). dtype and layout are checked every step:
        `param.data = t` keeps the object and may change them."""
        kept = self.__dict__.get("_decode_kept")  # (layer count, links, lists)
        if kept is None or kept[0] != len(self.layers._modules) or not all(d.get(k) is v for d, k, v in kept[1]):
            links, out = [(self._modules, "layers", self.layers)], []
            for key, blk in self.layers._modules.items():
                links.append((self.layers._modules, key, blk))
                ws = []
                for path in self._DECODE_PATHS:
                    mod = blk
                    for name in path:
                        links.append((mod._modules, name, mod._modules.get(name)))
                        mod = mod._modules.get(name)
                    links.append((mod._parameters, "weight", mod._parameters.get("weight")))
                    ws.append(mod._parameters.get("weight"))
                out.append(ws)
            kept = self.__dict__["_decode_kept"] = (len(self.layers._modules), links, out)
        if not all(w is not None and w.dtype == torch.float32 and w.is_contiguous() for ws in kept[2] for w in ws):
            return None
        return kept[2]

    def _decode_fused(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, rows: torch.Tensor,
                      weights: list[list[torch.Tensor]]) -> torch.Tensor:
        """The layers of a decode step, one C++ call each (`kernels/decode_layer.py`), in place on x."""
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, pos, x.dtype)
        half = cfg.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate-half's sign, as `Rotary`
        rows = rows.contiguous()
        starts, src, prefix = cache.decode_rows(rows, cfg.num_key_value_heads, cfg.head_dim, x.dtype)
        h = x.view(x.shape[0], x.shape[2])
        op = decode_layer.op()
        for i, ws in enumerate(weights):
            ks, vs = cache.storage(i)
            op(h, ws, ks, vs, rows, starts, src, prefix, cos, sin, cfg.rms_norm_eps, cfg.num_attention_heads,
               cfg.num_key_value_heads)
        return x

    # Hugging Face names: everything but the head lives under "model.".
    def to_hf_state(self) -> dict[str, torch.Tensor]:
        state = {("model." + k if not k.startswith("lm_head") else k): v.detach().contiguous()
                 for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def hf_target(self, name: str, state: dict | None = None) -> torch.Tensor | None:
        """The tensor a Hugging Face tensor name loads into (None: not ours)."""
        return (state if state is not None else self.state_dict()).get(name.removeprefix("model."))
