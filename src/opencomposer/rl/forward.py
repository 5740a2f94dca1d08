"""The trainer's log-probabilities of an RL sequence's sampled tokens.

The same computation the RL loss differentiates (report §4: importance ratios against the
sampler's logprobs need the two to agree): the model called in training mode with gradients on,
through `__call__` so module hooks (FSDP2) fire, router replay of the sampler's experts for MoE
models (report §6.2), and the sampler's temperature. The conformance tests hold it to the
sampler's reported logprobs within 1e-4 (float32).
"""

from __future__ import annotations

import torch

from opencomposer.model.loss import token_logprobs
from opencomposer.rl.sequences import RLSequence


def replay_tensor(seq: RLSequence) -> torch.Tensor | None:
    """(1, T, layers, top_k) experts to replay; the last position routes freely (-1)."""
    if seq.experts is None:
        return None
    experts = torch.tensor(seq.experts, dtype=torch.long)
    return torch.cat([experts, torch.full((1, *experts.shape[1:]), -1, dtype=torch.long)])[None]


def sequence_logprobs(model: torch.nn.Module, seq: RLSequence, *, temperature: float | None = None,
                      replay: bool = True) -> torch.Tensor:
    """log p of each trained token (where `loss_mask` is 1), in order, differentiable."""
    t = temperature if temperature is not None else float((seq.sampling or {}).get("temperature") or 1.0)
    if t <= 0:
        raise ValueError("temperature 0 (greedy) has no logprobs to match; sample at temperature > 0")
    ids = torch.tensor([seq.ids], dtype=torch.long)
    pos = torch.tensor([i for i in range(1, len(seq.ids)) if seq.loss_mask[i]], dtype=torch.long)
    options: dict = {"logits": False}
    rep = replay_tensor(seq) if replay else None
    if rep is not None:
        options["replay"] = rep
    was = model.training
    model.train()
    try:
        with torch.enable_grad():
            h = model(ids, **options).hidden
            return token_logprobs(h[0, pos - 1], model.lm_head.weight, ids[0, pos], t)
    finally:
        model.train(was)
