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
from opencomposer.model.prefix_kv import PrefixKV, shared_length
from opencomposer.rl.sequences import RLSequence


def replay_tensor(seq: RLSequence) -> torch.Tensor | None:
    """(1, T, layers, top_k) experts to replay; the last position routes freely (-1)."""
    if seq.experts is None:
        return None
    experts = torch.tensor(seq.experts, dtype=torch.long)
    return torch.cat([experts, torch.full((1, *experts.shape[1:]), -1, dtype=torch.long)])[None]


def checkpoints(setting: bool | int | None, tokens: int) -> bool:
    """Whether a forward of `tokens` tokens runs with activation checkpointing: `setting` is a bool,
    or a token count from which on it does (None: never; `TrainerConfig.checkpoint_tokens`)."""
    if setting is None or isinstance(setting, bool):
        return bool(setting)
    return tokens >= setting


def sequence_logprobs(model: torch.nn.Module, seq: RLSequence, *, temperature: float | None = None,
                      replay: bool = True, checkpoint: bool | int | None = False) -> torch.Tensor:
    """log p of each trained token (where `loss_mask` is 1), in order, differentiable. `checkpoint`
    (`checkpoints`): recompute each block's activations in the backward instead of keeping them (the
    same numbers; memory that no longer grows with the sequence's length times the depth)."""
    t = temperature if temperature is not None else float((seq.sampling or {}).get("temperature") or 1.0)
    if t <= 0:
        raise ValueError("temperature 0 (greedy) has no logprobs to match; sample at temperature > 0")
    ids = torch.tensor([seq.ids], dtype=torch.long)
    pos = torch.tensor([i for i in range(1, len(seq.ids)) if seq.loss_mask[i]], dtype=torch.long)
    options: dict = {"logits": False, "checkpoint": checkpoints(checkpoint, len(seq.ids))}
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


def shared_prefix(seqs: list[RLSequence]) -> int:
    """How many leading ids every sequence shares and no trained token is predicted from: the
    group's prompt up to its last token (0 when they share nothing or route differently there)."""
    n = shared_length([s.ids for s in seqs],
                      [next((i for i, m in enumerate(s.loss_mask) if m), len(s.ids)) for s in seqs])
    if n > 0 and seqs[0].experts is not None:
        head = seqs[0].experts[:n]
        if any(s.experts is None or s.experts[:n] != head for s in seqs[1:]):
            return 0  # sampled by different versions: the prompt's replayed experts differ
    return n


class SharedPromptForward:
    """`logprobs(seq)` for the sequences of one group whose first `length` ids are the same: the
    prompt's forward once (`PrefixKV`), each sequence's suffix on top. With `grad`, call
    `backward()` after every suffix's loss has been backpropagated. `checkpoint` (`checkpoints`):
    activation checkpointing per block of the prefix's forward and of each suffix's, by its length."""

    def __init__(self, model: torch.nn.Module, seqs: list[RLSequence], length: int, grad: bool = True,
                 checkpoint: bool | int | None = False):
        self.model, self.length, self.grad = model, length, grad
        self.checkpoint = checkpoint
        self.cache = PrefixKV(len(model.layers))
        seq = seqs[0]
        options: dict = {"logits": False, "cache": self.cache, "checkpoint": checkpoints(checkpoint, length)}
        rep = replay_tensor(seq)
        if rep is not None:
            options["replay"] = rep[:, :length]
        self.was = model.training
        model.train()
        with torch.set_grad_enabled(grad):
            model(torch.tensor([seq.ids[:length]], dtype=torch.long), **options)
        self.cache.freeze()

    def logprobs(self, seq: RLSequence, temperature: float | None = None) -> torch.Tensor:
        p = self.length
        t = temperature if temperature is not None else float((seq.sampling or {}).get("temperature") or 1.0)
        if t <= 0:
            raise ValueError("temperature 0 (greedy) has no logprobs to match; sample at temperature > 0")
        ids = torch.tensor([seq.ids], dtype=torch.long)
        pos = torch.tensor([i for i in range(1, len(seq.ids)) if seq.loss_mask[i]], dtype=torch.long)
        if int(pos.min()) - 1 < p:
            raise ValueError(f"a trained token at {int(pos.min())} is predicted from inside the shared prefix ({p})")
        options: dict = {"logits": False, "cache": self.cache, "checkpoint": checkpoints(self.checkpoint, len(seq.ids) - p)}
        rep = replay_tensor(seq)
        if rep is not None:
            options["replay"] = rep[:, p:]
        self.model.train()
        with torch.set_grad_enabled(self.grad):
            h = self.model(ids[:, p:], **options).hidden
            return token_logprobs(h[0, pos - 1 - p], self.model.lm_head.weight, ids[0, pos], t)

    def backward(self) -> None:
        self.cache.backward()
        self.model.train(self.was)

    def close(self) -> None:
        self.model.train(self.was)
