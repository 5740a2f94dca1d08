"""Where a slot's KV came from, so that the engine knows which decoding rows hold the same bytes.

Every computation of KV gets a tag: one prefill of a request's prompt, or the KV a prefix-cache
node was inserted with. The bytes at absolute position p of KV tagged t are the same wherever they
were copied (the n slots of a request, a node of the tree, a later request's slot loaded from that
node), so (t, p) is their identity. A slot records its prompt's KV as spans: ((end, tag), ...),
positions 0 to the first end, then to the next. Rows whose spans agree over a run of positions
hold that run bit for bit, and a decode step reads it once for all of them
(`model/cache.KVCache.decode_attend`). Identity rather than equal tokens: two prefills of the same
tokens, or one before and one after a weight update, need not give the same bytes.
"""

from __future__ import annotations

import itertools
from collections import Counter

from opencomposer.model.cache import SharedPrefix

Spans = tuple  # ((end, tag), ...): where a slot's KV came from, position 0 to the first end, and so on

_tags = itertools.count(1)


def new_tag() -> int:
    """A name for one computation of KV (one prefill, or what a node was inserted with)."""
    return next(_tags)


def merged(spans) -> Spans:
    """Spans with neighbours of one tag joined (a node and its split-off head keep one tag)."""
    out: list[tuple[int, int]] = []
    for end, tag in spans:
        if out and out[-1][1] == tag:
            out[-1] = (end, tag)
        elif end > (out[-1][0] if out else 0):
            out.append((end, tag))
    return tuple(out)


def common_length(a: Spans, b: Spans) -> int:
    """How many positions from 0 two slots' spans name the same KV."""
    start = 0
    for (ea, ta), (eb, tb) in zip(a, b):
        if ta != tb:
            return start
        if ea != eb:
            return min(ea, eb)
        start = ea
    return start


def shared_rows(slot_spans: list[tuple[int, Spans]], min_length: int) -> SharedPrefix | None:
    """The slots of a decode step that start with the same KV bytes, and for how many positions:
    those that start like most slots do, when at least two do for at least `min_length`."""
    firsts = Counter(sp[0][1] for _, sp in slot_spans if sp)
    if not firsts:
        return None
    tag, count = firsts.most_common(1)[0]
    if count < 2:
        return None
    members = [(slot, sp) for slot, sp in slot_spans if sp and sp[0][1] == tag]
    n = min(common_length(members[0][1], sp) for _, sp in members)
    return SharedPrefix(n, [slot for slot, _ in members]) if n >= min_length else None
