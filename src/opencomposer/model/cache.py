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
        self.shared: SharedPrefix | None = None
        """Set by the caller before a decode forward: slots whose keys and values over a common
        prefix are the same bytes (`decode_attend` reads that prefix once for all of them)."""

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
        (`_DecodePlan`), not in every layer.

        With `shared` set, the rows it names attend over their common prefix in one product for
        all of them (cascade attention, as FlashInfer's shared-prefix kernels) and over the rest of
        their own keys, under one softmax (`_cascade`). The agent's system prompt and tool schemas
        (about 1,200 of SmolLM2's tokens) open every request; without this every row read them from
        its own slot, most of the keys of a decode step."""
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
        if plan.members is None:
            return _attend_runs(q, store, plan.runs, scale)
        members, others, n, src = plan.members, plan.others, plan.prefix, plan.src
        qm = q if others is None else q.index_select(0, members)
        out = _cascade(qm, store[0][src, :, :n], store[1][src, :, :n], store, plan.member_runs, n, scale)
        if others is None:
            return out
        full = torch.empty_like(q)
        full.index_copy_(0, members, out)
        full.index_copy_(0, others, _attend_runs(q.index_select(0, others), store, plan.runs, scale))
        return full

    def decode_rows(self, rows: torch.Tensor, heads: int, head_dim: int, dtype) -> tuple[torch.Tensor, ...]:
        """For a decode step on the fused layer (`kernels/decode_layer.py`), with storage grown for
        it in every layer: each row's offset, and the slot and length of the prefix it reads from
        another slot (the first of the rows that share `shared`, when at least two do, as in
        `decode_attend`; else its own slot and 0)."""
        starts = self.lengths[rows]
        slots, begin = rows.tolist(), starts.tolist()
        like = (torch.empty(1, heads, 1, head_dim, dtype=dtype),) * 2
        for layer in range(self.num_layers):
            self._grow(max(begin) + 1, like, layer)
        src, prefix = list(slots), [0] * len(slots)
        inside = _sharing(slots, begin, self.shared)
        for i in inside:
            src[i], prefix[i] = slots[inside[0]], self.shared.length
        return starts, torch.tensor(src), torch.tensor(prefix)

    def storage(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One layer's cached tensors (slots, H, capacity, D), as stored."""
        return self._store[layer]

    def _decode_plan(self, rows: torch.Tensor) -> _DecodePlan:
        """The plan for one decode forward over `rows`, made by its first layer and reused by the
        others: the lengths only change after the last layer (`advance`), a new forward starts in
        `positions` (which drops the plan), and the plan holds `rows` itself, so the same object
        is the same forward's."""
        if self._plan is None or self._plan.rows is not rows:
            self._plan = _DecodePlan(rows, self.lengths[rows], self.shared)
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


class SharedPrefix:
    """Slots whose cached keys and values at positions [0, length) are the same bytes: copies of
    one prefill (the n samples of a request) or of one prefix-cache node (every request that
    starts with the agent's system prompt). The engine knows this from where each slot's KV came
    from; the cache cannot check it, so only a caller that knows sets it."""

    __slots__ = ("length", "slots")

    def __init__(self, length: int, slots):
        self.length, self.slots = int(length), frozenset(int(s) for s in slots)


class _DecodePlan:
    """Where one decode forward writes and reads (`KVCache.decode_attend`): each row's offset, the
    slice its rows form when they are consecutive slots at one offset, and the runs of consecutive
    slots with each run's length and key mask. With a shared prefix: which rows read it (at least
    two, each past it), the slot it is read from, and the members' runs over their keys after it."""

    __slots__ = ("block", "member_runs", "members", "need", "others", "prefix", "rows", "runs", "src", "starts")

    def __init__(self, rows: torch.Tensor, starts: torch.Tensor, shared: SharedPrefix | None = None):
        self.rows, self.starts = rows, starts
        slots, begin = rows.tolist(), starts.tolist()
        self.need = max(begin) + 1
        lens = [b + 1 for b in begin]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        self.block = (slots[0], len(slots), begin[0]) if consecutive and len(set(begin)) == 1 else None
        self.members = self.others = None
        self.prefix, self.src, self.member_runs = 0, -1, []
        # a row shares only positions it holds already (its new token is written past them)
        inside = _sharing(slots, begin, shared)
        if inside:
            rest = sorted(set(range(len(slots))) - set(inside))
            self.prefix, self.src = shared.length, slots[inside[0]]
            self.members = torch.tensor(inside)
            self.others = torch.tensor(rest) if rest else None
            self.member_runs = _runs([slots[i] for i in inside], [lens[i] for i in inside])
            self.runs = _runs([slots[i] for i in rest], [lens[i] for i in rest])
        else:
            self.runs = _runs(slots, lens)


def _sharing(slots: list[int], begin: list[int], shared: SharedPrefix | None) -> list[int]:
    """The rows (indices) that read `shared`'s prefix together: those whose slot holds it and that
    are past it (a row's new token is written after the prefix), when at least two are; else none."""
    if shared is None or shared.length <= 0:
        return []
    inside = [i for i, (s, b) in enumerate(zip(slots, begin)) if s in shared.slots and b >= shared.length]
    return inside if len(inside) >= 2 else []


def _runs(slots: list[int], lens: list[int]) -> list[tuple[int, int, int, int, torch.Tensor | None]]:
    """(i, j, first slot, keys to read, key mask or None) for each run of consecutive slots."""
    runs, i = [], 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        end = max(lens[i:j])
        mask = None
        if min(lens[i:j]) != end:
            mask = torch.arange(end)[None] < torch.tensor(lens[i:j])[:, None]
        runs.append((i, j, slots[i], end, mask))
        i = j
    return runs


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


def _attend_runs(q, store, runs, scale):
    """`_decode_attend` of each run of rows over its slots' keys."""
    out = [_decode_attend(q[i:j], store[0][a:a + j - i, :, :end], store[1][a:a + j - i, :, :end], mask, scale)
           for i, j, a, end, mask in runs]
    return out[0] if len(out) == 1 else torch.cat(out)


def _cascade(q, kp, vp, store, runs, n: int, scale):
    """Attention of decoding rows q (R, Hq, 1, D) over a prefix they share (kp, vp: (Hk, n, D)) and
    each over its own keys from position n on (`runs`, as in `_decode_attend`). The prefix's scores
    come from one product for all rows (the R rows' query heads of each key head stacked as that
    product's rows), so the prefix is read once, not R times; each run of rows adds its own keys'
    scores beside them, and one softmax over both gives the probabilities, which go back through
    the prefix's values in one product and through each run's own values. Equal to
    `_decode_attend` over the whole keys to ~1e-7 in float32. Fewer, larger calls than two
    separately normalised halves merged afterwards (FlashAttention's merge), which cost more in
    small-op overhead than the prefix saved at four rows."""
    b, hq, _, d = q.shape
    hk = kp.shape[0]
    g = hq // hk
    q = q * (scale if scale is not None else d ** -0.5)
    sp = torch.bmm(q.view(b, hk, g, d).transpose(0, 1).reshape(hk, b * g, d), kp.transpose(1, 2))
    sp = sp.view(hk, b, g, n).transpose(0, 1)  # (b, hk, g, n), a view
    own, prefix_probs = [], []
    for i, j, a, end, mask in runs:
        r = j - i
        k = store[0][a:a + r, :, n:end].reshape(r * hk, end - n, d)
        ss = torch.bmm(q[i:j].reshape(r * hk, g, d), k.transpose(1, 2)).view(r, hk, g, end - n)
        if mask is not None:
            ss.masked_fill_(~mask[:, None, None, n:], float("-inf"))
        probs = torch.softmax(torch.cat([sp[i:j], ss], dim=-1), dim=-1)  # (r, hk, g, end)
        v = store[1][a:a + r, :, n:end].reshape(r * hk, end - n, d)
        own.append(torch.bmm(probs[..., n:].reshape(r * hk, g, end - n), v))
        prefix_probs.append(probs[..., :n])
    pp = prefix_probs[0] if len(prefix_probs) == 1 else torch.cat(prefix_probs)
    op = torch.bmm(pp.transpose(0, 1).reshape(hk, b * g, n), vp).view(hk, b, g, d).transpose(0, 1)
    out = own[0] if len(own) == 1 else torch.cat(own)
    return out.view(b, hk, g, d).add_(op).view(b, hq, 1, d)


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
