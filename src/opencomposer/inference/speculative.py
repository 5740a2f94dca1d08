"""MTP speculative decoding for the engine: the model's first MTP head drafts one token per step and
the main model verifies it in the same forward as the next one (DeepSeek-V3's MTP). Functions of
the engine (each takes the `Engine`), kept apart so the engine module stays about scheduling.
"""

from __future__ import annotations

import torch

from opencomposer.inference.sampling import distribution, speculative_accept, token_info


def draft_logits(engine, live: list) -> torch.Tensor:
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
        out = engine.model.mtp_step(h, nxt, engine.mtp_cache, [live[i].slot for i in idx])
        if w == depth - 1:
            logits = out[:, 0]
    for s in live:
        s.pending = []
    return logits

def speculate(engine, live: list, rows: torch.Tensor) -> None:
    q_logits = engine._draft_logits(live)
    drafts, qs = [], []
    for i, s in enumerate(live):
        q = distribution(q_logits[i], s.params)
        qs.append(q)
        drafts.append(int(q.argmax()) if s.params.temperature == 0 else
                      int(torch.multinomial(q, 1, generator=s.gen)))
    ids = torch.tensor([[s.tokens[-1], d] for s, d in zip(live, drafts)])
    out = engine.model.run(ids, cache=engine.cache, rows=rows)
    engine.stats["drafted"] += len(live)
    for i, s in enumerate(live):
        p = distribution(out.logits[i, 0], s.params)
        ok, tok = speculative_accept(p, qs[i], drafts[i], s.gen)
        if out.routed_experts is not None:
            s.experts.append(out.routed_experts[i, 0].tolist())
        engine._append(s, tok, *token_info(out.logits[i, 0], s.params, tok))
        if not ok:
            if s.finish_reason is None:
                engine.cache.lengths[s.slot] -= 1  # drop the rejected draft's KV
                s.pending = [(out.hidden[i, 0], tok)]
            continue
        engine.stats["accepted"] += 1
        if s.finish_reason is not None:
            continue
        if out.routed_experts is not None:
            s.experts.append(out.routed_experts[i, 1].tolist())
        engine._emit(s, out.logits[i, 1])
        s.pending = [(out.hidden[i, 0], tok), (out.hidden[i, 1], s.tokens[-1])]
