"""The prefix cache: KV of earlier requests kept in a radix tree of token prefixes, so that a new
request prefills only what no earlier one computed (SGLang's RadixAttention; vLLM's automatic prefix
caching keys hashed blocks instead).

An agent episode resends its whole conversation every turn (the system prompt with the tool schemas,
then the history), the G rollouts of a group share their prompt, and turn t+1 starts with turn t's
prompt and completion. The engine inserts a prompt's KV after its prefill and a sequence's whole KV
(prompt + completion) when it finishes; the next request's longest cached prefix is copied into its
slot and only the rest is prefilled.

Why copy-in rather than shared blocks: running sequences attend over their own contiguous slot of
`KVCache` (one SDPA call over a view per layer, the fast path on a CPU; a paged gather would copy
the whole context every decode step). A hit costs one memory copy of the matched KV, a few ms per
thousand tokens here, against a prefill at a few hundred tokens per second. Nodes hold their own
tensors; a running sequence holds a reference on the path it started from until it finishes, and a
referenced node is never evicted (SGLang's lock_ref). Unreferenced leaves are evicted least recently
used first when the tree passes its byte budget.

Each node records the oldest policy version its KV was computed under. A weight update clears the
tree by default (cached KV of older weights is stale); keeping it, PipelineRL-style, is an engine
option, and then every sequence records the version of the KV it reused.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from opencomposer.inference.provenance import Spans, merged, new_tag

Layers = list  # per cache layer: a tuple of (H, n, D) tensors, or None for a layer the cache does not store


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    kv: Layers
    version: int
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    experts: torch.Tensor | None = None
    """(n, moe_layers, top_k) routed experts of these positions (router replay needs them for the prompt)."""
    mtp: Layers | None = None
    """Speculative decoding's MTP-cache entries, stored shifted by one: entry i (the pair of main hidden
    state i and token i+1) lives with token i+1, so a node's entries depend only on tokens on its path."""
    refs: int = 0
    last_used: int = 0
    tag: int = field(default_factory=new_tag)
    """Names this node's KV (`new_tag`); both halves of a split keep it: their positions differ."""

    @property
    def nbytes(self) -> int:
        total = 0
        for layers in (self.kv, self.mtp or []):
            for t in layers:
                if t is not None:
                    total += sum(x.numel() * x.element_size() for x in t)
        return total

    def split(self, k: int) -> Node:
        """Cut this node after its first k tokens; returns the new parent holding those k."""
        def cut(layers, a, b):
            return None if layers is None else [None if t is None else tuple(x[:, a:b].clone() for x in t)
                                                for t in layers]

        head = Node(self.tokens[:k], cut(self.kv, 0, k), self.version, parent=self.parent,
                    experts=None if self.experts is None else self.experts[:k].clone(), mtp=cut(self.mtp, 0, k),
                    refs=self.refs, last_used=self.last_used, tag=self.tag)
        self.parent.children[self.tokens[0]] = head
        self.kv, self.mtp = cut(self.kv, k, len(self.tokens)), cut(self.mtp, k, len(self.tokens))
        if self.experts is not None:
            self.experts = self.experts[k:].clone()
        self.tokens = self.tokens[k:]
        self.parent = head
        head.children[self.tokens[0]] = self
        return head


@dataclass
class Match:
    """The longest cached prefix of a prompt: the nodes it runs through, how many tokens of each."""
    path: list[tuple[Node, int]]
    length: int

    @property
    def version(self) -> int | None:
        """The oldest policy version among the matched KV (None: nothing matched)."""
        return min((n.version for n, _ in self.path), default=None)


def _common(label: tuple[int, ...], tokens: list[int], pos: int, n: int) -> int:
    """How many of the first n tokens of `label` equal tokens[pos:]: one slice comparison when the
    whole run matches (the usual case), token by token only to find where it stops."""
    if label[:n] == tuple(tokens[pos:pos + n]):
        return n
    k = 0
    while k < n and label[k] == tokens[pos + k]:
        k += 1
    return k


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.root = Node((), [], 0)
        self._clock = itertools.count(1)
        self.nbytes = 0
        self.tokens = 0
        self.stats = {"evictions": 0, "evicted_tokens": 0, "inserted_tokens": 0, "refused": 0}

    # -- lookup -----------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> Match:
        """The longest cached prefix of `tokens`, at most `limit` tokens long."""
        node, pos, path = self.root, 0, []
        now = next(self._clock)
        limit = min(limit, len(tokens))
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.tokens, tokens, pos, min(len(child.tokens), limit - pos))
            child.last_used = now
            path.append((child, k))
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return Match(path, pos)

    def load(self, m: Match, cache, slot: int, *, upto: int | None = None, mtp_cache=None) -> list:
        """Copy the first `upto` (default all) matched positions into `slot` of `cache`, and with
        `mtp_cache` the MTP entries 0..upto-1 (which live with tokens 1..upto); returns the matched
        positions' routed experts as lists (empty for a dense model)."""
        upto = m.length if upto is None else upto
        pos, experts = 0, []
        for node, k in m.path:
            take = min(k, upto - pos)
            if take <= 0:
                break
            cache.put(slot, pos, [None if t is None else tuple(x[:, :take] for x in t) for t in node.kv])
            if node.experts is not None:
                experts.extend(node.experts[:take].tolist())
            pos += take
        if mtp_cache is not None:
            # entry e lives with token e+1: entries 0..upto-1 are the columns of tokens 1..upto
            pos = 0
            for node, k in m.path:
                lo, hi = max(pos, 1), min(pos + k, upto + 1)
                if hi > lo:
                    mtp_cache.put(slot, lo - 1, [None if t is None else tuple(x[:, lo - pos:hi - pos] for x in t)
                                                 for t in node.mtp])
                pos += k
            mtp_cache.lengths[slot] = upto
        return experts

    @staticmethod
    def spans(m: Match, upto: int) -> Spans:
        """The spans of the first `upto` matched positions as `load` copies them."""
        pos, out = 0, []
        for node, k in m.path:
            take = min(k, upto - pos)
            if take <= 0:
                break
            pos += take
            out.append((pos, node.tag))
        return merged(out)

    def lock(self, m: Match, delta: int = 1) -> None:
        """Reference (delta=1) or release (delta=-1) the matched path. Walks up from the last node,
        so a node split since the lock was taken is released through its new parent."""
        node = m.path[-1][0] if m.path else None
        while node is not None and node is not self.root:
            node.refs += delta
            node = node.parent

    # -- insert and evict -------------------------------------------------------------------------
    def insert(self, tokens: list[int], cache, slot: int, version: int, *, experts: list | None = None,
               mtp_cache=None, spans: Spans = ()) -> int:
        """Keep the KV at positions [0, len(tokens)) of `slot` (the KV of `tokens`); only what the
        tree does not hold yet is copied. With `mtp_cache`, its entries 0..len-2 are kept too (the
        caller passes only as many tokens as both caches hold). `spans`, the slot's: a new node
        lying inside one of them takes its tag, since it holds the same bytes. Returns the tokens
        added."""
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.tokens, tokens, pos, min(len(child.tokens), len(tokens) - pos))
            if pos + k == len(tokens):  # all of it is cached already
                child.last_used = now
                return 0
            if k < len(child.tokens):
                child = child.split(k)
            child.last_used = now  # an older node keeps its own KV and version
            node, pos = child, pos + k
        rest = len(tokens) - pos
        if rest <= 0:
            return 0
        kv = cache.read(slot, pos, len(tokens))
        if all(t is None for t in kv):  # a model that caches nothing (a test fake): nothing to keep
            return 0
        new = Node(tuple(tokens[pos:]), kv, version, parent=node, last_used=now)
        start = 0
        for end, tag in spans:
            if start <= pos and len(tokens) <= end:
                new.tag = tag
            start = end
        if experts is not None:
            new.experts = torch.tensor(experts[pos:len(tokens)], dtype=torch.int32)
        if mtp_cache is not None:
            entries = mtp_cache.read(slot, max(pos - 1, 0), len(tokens) - 1)
            if pos == 0:  # the padding column for entry -1
                entries = [None if t is None else tuple(torch.cat([x[:, :1] * 0, x], 1) for x in t) for t in entries]
            new.mtp = entries
        size = new.nbytes
        if size > self.budget:  # larger than the whole cache: served, not kept
            self.stats["refused"] += 1
            return 0
        self.evict(self.budget - size)
        if self.nbytes + size > self.budget:  # everything left is in use
            self.stats["refused"] += 1
            return 0
        node.children[new.tokens[0]] = new
        self.nbytes += size
        self.tokens += rest
        self.stats["inserted_tokens"] += rest
        return rest

    def evict(self, target_bytes: int) -> None:
        """Drop unreferenced leaves, least recently used first, until the tree holds at most
        `target_bytes`."""
        if self.nbytes <= target_bytes:
            return
        heap = [(n.last_used, id(n), n) for n in self._leaves() if n.refs == 0]
        heapq.heapify(heap)
        while heap and self.nbytes > target_bytes:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens[0]]
            self.nbytes -= node.nbytes
            self.tokens -= len(node.tokens)
            self.stats["evictions"] += 1
            self.stats["evicted_tokens"] += len(node.tokens)
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def clear(self) -> None:
        self.root.children.clear()
        self.nbytes = self.tokens = 0

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                yield n
