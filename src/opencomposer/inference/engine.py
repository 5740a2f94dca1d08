"""The sampling engine: continuous batching over a slot KV cache, with everything RL needs per token.

One engine owns one model. Requests wait in a FIFO; a request of n samples (the G rollouts of one
prompt) is prefilled once and its cache copied into n slots (prefix sharing). Each `step()` admits
what fits, then decodes every running sequence in one batched forward. For each sampled token the
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

from opencomposer.inference.sampling import SamplingParams, distribution, sample, speculative_accept, token_info

log = logging.getLogger(__name__)


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


@dataclass
class _Group:
    prompt: list[int]
    seqs: list[Sequence]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    slots: int = 32
    """Concurrent sequences (KV-cache slots)."""
    max_len: int | None = None
    """Tokens per sequence, prompt included (default: the model's max_position_embeddings)."""
    detokenize_every: int = 1
    """Check stop strings every this many tokens."""
    prefill_tokens: int = 8192
    """Most prompt tokens prefilled in one forward (equal-length prompts are batched)."""
    speculative: bool = False
    """MTP speculative decoding: the model's first MTP head drafts one token per step, the main
    model verifies it in the same forward as the next one (models with MTP heads only)."""
    max_waiting: int = 256
    """Sequences queued for a slot at most; past it `submit` raises EngineBusy (a server answers 429)."""


class Engine:
    def __init__(self, model, *, config: EngineConfig | None = None, eos_ids: tuple[int, ...] = (),
                 decode=None, version: int = 0):
        self.model = model.eval()
        self.config = config or EngineConfig()
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
        self._running: dict[int, Sequence] = {}
        self._cond = threading.Condition()
        self._update: tuple[dict, int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "decode_steps": 0,
                      "decode_seconds": 0.0, "weight_updates": 0, "aborted": 0,
                      "drafted": 0, "accepted": 0}

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
            return {"running": len(self._running), "waiting": sum(len(g.seqs) for g in self._waiting),
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
        return bool(self._waiting or self._running or self._update)

    def step(self) -> None:
        """Apply a pending weight update, admit waiting groups, decode one token for all running."""
        self._apply_update()
        self._reap()
        with self._cond:
            admit = []
            while self._waiting and len(self._waiting[0].seqs) <= len(self._free):
                g = self._waiting.popleft()
                slots = [self._free.pop(0) for _ in g.seqs]
                admit.append((g, slots))
        self._prefill(admit)
        self._decode()

    def _reap(self) -> None:
        with self._cond:
            for g in list(self._waiting):
                if all(s.aborted for s in g.seqs):
                    self._waiting.remove(g)
                    for s in g.seqs:
                        self._finish(s, "abort")
            for slot, s in list(self._running.items()):
                if s.aborted:
                    self._finish(s, "abort")

    @torch.no_grad()
    def _prefill(self, admit: list[tuple[_Group, list[int]]]) -> None:
        """Prompts of equal length are prefilled together in one forward (up to
        `prefill_tokens` tokens); each group's first slot is then copied to its other slots."""
        buckets: dict[int, list[tuple[_Group, list[int]]]] = {}
        for g, slots in admit:
            buckets.setdefault(len(g.prompt), []).append((g, slots))
        for length, items in buckets.items():
            per = max(1, self.config.prefill_tokens // length)
            for i in range(0, len(items), per):
                self._prefill_batch(items[i:i + per])

    def _prefill_batch(self, items: list[tuple[_Group, list[int]]]) -> None:
        cache = self.cache
        firsts = [slots[0] for _, slots in items]
        every = [s for _, slots in items for s in slots]
        cache.reset(every)
        order = sorted(range(len(items)), key=lambda i: firsts[i])  # ascending slots: a view, not a copy
        items = [items[i] for i in order]
        ids = torch.tensor([g.prompt for g, _ in items])
        rows = [slots[0] for _, slots in items]
        out = self.model.run(ids, cache=cache, rows=rows, logits="last")
        if self.spec:  # the MTP sees (h_i, token i+1) for the prompt; the last pair waits for the sample
            self.mtp_cache.reset(every)
            if ids.shape[1] > 1:
                self.model.mtp_step(out.hidden[:, :-1], ids[:, 1:], self.mtp_cache, rows)
        for b, (g, slots) in enumerate(items):
            if len(slots) > 1:
                cache.copy(slots[0], slots[1:])
                if self.spec:
                    self.mtp_cache.copy(slots[0], slots[1:])
            self.stats["prompt_tokens"] += len(g.prompt)
            experts = out.routed_experts[b].tolist() if out.routed_experts is not None else None
            for s, slot in zip(g.seqs, slots):
                s.slot = slot
                if experts is not None:
                    s.experts = list(experts)
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
            self._speculate(live, rows)
        else:
            ids = torch.tensor([[s.tokens[-1]] for s in live])
            out = self.model.run(ids, cache=self.cache, rows=rows, logits="last")
            for i, s in enumerate(live):
                if out.routed_experts is not None:
                    s.experts.append(out.routed_experts[i, 0].tolist())
                self._emit(s, out.logits[i, -1])
                if self.spec:
                    s.pending.append((out.hidden[i, -1], s.tokens[-1]))
        self.stats["decode_steps"] += 1
        self.stats["decode_seconds"] += time.perf_counter() - t0

    def _draft_logits(self, live: list[Sequence]) -> torch.Tensor:
        """Feed every row's pending (hidden, next token) pairs to the MTP, oldest first, in waves
        aligned at the newest pair (rows have 1 or 2 pending); the last wave's logits are the
        drafts' distributions. Returns (R, V)."""
        depth = max(len(s.pending) for s in live)
        logits = None
        for w in range(depth):
            idx = [i for i, s in enumerate(live) if len(s.pending) >= depth - w]
            pairs = [live[i].pending[len(live[i].pending) - (depth - w)] for i in idx]
            h = torch.stack([p[0] for p in pairs])[:, None]
            nxt = torch.tensor([[p[1]] for p in pairs])
            out = self.model.mtp_step(h, nxt, self.mtp_cache, [live[i].slot for i in idx])
            if w == depth - 1:
                logits = out[:, 0]
        for s in live:
            s.pending = []
        return logits

    def _speculate(self, live: list[Sequence], rows: torch.Tensor) -> None:
        q_logits = self._draft_logits(live)
        drafts, qs = [], []
        for i, s in enumerate(live):
            q = distribution(q_logits[i], s.params)
            qs.append(q)
            drafts.append(int(q.argmax()) if s.params.temperature == 0 else
                          int(torch.multinomial(q, 1, generator=s.gen)))
        ids = torch.tensor([[s.tokens[-1], d] for s, d in zip(live, drafts)])
        out = self.model.run(ids, cache=self.cache, rows=rows)
        self.stats["drafted"] += len(live)
        for i, s in enumerate(live):
            p = distribution(out.logits[i, 0], s.params)
            ok, tok = speculative_accept(p, qs[i], drafts[i], s.gen)
            if out.routed_experts is not None:
                s.experts.append(out.routed_experts[i, 0].tolist())
            self._append(s, tok, *token_info(out.logits[i, 0], s.params, tok))
            if not ok:
                if s.finish_reason is None:
                    self.cache.lengths[s.slot] -= 1  # drop the rejected draft's KV
                    s.pending = [(out.hidden[i, 0], tok)]
                continue
            self.stats["accepted"] += 1
            if s.finish_reason is not None:
                continue
            if out.routed_experts is not None:
                s.experts.append(out.routed_experts[i, 1].tolist())
            self._emit(s, out.logits[i, 1])
            s.pending = [(out.hidden[i, 0], tok), (out.hidden[i, 1], s.tokens[-1])]

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
            self.cache.reset([s.slot])
            if self.mtp_cache is not None:
                self.mtp_cache.reset([s.slot])
            self._free.append(s.slot)
            self._free.sort()
        s.done.set()
        s.events.put(None)
        for w in s.watchers:
            w()

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
                    for s in list(self._running.values()):
                        s.error = f"{type(e).__name__}: {e}"
                        self._finish(s, "error")


def read_update(folder, model) -> dict[str, torch.Tensor]:
    """Read a weight update (a Hugging Face folder's safetensors) for `Engine.update_weights`;
    unreadable files are named."""
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise WeightUpdateError(f"{folder}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001
            raise WeightUpdateError(f"{f}: unreadable safetensors ({e})") from None
    return tensors


def checksum(folder) -> str:
    """sha256 over the folder's safetensors files in name order (what an update request quotes)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
