"""The engine's settings (`inference/engine.py`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    slots: int = 32
    """Concurrent sequences (KV-cache slots)."""
    max_len: int | None = None
    """Tokens per sequence, prompt included (default: the model's max_position_embeddings)."""
    detokenize_every: int = 1
    """Check stop strings every this many tokens."""
    prefill_tokens: int = 8192
    """Most prompt tokens prefilled in one step while nothing decodes (equal-length chunks are batched)."""
    prefill_chunk: int = 512
    """Most prompt tokens prefilled in one step while other sequences decode: a long prompt is spread
    over several steps instead of stalling the batch."""
    prefix_cache_mb: int = 1024
    """Memory for KV kept across requests (the prefix cache); 0 turns it off."""
    keep_stale_prefix: bool = False
    """Keep cached KV across a weight update (PipelineRL-style: the next requests reuse context computed
    by older weights, recorded per sequence as `prefix_version`); default: an update clears the cache."""
    fairness: int = 8
    """A waiting request is overtaken by better-cached (or smaller) ones at most this many times."""
    speculative: bool = False
    """MTP speculative decoding: the model's first MTP head drafts one token per step, the main
    model verifies it in the same forward as the next one (models with MTP heads only)."""
    fuse_products: bool = True
    """q/k/v and gate/up as one product each on CPU (`model/linear.py`)."""
    pack_weights: bool = True
    """The products' weights kept in oneDNN's packed layout on CPU (`model/linear.py`): faster
    decode, at the cost of a copy of the model's product weights (about 540 MB for SmolLM2-135M).
    With the decode kernel on and at most 8 slots nothing is packed: the kernel takes every decode
    product, and prefill runs as fast unpacked (`linear.prepare_inference`)."""
    decode_kernel: bool = True
    """Products of at most 8 rows (decode steps) on the AVX2 kernel of `kernels/decode_products.py`
    (its 16-lane form on a CPU with AVX-512F),
    which reads the weights faster than oneDNN at those sizes on this project's CPU; built on first
    use (g++ and ninja), oneDNN where it cannot be. With it, a dense model's decode steps of 1-32
    rows run one C++ call a layer (`kernels/decode_layer.py`: its products on the same kernel)."""
    max_waiting: int = 256
    """Sequences queued for a slot at most; past it `submit` raises EngineBusy (a server answers 429)."""
    shared_prefix_attention: bool = True
    """Decoding rows whose KV starts with the same bytes (copies of one prefill or one prefix-cache
    node: the agent's system prompt and tools, the n samples of a request) read that prefix once
    per step for all of them (`model/cache.KVCache.decode_attend`)."""
    shared_prefix_min: int = 64
    """Shortest common prefix worth the shared-prefix path's extra calls (a concatenation and a product a layer)."""
