"""The sampling engine: continuous batching over a slot KV cache, with everything RL needs per token.

One engine owns one model. Requests wait in a bounded queue; a request of n samples (the G rollouts
of one prompt) is prefilled once and its cache copied into n slots. A prefix cache
(`inference/prefix_cache.py`) keeps the KV of earlier prompts and completions across requests, so a
request prefills only what is not cached. Each `step()` admits waiting requests (those with the
longest cached prefix first, none overtaken more than `fairness` times), prefills a bounded chunk of
prompt tokens (a long prompt is spread over several steps so running sequences keep decoding), then
decodes every running sequence in one batched forward; rows whose KV starts with the same bytes (the
agent's system prompt from one prefix-cache node, the n samples of one request) read that prefix once
for all of them in that forward. For each sampled token the
engine records its log-probability, the policy version of the weights that produced it, and — for
MoE models — the experts every layer routed its input token to (report §4 router replay).

Weight updates are in-flight (report §3.1, PipelineRL-style): `update_weights` validates the new
tensors at once and the swap happens between two decode steps; running sequences keep their cache
and continue, and tokens sampled after the swap carry the new version. Every wait has a deadline;
an aborted or finished sequence frees its slot at the next step.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from opencomposer.inference.engine_config import EngineConfig
from opencomposer.inference.prefix_cache import Match, PrefixCache
from opencomposer.inference.provenance import Spans, merged, new_tag, shared_rows
from opencomposer.inference.sampling import SamplingParams, sample, sample_rows
from opencomposer.model.linear import prepare_inference

log = logging.getLogger(__name__)
# The batch size weights are packed for: the slots, within [8, 32]. Scratch A/B runs of decode with
# every weight packed, against fused products unpacked: packed for 8 rows, +9% at batch 1 and +37%
# at batch 8 but nothing at batch 32; packed for 32, +22% at batches 8 and 32.
PACK_ROWS = (8, 32)


class EngineError(ValueError):
    """A request the engine cannot take (the server answers 400)."""


class EngineBusy(EngineError):
    """The waiting queue is at its bound (the server answers 429 with Retry-After)."""


class WeightUpdateError(ValueError):
    """A weight update that does not fit the model; the engine keeps serving its old weights."""


_ids = itertools.count()


@dataclass
class Sequence:
    """One sample. `experts[i]` are the experts used at input position i (prompt, then generated
    tokens except the last), as nested lists [layer][k]; None for dense models."""
    id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    slot: int | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    gen: torch.Generator | None = None
    aborted: bool = False
    watchers: list = field(default_factory=list)
    """Callables run (on the engine's thread) after each new token and at the end: how an async
    server learns of progress without polling."""
    # speculative decoding: (main hidden at position i, token i+1) pairs the MTP has not seen yet
    pending: list = field(default_factory=list)
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of a prefill."""
    prefix_version: int | None = None
    """The oldest policy version of that reused KV (older than `versions` only when the engine keeps
    stale prefixes across weight updates): how stale the context each token was sampled from is."""
    kv_version: int = 0
    """The oldest policy version of anything in this sequence's KV."""
    match: Match | None = None  # the prefix-cache path this sequence holds a reference on


@dataclass(eq=False)
class _Group:
    prompt: list[int]
    seqs: list[Sequence]
    skipped: int = 0  # times a later request was admitted first
    slots: list[int] = field(default_factory=list)
    done: int = 0  # prompt tokens whose KV is in the first slot
    experts: list = field(default_factory=list)
    mtp_h: torch.Tensor | None = None  # the main hidden state of the last prefilled position
    spans: Spans = ()  # of the prefix copied in from the prefix cache
    tag: int = field(default_factory=new_tag)  # names the KV this group's prefill computes


class Engine:
    def __init__(self, model, *, config: EngineConfig | None = None, eos_ids: tuple[int, ...] = (),
                 decode=None, version: int = 0):
        self.model = model.eval()
        self.config = config or EngineConfig()
        rows = min(max(self.config.slots, PACK_ROWS[0]), PACK_ROWS[1])
        prepare_inference(model, fuse=self.config.fuse_products, pack=rows if self.config.pack_weights else None,
                          decode=self.config.decode_kernel)
        self.max_len = self.config.max_len or model.config.max_position_embeddings
        self.cache = model.new_cache(self.config.slots, self.max_len)
        self.eos_ids = tuple(eos_ids)
        self.decode = decode  # token ids -> text, for stop strings
        self.version = version
        self.is_moe = hasattr(model.config, "n_routed_experts")
        self.spec = bool(self.config.speculative)
        if self.spec and not len(getattr(model, "mtp", ())):
            raise EngineError("speculative decoding needs a model with MTP heads (num_nextn_predict_layers > 0)")
        self.mtp_cache = model.new_cache(self.config.slots, self.max_len) if self.spec else None
        self._free = list(range(self.config.slots))
        self._waiting: deque[_Group] = deque()
        self._prefilling: list[_Group] = []
        self.prefix = PrefixCache(self.config.prefix_cache_mb << 20) if self.config.prefix_cache_mb > 0 else None
        self._running: dict[int, Sequence] = {}
        self._spans: dict[int, Spans] = {}  # slot -> where its prompt's KV came from (`provenance.py`)
        self._cond = threading.Condition()
        self._update: tuple[dict, int] | None = None
        self.threads = torch.get_num_threads()  # what the engine's steps compute with (`set_threads`)
        self._threads_wanted: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "decode_steps": 0,
                      "decode_seconds": 0.0, "weight_updates": 0, "aborted": 0,
                      "drafted": 0, "accepted": 0, "cached_prompt_tokens": 0, "prefill_forwards": 0,
                      "prefill_seconds": 0.0, "decode_shared_rows": 0}

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, n: int = 1) -> list[Sequence]:
        params.validate()
        if not prompt:
            raise EngineError("empty prompt")
        if len(prompt) >= self.max_len:
            raise EngineError(f"prompt has {len(prompt)} tokens; the context is {self.max_len} tokens")
        if not 1 <= n <= self.config.slots:
            raise EngineError(f"n must be in 1..{self.config.slots}, got {n}")
        vocab = self.model.config.vocab_size
        # bool is an int to Python, and `[True]` became a bool tensor that the embedding refused mid-step
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise EngineError("prompt token ids must be integers")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineError(f"prompt token ids must be in 0..{vocab - 1}")
        seqs = []
        for i in range(n):
            gen = torch.Generator()
            # unseeded requests draw from the OS, never from (or into) the global torch RNG a trainer relies on
            gen.manual_seed(params.seed + i if params.seed is not None else secrets.randbits(63))
            seqs.append(Sequence(id=f"seq-{next(_ids)}", prompt=list(prompt), params=params, gen=gen,
                                 experts=[] if self.is_moe else None))
        with self._cond:
            queued = sum(len(g.seqs) for g in self._waiting)
            if queued + n > self.config.max_waiting:
                raise EngineBusy(f"{queued} sequences are already waiting for a slot (the bound is "
                                 f"{self.config.max_waiting}); retry shortly")
            self._waiting.append(_Group(list(prompt), seqs))
            self.stats["requests"] += 1
            self._cond.notify_all()
        return seqs

    def load(self) -> dict:
        """What a server needs to know of the engine's occupancy (read under the lock)."""
        with self._cond:
            return {"running": len(self._running) + sum(len(g.seqs) for g in self._prefilling),
                    "waiting": sum(len(g.seqs) for g in self._waiting),
                    "slots": self.config.slots, "max_waiting": self.config.max_waiting,
                    "alive": self._thread is not None and self._thread.is_alive() and not self._stop}

    def abort(self, seqs: list[Sequence]) -> None:
        with self._cond:
            for s in seqs:
                s.aborted = True
            self._cond.notify_all()

    def generate(self, prompt: list[int], params: SamplingParams, n: int = 1, timeout: float = 600.0,
                 ) -> list[Sequence]:
        """Submit and wait (runs the steps itself when no background loop is started)."""
        seqs = self.submit(prompt, params, n)
        deadline = time.monotonic() + timeout
        while not all(s.done.is_set() for s in seqs):
            if time.monotonic() > deadline:
                self.abort(seqs)
                raise TimeoutError(f"generation did not finish within {timeout:.0f} s")
            if self._thread is None:
                self.step()
            else:
                seqs[0].done.wait(0.05)
        return seqs

    # -- weights ----------------------------------------------------------------------------------
    def update_weights(self, tensors: dict[str, torch.Tensor], version: int, *, wait: float | None = 60.0) -> None:
        """Queue new weights (Hugging Face names, all or a subset of the model's tensors); they
        are checked now and swapped in between two decode steps."""
        if version <= self.version:
            raise WeightUpdateError(f"version {version} is not newer than the served version {self.version}")
        state = self.model.state_dict()
        for name, t in tensors.items():
            target = self.model.hf_target(name, state)
            if target is None:
                raise WeightUpdateError(f"unknown tensor {name}")
            if tuple(t.shape) != tuple(target.shape):
                raise WeightUpdateError(f"{name} has shape {tuple(t.shape)}, the model has {tuple(target.shape)}")
            if not torch.isfinite(t).all():
                raise WeightUpdateError(f"{name} contains NaN or Inf")
        with self._cond:
            if self._update is not None:
                # A second update before the next step: both apply (a subset after a subset is their
                # union, the newer tensor winning), under the newer version — neither is lost.
                if version <= self._update[1]:
                    raise WeightUpdateError(f"version {version} is not newer than the pending version "
                                            f"{self._update[1]}")
                tensors = {**self._update[0], **tensors}
            self._update = (tensors, version)
            self._cond.notify_all()
        if wait and self._thread is not None:
            deadline = time.monotonic() + wait
            while self.version < version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weight version {version} was not applied within {wait:.0f} s")
                time.sleep(0.005)
        elif self._thread is None:
            self._apply_update()

    def withdraw_update(self, version: int) -> bool:
        """Drop a queued update of `version` that has not been swapped in yet (True if dropped):
        a caller that gave up waiting must not have it applied behind its back."""
        with self._cond:
            if self._update is not None and self._update[1] == version:
                self._update = None
                return True
            return False

    def _apply_update(self) -> None:
        with self._cond:
            upd, self._update = self._update, None
        if upd is None:
            return
        tensors, version = upd
        t0 = time.perf_counter()
        if self.prefix is not None and not self.config.keep_stale_prefix:
            self.prefix.clear()  # KV computed by the old weights is stale
        state = self.model.state_dict()
        with torch.no_grad():
            for name, t in tensors.items():
                self.model.hf_target(name, state).copy_(t)
        self.version = version
        self.stats["weight_updates"] += 1
        self.stats["last_swap_seconds"] = time.perf_counter() - t0
        log.info("weights v%d swapped in (%.3f s)", version, self.stats["last_swap_seconds"])

    # -- the loop -----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running or self._update)

    def set_threads(self, n: int) -> None:
        # applied by the step, in the engine's own thread: OpenMP's count belongs to the thread that starts the work
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise EngineError(f"threads must be a positive integer, not {n!r}")
        self._threads_wanted = n  # an RL driver lends its trainer's cores this way (rl/loop.py)

    def step(self) -> None:
        """Apply a thread count and weight update, admit, prefill one chunk, decode one token a sequence."""
        if (n := self._threads_wanted) is not None:
            self._threads_wanted = None
            torch.set_num_threads(n)
            self.threads = torch.get_num_threads()
        self._apply_update()
        self._reap()
        self._admit()
        self._prefill()
        self._decode()

    def _reap(self) -> None:
        with self._cond:
            for g in list(self._waiting):
                if all(s.aborted for s in g.seqs):
                    self._waiting.remove(g)
                    for s in g.seqs:
                        self._finish(s, "abort")
            for g in list(self._prefilling):
                if all(s.aborted for s in g.seqs):
                    self._drop_prefill(g, "abort")
            for slot, s in list(self._running.items()):
                if s.aborted:
                    self._finish(s, "abort")

    def _drop_prefill(self, g: _Group, reason: str, error: str | None = None) -> None:
        """End a group that is still prefilling (called with the condition held)."""
        self._prefilling.remove(g)
        for s in g.seqs:
            s.error = error
            if s.match is not None:
                self.prefix.lock(s.match, -1)
                s.match = None
            self._finish(s, reason)
        self.cache.reset(g.slots)
        if self.mtp_cache is not None:
            self.mtp_cache.reset(g.slots)
        self._free = sorted(self._free + g.slots)

    def _match(self, g: _Group) -> Match | None:
        return self.prefix.match(g.prompt, len(g.prompt) - 1) if self.prefix is not None else None

    def _admit(self) -> None:
        """Waiting groups that fit the free slots start prefilling: the longest cached prefix first
        (cache-aware, as SGLang's longest-prefix-match policy), arrival order otherwise; a group
        passed over `fairness` times goes first and holds back everything behind it until it fits."""
        with self._cond:
            if not self._waiting or not self._free:
                return
            cand = list(itertools.islice(self._waiting, 64))
            matches = {id(g): self._match(g) for g in cand}
            starved = [g for g in cand if g.skipped >= self.config.fairness]
            order = starved or sorted(cand, key=lambda g: -(matches[id(g)].length if matches[id(g)] else 0))
            admitted = []
            for g in order:
                if len(g.seqs) > len(self._free):
                    if g.skipped >= self.config.fairness:
                        break
                    continue
                g.slots = [self._free.pop(0) for _ in g.seqs]
                admitted.append(g)
            if not admitted:
                return
            last = max(cand.index(g) for g in admitted)
            for g in cand[:last]:
                if g not in admitted:
                    g.skipped += 1
            for g in admitted:
                self._waiting.remove(g)
        for g in admitted:
            self._start_prefill(g, matches[id(g)])

    def _start_prefill(self, g: _Group, m: Match | None) -> None:
        """Copy the group's cached prefix into its first slot; the rest is prefilled chunk by chunk.
        With speculative decoding one matched token is recomputed: the MTP's next entry needs the main
        model's hidden state at the last cached position, which the cache does not keep."""
        self.cache.reset(g.slots)
        if self.mtp_cache is not None:
            self.mtp_cache.reset(g.slots)
        use = 0 if m is None else (max(m.length - 1, 0) if self.spec else m.length)
        if use:
            g.experts = self.prefix.load(m, self.cache, g.slots[0], upto=use, mtp_cache=self.mtp_cache)
            g.spans = self.prefix.spans(m, use)
        g.done = use
        version = self.version if not use else min(self.version, m.version)
        for s in g.seqs:
            s.cached_tokens, s.kv_version = use, version
            s.prefix_version = m.version if use else None
            if m is not None and m.path:
                s.match = m
                self.prefix.lock(m)
        self.stats["cached_prompt_tokens"] += use
        self._prefilling.append(g)

    @torch.no_grad()
    def _prefill(self) -> None:
        """One step's share of prompt tokens: `prefill_chunk` while anything decodes, else
        `prefill_tokens`; groups in arrival order, equal-length chunks in one forward."""
        if not self._prefilling:
            return
        decoding = any(s.finish_reason is None for s in self._running.values())
        budget = self.config.prefill_chunk if decoding else self.config.prefill_tokens
        buckets: dict[int, list[_Group]] = {}
        for g in list(self._prefilling):
            if budget <= 0:
                break
            c = min(len(g.prompt) - g.done, budget)
            buckets.setdefault(c, []).append(g)
            budget -= c
        for c, items in buckets.items():
            self._prefill_chunk(sorted(items, key=lambda g: g.slots[0]), c)

    def _prefill_chunk(self, items: list[_Group], c: int) -> None:
        t0 = time.perf_counter()
        ids = torch.tensor([g.prompt[g.done:g.done + c] for g in items])
        rows = [g.slots[0] for g in items]  # ascending: a view of the cache, not a copy
        final = any(g.done + c == len(g.prompt) for g in items)
        out = self.model.run(ids, cache=self.cache, rows=rows, logits="last" if final else False)
        self.stats["prefill_forwards"] += 1
        self.stats["prompt_tokens"] += ids.numel()
        for b, g in enumerate(items):
            if out.routed_experts is not None:
                g.experts.extend(out.routed_experts[b].tolist())
            if self.spec:  # the MTP sees (h_i, token i+1); the chunk's last pair waits for the next token
                h, nxt = out.hidden[b:b + 1], ids[b:b + 1]
                if g.mtp_h is not None:
                    h = torch.cat([g.mtp_h[None, None], h[:, :-1]], 1)
                else:
                    h, nxt = h[:, :-1], nxt[:, 1:]
                if nxt.shape[1]:
                    self.model.mtp_step(h, nxt, self.mtp_cache, [g.slots[0]])
                g.mtp_h = out.hidden[b, -1]
            g.done += c
        self.stats["prefill_seconds"] += time.perf_counter() - t0
        for b, g in enumerate(items):
            if g.done == len(g.prompt):
                self._prefilled(g, out, b)

    def _prefilled(self, g: _Group, out, b: int) -> None:
        """The whole prompt is in the first slot: keep it in the prefix cache, copy it to the
        group's other slots, and sample every sequence's first token."""
        first = g.slots[0]
        with self._cond:
            self._prefilling.remove(g)
        s0 = g.seqs[0]
        spans = merged((*g.spans, (len(g.prompt), g.tag)))
        if self.prefix is not None and (s0.kv_version == self.version or self.config.keep_stale_prefix):
            self.prefix.insert(g.prompt, self.cache, first, s0.kv_version,
                               experts=g.experts if self.is_moe else None, mtp_cache=self.mtp_cache, spans=spans)
        if len(g.slots) > 1:
            self.cache.copy(first, g.slots[1:])
            if self.spec:
                self.mtp_cache.copy(first, g.slots[1:])
        for s, slot in zip(g.seqs, g.slots):
            s.slot = slot
            self._spans[slot] = spans  # the other slots hold copies of the first's
            if self.is_moe:
                s.experts = list(g.experts)
            self._running[slot] = s
            self._emit(s, out.logits[b, -1])
            if self.spec:
                s.pending = [(out.hidden[b, -1], s.tokens[-1])]

    @torch.no_grad()
    def _decode(self) -> None:
        live = [s for s in self._running.values() if s.finish_reason is None and not s.aborted]
        if not live:
            return
        t0 = time.perf_counter()
        live.sort(key=lambda s: s.slot)
        rows = torch.tensor([s.slot for s in live])
        if self.spec and all(len(s.prompt) + len(s.tokens) + 2 <= self.max_len for s in live):
            from opencomposer.inference.speculative import speculate

            speculate(self, live, rows)
        else:
            ids = torch.tensor([[s.tokens[-1]] for s in live])
            self.cache.shared = self._shared_prefix(live)
            try:
                out = self.model.run(ids, cache=self.cache, rows=rows, logits="last")
            finally:
                self.cache.shared = None
            drawn = sample_rows(out.logits[:, -1], [s.params for s in live], [s.gen for s in live])
            for i, s in enumerate(live):
                if out.routed_experts is not None:
                    s.experts.append(out.routed_experts[i, 0].tolist())
                self._append(s, *drawn[i])
                if self.spec:
                    s.pending.append((out.hidden[i, -1], s.tokens[-1]))
        self.stats["decode_steps"] += 1
        self.stats["decode_seconds"] += time.perf_counter() - t0

    def _shared_prefix(self, live: list[Sequence]):
        """The rows of this decode step that read a prefix they share once (`provenance`)."""
        # MLA (the MoE family) decodes through `KVCache.write` and its own attention, not
        # `decode_attend`: nothing there reads a shared prefix
        if not self.config.shared_prefix_attention or self.is_moe or len(live) < 2:
            return None
        shared = shared_rows([(s.slot, self._spans.get(s.slot, ())) for s in live], self.config.shared_prefix_min)
        if shared is not None:
            self.stats["decode_shared_rows"] += len(shared.slots)
        return shared

    def _draft_logits(self, live: list[Sequence]) -> torch.Tensor:
        from opencomposer.inference.speculative import draft_logits

        return draft_logits(self, live)

    def _emit(self, s: Sequence, logits: torch.Tensor) -> None:
        self._append(s, *sample(logits, s.params, s.gen))

    def _append(self, s: Sequence, tok: int, lp: float, top: list) -> None:
        if s.first_token_at is None:
            s.first_token_at = time.monotonic()
        s.tokens.append(tok)
        s.logprobs.append(lp)
        s.versions.append(self.version)
        if s.params.top_logprobs:
            s.top_logprobs.append(top)
        self.stats["generated_tokens"] += 1
        s.events.put(len(s.tokens))
        for w in s.watchers:
            w()
        reason = None
        if tok in self.eos_ids or tok in s.params.stop_token_ids:
            reason = "stop"
        elif s.params.stop and self.decode is not None and len(s.tokens) % self.config.detokenize_every == 0:
            text = self.decode(s.tokens[-64:])
            if any(x in text for x in s.params.stop):
                reason = "stop"
        if reason is None and len(s.tokens) >= s.params.max_tokens:
            reason = "length"
        if reason is None and len(s.prompt) + len(s.tokens) >= self.max_len:
            reason = "length"
        if reason:
            with self._cond:
                self._finish(s, reason)

    def _finish(self, s: Sequence, reason: str) -> None:
        """Called with the condition held."""
        if s.done.is_set():
            return
        s.finish_reason = reason
        if reason == "abort":
            self.stats["aborted"] += 1
        if s.slot is not None and self._running.get(s.slot) is s:
            del self._running[s.slot]
            self._keep(s, reason)
            self._spans.pop(s.slot, None)
            self.cache.reset([s.slot])
            if self.mtp_cache is not None:
                self.mtp_cache.reset([s.slot])
            self._free.append(s.slot)
            self._free.sort()
        s.done.set()
        s.events.put(None)
        for w in s.watchers:
            w()

    def _keep(self, s: Sequence, reason: str) -> None:
        """A finished sequence's KV (prompt + completion) goes into the prefix cache: the next turn
        of its episode starts with exactly these tokens."""
        if self.prefix is None:
            return
        if s.match is not None:
            self.prefix.lock(s.match, -1)
            s.match = None
        if reason == "error" or (s.kv_version != self.version and not self.config.keep_stale_prefix):
            return
        n = int(self.cache.lengths[s.slot])
        if self.spec:  # MTP entries run one behind: keep only positions both caches hold
            n = min(n, int(self.mtp_cache.lengths[s.slot]) + 1)
        full = s.prompt + s.tokens
        self.prefix.insert(full[:n], self.cache, s.slot, s.kv_version,
                           experts=s.experts[:n] if s.experts is not None else None, mtp_cache=self.mtp_cache,
                           spans=self._spans.get(s.slot, ()))

    # -- background thread ------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cond:  # nobody will step these any more: their waiters get an answer now
            for g in list(self._prefilling):
                self._drop_prefill(g, "error", "the engine stopped")
            for s in list(self._running.values()):
                s.error = "the engine stopped"
                self._finish(s, "error")
            while self._waiting:
                for s in self._waiting.popleft().seqs:
                    s.error = "the engine stopped"
                    self._finish(s, "error")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.has_work():
                    self._cond.wait(0.5)
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - fail the sequences, keep serving
                log.exception("engine step failed")
                with self._cond:
                    for g in list(self._prefilling):
                        self._drop_prefill(g, "error", f"{type(e).__name__}: {e}")
                    for s in list(self._running.values()):
                        s.error = f"{type(e).__name__}: {e}"
                        self._finish(s, "error")

