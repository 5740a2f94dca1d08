"""The keys and values of a shared prompt, computed once in training mode, with their gradient.

Used wherever several training rows begin with the same ids: RL's groups (G rollouts of one
prompt, `rl/forward.py`) and SFT's batches (demonstrations that share the harness's system
prompt and tool schemas, `train/shared_prefix.py`). The rows' gradients are the same as those of
separate full forwards and backwards; the prefix is computed once instead of once a row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opencomposer.model.cache import LowerRightCausal


class PrefixKV:
    """The keys and values of a group's shared prompt, computed once in training mode.

    It stands in for `KVCache` in a model's forward (one row): the first forward (the prefix)
    records what each layer caches, with its graph; every later forward (one rollout's suffix)
    attends over the prefix through leaf copies, so each suffix's backward stops at the prefix and
    leaves its gradient on the leaves. `backward()` then runs the prefix's backward once with the
    gradient all G rollouts left there. The result equals G separate full forwards and backwards
    (the prefix's gradient is linear in the gradients reaching its keys and values), at the
    prefix's cost once instead of G times.

    Under activation checkpointing a block's forward runs again in the backward, `write` included:
    during the prefix's backward `write` hands back what it is given (the prefix's own keys and
    values, as when they were recorded), and a suffix's recompute sees the same leaves as its first
    forward did, so the recomputed activations are the ones the first forward saved."""

    def __init__(self, num_layers: int):
        self._recorded: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers
        self._leaves: list[tuple[torch.Tensor, ...] | None] | None = None
        self._replaying = False
        self.length = 0

    # -- the part of KVCache's interface a forward uses ------------------------------------------
    def rows_tensor(self, rows) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.long)

    def positions(self, rows: torch.Tensor, t: int) -> torch.Tensor:
        return (self.length + torch.arange(t))[None]

    def mask(self, rows: torch.Tensor, t: int):
        return LowerRightCausal(self.length) if self.length else None  # causal kernel, no (t, S) matrix

    def write(self, layer: int, rows: torch.Tensor, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._replaying:  # the prefix's blocks recomputed in its backward (checkpointing)
            return new
        if self._leaves is None:  # recording the prefix
            self._recorded[layer] = new
            return new
        return tuple(torch.cat([p, x], dim=2) for p, x in zip(self._leaves[layer], new))

    def advance(self, rows: torch.Tensor, t: int) -> None:
        if self._leaves is None:
            self.length += t

    # -- the shared prefix ---------------------------------------------------------------------------
    def freeze(self) -> None:
        """End of the prefix: later forwards read it through leaves that collect their gradient."""
        self._leaves = [None if r is None else tuple(x.detach().requires_grad_(x.requires_grad) for x in r)
                        for r in self._recorded]

    def backward(self) -> None:
        outs, grads = [], []
        for rec, leaves in zip(self._recorded, self._leaves or []):
            for x, leaf in zip(rec or (), leaves or ()):
                if x.requires_grad and leaf.grad is not None:
                    outs.append(x)
                    grads.append(leaf.grad)
        if outs:
            self._replaying = True
            try:
                torch.autograd.backward(outs, grads)
            finally:
                self._replaying = False
        self._recorded = [None] * len(self._recorded)
        self._leaves = None


def shared_length(rows: Sequence[Sequence[int]], first_trained: Sequence[int]) -> int:
    """How many leading ids all `rows` share that no trained token is predicted from: a token at
    position j is predicted from position j - 1, so the prefix ends before the earliest
    `first_trained[i] - 1`. 0 for fewer than two rows (nothing to share)."""
    if len(rows) < 2:
        return 0
    first = rows[0]
    n = min(len(r) for r in rows)
    for r in rows[1:]:
        i = 0
        while i < n and r[i] == first[i]:
            i += 1
        n = i
    return max(0, min(n, min(first_trained) - 1))
