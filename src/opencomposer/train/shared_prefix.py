"""An SFT batch whose rows begin with the same ids, trained with that prefix computed once.

Every demonstration the harness records starts with the same system prompt and tool schemas
(most of a ~2,000-token SFT row on the speedrun's four tools) and differs from the user's request
on. A padded batch of B rows computes that prefix B times, forward and backward. Here the prefix's
forward runs once (`model.prefix_kv.PrefixKV`), each row's suffix attends over it, and the prefix's
backward runs once with the gradient all rows left on its keys and values. The loss and every
gradient are those of the padded batch (the same mean over labelled tokens; the prefix's gradient
is linear in what reaches its keys and values), up to float summation order:
`tests/unit/test_sft_shared_prefix.py` holds the loss to 1e-5 and every gradient to 1e-4 relative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opencomposer.model.loss import IGNORE, cross_entropy
from opencomposer.model.prefix_kv import PrefixKV, shared_length


@dataclass(frozen=True, slots=True)
class SharedPrefixBatch:
    """Rows of ids with labels aligned to them (the token itself where the loss applies, IGNORE
    elsewhere, as `sft.Example`), and the length of the prefix they share."""

    ids: tuple[tuple[int, ...], ...]
    labels: tuple[tuple[int, ...], ...]
    prefix: int

    @classmethod
    def of(cls, rows: list[tuple[list[int], list[int]]]) -> SharedPrefixBatch:
        """The batch of `rows` ((ids, labels) pairs), its prefix as long as they share ids and no
        labelled token is predicted from inside it."""
        if not rows:
            raise ValueError("an empty batch")
        first_label = [next((j for j, x in enumerate(lab) if x != IGNORE), len(lab)) for _, lab in rows]
        n = shared_length([ids for ids, _ in rows], first_label)
        return cls(tuple(tuple(i) for i, _ in rows), tuple(tuple(lab) for _, lab in rows), n)

    def labelled(self) -> int:
        """Labelled tokens in the batch (what the mean divides by), the first of each row excluded
        as in the padded batch (`collate` drops label 0: nothing predicts it)."""
        return sum(sum(1 for x in lab[1:] if x != IGNORE) for lab in self.labels)

    def tokens(self) -> int:
        """Positions this batch computes: the prefix once, then every row's suffix."""
        return self.prefix + sum(len(ids) - self.prefix for ids in self.ids)


def _prefix(model: torch.nn.Module, batch: SharedPrefixBatch) -> PrefixKV | None:
    """The keys and values of the batch's shared prefix, computed once (None where it shares none)."""
    if not batch.prefix:
        return None
    cache = PrefixKV(len(model.layers))
    model(torch.tensor([batch.ids[0][:batch.prefix]], dtype=torch.long), logits=False, cache=cache)
    cache.freeze()
    return cache


def _row_losses(model: torch.nn.Module, batch: SharedPrefixBatch, cache: PrefixKV | None):
    """(each labelled row's mean cross-entropy, its labelled tokens), one row's forward at a time on
    top of the prefix: the caller backpropagates a row before the next one is computed."""
    p = batch.prefix
    for ids, labels in zip(batch.ids, batch.labels):
        n = sum(1 for x in labels[1:] if x != IGNORE)
        if n == 0:
            continue
        h = model(torch.tensor([ids[p:]], dtype=torch.long), logits=False, cache=cache).hidden
        # hidden at position i predicts ids[i + 1]; the row's positions are p .. len - 1
        yield cross_entropy(h[:, :-1], model.lm_head.weight, torch.tensor([labels[p + 1:]], dtype=torch.long)), n


def backward(model: torch.nn.Module, batch: SharedPrefixBatch, scale: float = 1.0) -> float:
    """Backpropagate `scale` x the batch's mean cross-entropy over labelled tokens into the model's
    gradients; returns that mean (unscaled). One row's graph at a time besides the prefix's."""
    count = batch.labelled()
    if count == 0:
        return 0.0
    cache = _prefix(model, batch)
    total = 0.0
    for loss, n in _row_losses(model, batch, cache):  # each row's mean
        (loss * (scale * n / count)).backward()
        total += float(loss.detach()) * n / count
    if cache is not None:
        cache.backward()
    return total


@torch.no_grad()
def loss_sum(model: torch.nn.Module, batch: SharedPrefixBatch) -> tuple[float, int]:
    """(summed cross-entropy over the batch's labelled tokens, their count), the prefix computed
    once: an evaluation (no graph). SFT's loss before and after training runs on rows that share
    the harness's prompt, most of each row (`sft.mean_loss`)."""
    rows = [(float(loss), n) for loss, n in _row_losses(model, batch, _prefix(model, batch))]
    return sum(loss * n for loss, n in rows), sum(n for _, n in rows)
