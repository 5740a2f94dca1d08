"""The KV cache both families decode with, and the attention call over it.

A cache has a fixed number of *slots* (sequences). Each slot has its own length, so sequences of
different lengths decode in one batch (continuous batching): `rows` names the slots a forward call
works on, new keys are written at each slot's own offset, and the mask lets each query see its own
slot's keys up to its position. Storage grows by doubling along time. What a layer caches is up to
the layer: GQA attention caches (k, v); MLA caches its compressed latent and the shared rotary key
(report §1: DeepSeek-V3 MLA), which is what makes MLA's cache small.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CacheError(ValueError):
    pass


class KVCache:
    def __init__(self, num_layers: int, slots: int, max_len: int, *, device=None):
        self.num_layers = num_layers
        self.slots = slots
        self.max_len = max_len
        self.device = device
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self._store: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers
        self._cap = 0
        self._plan: _DecodePlan | None = None  # the current forward's (`decode_attend`)

    # -- bookkeeping ------------------------------------------------------------------------------
    def rows_tensor(self, rows) -> torch.Tensor:
        if rows is None:
            return torch.arange(self.slots)
        r = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= self.slots):
            raise CacheError(f"rows {r.tolist()} outside the cache's {self.slots} slots")
        return r

    def positions(self, rows: torch.Tensor, t: int) -> torch.Tensor:
        """(R, t) absolute positions of t new tokens per row. Every forward over the cache starts
        here, which ends the previous forward's decode plan."""
        self._plan = None
        pos = self.lengths[rows][:, None] + torch.arange(t)[None]
        if int(pos.max()) >= self.max_len:
            raise CacheError(f"sequence would reach position {int(pos.max())}, past the cache's max_len {self.max_len}")
        return pos

    def mask(self, rows: torch.Tensor, t: int) -> torch.Tensor | None:
        """(R, 1, t, S) boolean mask, or None when a plain causal mask is exact (all rows empty)."""
        starts = self.lengths[rows]
        if int(starts.max()) == 0:
            return None
        s = int(starts.max()) + t
        q = starts[:, None] + torch.arange(t)[None]  # (R, t) absolute query positions
        return (torch.arange(s)[None, None, :] <= q[:, :, None])[:, None]

    def advance(self, rows: torch.Tensor, t: int) -> None:
        self.lengths[rows] += t

    def reset(self, rows) -> None:
        self.lengths[self.rows_tensor(rows)] = 0

    def copy(self, src: int, dsts) -> None:
        """Prefix sharing: the G rollouts of one prompt start from one prefill."""
        d = self.rows_tensor(dsts)
        n = int(self.lengths[src])
        for layer in self._store:
            if layer is not None:
                for t in layer:
                    # a copy first: the source row is a view of the written tensor, and index_put
                    # refuses a value that shares its memory
                    t[d, :, :n] = t[src, :, :n].clone()
        self.lengths[d] = n

    def read(self, slot: int, start: int, end: int) -> list[tuple[torch.Tensor, ...] | None]:
        """Copies of one slot's cached tensors at positions [start, end), per layer (each (H, n, D));
        None for a layer this cache never stored (an MTP layer in the main cache). What the prefix
        cache keeps after a request."""
        if end > int(self.lengths[slot]) or start < 0:
            raise CacheError(f"slot {slot} holds {int(self.lengths[slot])} positions; [{start}, {end}) asked")
        return [None if st is None else tuple(t[slot, :, start:end].clone() for t in st) for st in self._store]

    def put(self, slot: int, start: int, layers: list[tuple[torch.Tensor, ...] | None]) -> None:
        """Write per-layer tensors (H, n, D) at positions [start, start + n) of one slot, the slot's
        length becoming start + n: a prefix-cache hit copied in instead of prefilled."""
        n = next((t[0].shape[1] for t in layers if t is not None), 0)
        if start + n > self.max_len:
            raise CacheError(f"{start + n} positions exceed the cache's max_len {self.max_len}")
        for layer, new in enumerate(layers):
            if new is not None:
                self._grow(start + n, tuple(x[None] for x in new), layer)
                for st, x in zip(self._store[layer], new):
                    st[slot, :, start:start + n] = x.to(st.dtype)
        self.lengths[slot] = start + n

    # -- storage ----------------------------------------------------------------------------------
    def _grow(self, need: int, like: tuple[torch.Tensor, ...], layer: int) -> None:
        if need > self._cap:
            cap = max(need, min(self.max_len, max(64, 2 * self._cap)))
            for i, st in enumerate(self._store):
                if st is not None:
                    grown = []
                    for t in st:
                        g = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
                        g[:, :, : t.shape[2]] = t
                        grown.append(g)
                    self._store[i] = tuple(grown)
            self._cap = cap
        if self._store[layer] is None:
            self._store[layer] = tuple(x.new_zeros(self.slots, x.shape[1], self._cap, x.shape[3]) for x in like)

    def write(self, layer: int, rows: torch.Tensor, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store `new` (each (R, H, t, D)) at each row's offset; return the rows' full tensors
        (R, H, S, D) with S = the longest row's length after the write."""
        t = new[0].shape[2]
        starts = self.lengths[rows]
        end = int(starts.max()) + t
        store = self._put_rows(layer, rows, starts, new)
        contiguous = rows.numel() > 0 and bool((rows == torch.arange(int(rows[0]), int(rows[0]) + rows.numel())).all())
        if contiguous:
            a = int(rows[0])
            return tuple(st[a:a + rows.numel(), :, :end] for st in store)
        return tuple(st[rows, :, :end] for st in store)

    def decode_attend(self, layer: int, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
        """Decoding (one new token per row): store (k, v) (each (R, H, 1, D)) and attend each row's
        query (R, Hq, 1, D) over its own slot's keys. Rows in consecutive slots are read as one view
        of the storage, each run only up to its own longest row. `write` gathers the rows' tensors
        when their slots are not consecutive, which is the common case while serving agent
        episodes (turns end at different times, and a prefilling request holds slots in between):
        at a 2k-token context that copy was several times the attention itself. Where each row
        writes, which rows form a run and their masks are worked out once per forward
        (`_DecodePlan`), not in every layer."""
        plan = self._decode_plan(rows)
        self._grow(plan.need, (k, v), layer)
        store = self._store[layer]
        for st, x in zip(store, (k, v)):
            x = x.to(st.dtype)
            if plan.block is not None:  # consecutive slots at one offset: a plain slice copy
                a, n, s0 = plan.block
                st[a:a + n, :, s0:s0 + 1] = x
            else:
                st[rows, :, plan.starts] = x[:, :, 0]
        out = [_decode_attend(q[i:j], store[0][a:a + j - i, :, :end], store[1][a:a + j - i, :, :end], mask, scale)
               for i, j, a, end, mask in plan.runs]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _decode_plan(self, rows: torch.Tensor) -> _DecodePlan:
        """The plan for one decode forward over `rows`, made by its first layer and reused by the
        others: the lengths only change after the last layer (`advance`), a new forward starts in
        `positions` (which drops the plan), and the plan holds `rows` itself, so the same object
        is the same forward's."""
        if self._plan is None or self._plan.rows is not rows:
            self._plan = _DecodePlan(rows, self.lengths[rows])
        return self._plan

    def _put_rows(self, layer: int, rows: torch.Tensor, starts: torch.Tensor, new: tuple[torch.Tensor, ...],
                  ) -> tuple[torch.Tensor, ...]:
        """Write `new` (each (R, H, t, D)) at each row's offset; return the layer's storage."""
        t = new[0].shape[2]
        self._grow(int(starts.max()) + t, new, layer)
        store = self._store[layer]
        uniform = bool((starts == starts[0]).all())
        for st, x in zip(store, new):
            x = x.to(st.dtype)
            if uniform:
                s0 = int(starts[0])
                st[rows, :, s0:s0 + t] = x
            elif t == 1:  # decoding ragged rows: one scatter, each row at its own offset
                st[rows, :, starts] = x[:, :, 0]
            else:
                for i, (r, s0) in enumerate(zip(rows.tolist(), starts.tolist())):
                    st[r, :, s0:s0 + t] = x[i]
        return store


class _DecodePlan:
    """Where one decode forward writes and reads (`KVCache.decode_attend`): each row's offset, the
    slice its rows form when they are consecutive slots at one offset, and the runs of consecutive
    slots with each run's length and key mask."""

    __slots__ = ("block", "need", "rows", "runs", "starts")

    def __init__(self, rows: torch.Tensor, starts: torch.Tensor):
        self.rows, self.starts = rows, starts
        slots, begin = rows.tolist(), starts.tolist()
        self.need = max(begin) + 1
        lens = [b + 1 for b in begin]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        self.block = (slots[0], len(slots), begin[0]) if consecutive and len(set(begin)) == 1 else None
        self.runs: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        i = 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            end = max(lens[i:j])
            mask = None
            if min(lens[i:j]) != end:
                mask = torch.arange(end)[None] < torch.tensor(lens[i:j])[:, None]
            self.runs.append((i, j, slots[i], end, mask))
            i = j


class LowerRightCausal:
    """The mask of queries that are the last positions of the keys, each seeing every key up to
    its own (a training forward over a prefix computed before, `rl/forward.py`). `attend` never
    lets it reach SDPA's math path, which keeps the whole attention matrix of every layer for the
    backward (tens of GB at a few thousand tokens for SmolLM2). The queries are padded in front so
    that SDPA's aligned causal kernel applies, which computes the padded rows too; or, where SDPA's
    fused kernel takes an explicit mask (torch's CPU flash attention does) and that is cheaper, the
    kernel gets the (t, S) boolean mask, and computes all t * S pairs. For a 600-token suffix over
    1,771 keys, forward and backward took 171 ms padded against 93 ms with the mask (one layer of
    SmolLM2, one thread, this machine; the same output to the last bit); with a suffix longer than
    its prefix the padded kernel was faster (a recorded RL group: 114 s against 119 s a step)."""

    def __init__(self, offset: int):
        self.offset = offset


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None,
           ) -> torch.Tensor:
    """Scaled dot-product attention; causal when `mask` is None (keys and queries aligned), or
    `LowerRightCausal` (queries are the keys' last positions). Keys and values may have fewer
    heads than queries (grouped-query attention)."""
    gqa = k.shape[1] != q.shape[1]
    if isinstance(mask, LowerRightCausal):
        t, s = q.shape[2], k.shape[2]
        # with a mask the kernel computes every (query, key) pair, t * s of them; the padded causal
        # kernel skips the blocks above the diagonal, s * s / 2: the mask pays where t <= s / 2
        if 2 * t <= s:
            explicit = torch.arange(s, device=q.device)[None] <= torch.arange(s - t, s, device=q.device)[:, None]
            if _fused_with_mask(q, k, v, explicit, gqa):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=explicit, scale=scale, enable_gqa=gqa)
        # zero queries in front make the queries and keys aligned; their rows are dropped (no gradient)
        pad = q.new_zeros(q.shape[0], q.shape[1], mask.offset, q.shape[3])
        out = F.scaled_dot_product_attention(torch.cat([pad, q], dim=2), k, v, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out[:, :, mask.offset:]
    if mask is not None and q.shape[2] == 1 and not torch.is_grad_enabled():
        return _decode_attend(q, k, v, mask, scale)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _fused_with_mask(q, k, v, mask, gqa: bool) -> bool:
    """Whether SDPA runs these tensors with this mask on its flash kernel (not the math path)."""
    try:
        return torch._fused_sdp_choice(q, k, v, attn_mask=mask, enable_gqa=gqa) == _FLASH
    except (AttributeError, RuntimeError, TypeError):  # a torch that cannot say: the padded causal path
        return False


_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _decode_attend(q, k, v, mask, scale):
    """One query per row over the cache (decoding): the query heads of each key head are stacked
    so one batched product reads every key and value once. On this CPU that is ~25% faster than
    SDPA's kernel with a mask and GQA at a 2k-token context (attention over the cache is most of a
    decode step there); the result matches SDPA to ~1e-7 in float32. `bmm` on 3-d views rather than
    `@` on 4-d ones: the same products (bit-identical) without matmul's broadcasting steps, 5-20%
    less time per call here."""
    b, hq, _, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = hq // hk
    scores = torch.bmm(q.reshape(b * hk, g, d), k.reshape(b * hk, s, d).transpose(1, 2))
    scores.mul_(scale if scale is not None else d ** -0.5)
    if mask is not None:
        scores = scores.view(b, hk, g, s).masked_fill_(~mask.reshape(mask.shape[0], 1, 1, s), float("-inf"))
    probs = torch.softmax(scores.view(b * hk, g, s), dim=-1)
    return torch.bmm(probs, v.reshape(b * hk, s, v.shape[-1])).view(b, hq, 1, v.shape[-1])


def segment_positions_and_mask(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Packed training sequences: segment ids (B, T) -> positions restarting at every document and
    a (B, 1, T, T) mask that is causal within a document and closed across documents. (An explicit
    mask takes SDPA's math path on CPU: memory grows with T^2 per head and layer, fine at the
    speedrun's lengths; a varlen attention kernel is the GPU answer.)"""
    b, t = segments.shape
    if not bool((segments[:, 1:] != segments[:, :-1]).any()):  # one document per row: plain causal
        return torch.arange(t)[None].expand(b, t), None, None
    same = segments[:, :, None] == segments[:, None, :]
    mask = (same & torch.ones(t, t, dtype=torch.bool).tril())[:, None]
    ar = torch.arange(t)[None].expand(b, t)
    first = torch.ones_like(segments, dtype=torch.bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start = torch.cummax(torch.where(first, ar, torch.zeros_like(ar)), dim=1).values
    return ar - start, mask, None
