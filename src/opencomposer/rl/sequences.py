"""RL training sequences from what the sampler recorded — never from re-rendered text.

Each completion of a trajectory carries the exact ids the sampler was conditioned on
(`prompt_token_ids`) and the ids it sampled (`token_ids`, with their logprobs, policy versions and
routed experts). One completion is one sequence: prompt ids + completion ids, loss on the
completion only. Consecutive completions of one segment are merged into one sequence where the
next prompt starts with the previous prompt + completion (our server renders an assistant turn
from its recorded ids, so within a segment this is the normal case): the shared prefix is then
computed once. A segment boundary (self-summary reset) always starts a new sequence. The merge
rate — merges made / merges possible — says how often a server kept prompts token-exact.

Tokens between two completions of a merged sequence (tool results, the next turn's header) are
prompt: loss 0, logprob 0, version -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opencomposer.core.errors import UserError


class SequenceError(ValueError, UserError):
    """A completion lacks what a token-exact sequence needs (the message says which)."""


@dataclass
class RLSequence:
    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    """The sampler's logprob of each token where loss_mask is 1 (0.0 elsewhere), aligned with ids."""
    versions: list[int]
    """The policy version that sampled each trained token (-1 on prompt tokens)."""
    experts: list | None = None
    """Per position, per MoE layer, the experts the sampler routed to (None: dense, or not recorded);
    the last position has none (-1) since no token was sampled after it."""
    segment: int = 0
    completions: list[int] = field(default_factory=list)
    """Indices (within the segment) of the completions this sequence holds."""
    sampling: dict | None = None
    completion_tokens: list[int] = field(default_factory=list)
    """Trained tokens of each completion in `completions`, in order (empty in records written before
    it existed)."""
    failed_calls: list[int] = field(default_factory=list)
    """Those of `completions` that issued a broken call or a failed edit (`rl/rewards.py`)."""

    calls: list[str] = field(default_factory=list)
    """Per completion in `completions`: the tool it called first ("" for one that called none, such
    as the final message); empty in records written before it existed. With `failed_calls` it is
    the per-call verdict `ObjectiveConfig.call_advantage` credits."""

    copy_errors: list = field(default_factory=list)
    """[completion, nth, old_string, matched] per `search_replace` call of these completions that
    matched nothing (`rl/copy_blame.py`): where its copy left the file. Empty in older records."""

    def call_verdicts(self) -> list[tuple[int, str, bool]]:
        """(completion, tool, ran and applied) for each completion of this sequence that called a tool."""
        if len(self.calls) != len(self.completions):
            return []
        return [(ci, name, ci not in self.failed_calls) for ci, name in zip(self.completions, self.calls) if name]

    def token_call_advantages(self, advantages: dict[int, float]) -> list[float] | None:
        """Per trained token: the advantage of the completion it belongs to (`advantages`, by
        completion index; 0 where absent); None when none applies here or the record does not
        say which tokens are whose."""
        if not any(advantages.get(ci, 0.0) for ci in self.completions) \
                or sum(self.completion_tokens) != self.trained_tokens:
            return None
        return [advantages.get(ci, 0.0) for ci, n in zip(self.completions, self.completion_tokens) for _ in range(n)]

    def token_factors(self, failed: float) -> list[float] | None:
        """Per trained token: `failed` on the tokens of a completion in `failed_calls`, 1 elsewhere;
        None when nothing is scaled (or the record does not say which tokens are whose)."""
        if failed == 1.0 or not self.failed_calls or sum(self.completion_tokens) != self.trained_tokens:
            return None
        return [failed if ci in self.failed_calls else 1.0
                for ci, n in zip(self.completions, self.completion_tokens) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class BuildStats:
    completions: int = 0
    sequences: int = 0
    merges: int = 0
    merge_opportunities: int = 0
    skipped: int = 0

    @property
    def merge_rate(self) -> float:
        return self.merges / self.merge_opportunities if self.merge_opportunities else 1.0


def _get(comp: Any, key: str):
    return comp.get(key) if isinstance(comp, dict) else getattr(comp, key, None)


def _check(comp: Any, where: str) -> None:
    ids, prompt, lps = _get(comp, "token_ids"), _get(comp, "prompt_token_ids"), _get(comp, "logprobs")
    if prompt is None or ids is None:
        raise SequenceError(f"{where}: no {'prompt_token_ids' if prompt is None else 'token_ids'} recorded "
                            "(the server must return them: ours does, vLLM with return_token_ids)")
    if lps is None or len(lps) != len(ids):
        raise SequenceError(f"{where}: {0 if lps is None else len(lps)} logprobs for {len(ids)} sampled tokens")
    versions = _get(comp, "policy_versions")
    if versions is not None and len(versions) != len(ids):
        raise SequenceError(f"{where}: {len(versions)} policy versions for {len(ids)} sampled tokens")
    experts = _get(comp, "routed_experts")
    if experts is not None and len(experts) != len(prompt) + len(ids) - 1:
        raise SequenceError(f"{where}: routed experts for {len(experts)} positions, expected "
                            f"{len(prompt) + len(ids) - 1}")


def _start(comp: Any, segment: int, index: int) -> RLSequence:
    prompt, ids = list(_get(comp, "prompt_token_ids")), list(_get(comp, "token_ids"))
    versions = _get(comp, "policy_versions") or [0] * len(ids)
    experts = _get(comp, "routed_experts")
    return RLSequence(ids=prompt + ids, loss_mask=[0] * len(prompt) + [1] * len(ids),
                      logprobs=[0.0] * len(prompt) + [float(x) for x in _get(comp, "logprobs")],
                      versions=[-1] * len(prompt) + list(versions),
                      experts=[list(e) for e in experts] if experts is not None else None,
                      segment=segment, completions=[index], sampling=_get(comp, "sampling"),
                      completion_tokens=[len(ids)])


def _extend(seq: RLSequence, comp: Any, index: int) -> None:
    prompt, ids = list(_get(comp, "prompt_token_ids")), list(_get(comp, "token_ids"))
    gap = prompt[len(seq.ids):]
    versions = _get(comp, "policy_versions") or [0] * len(ids)
    seq.ids += gap + ids
    seq.loss_mask += [0] * len(gap) + [1] * len(ids)
    seq.logprobs += [0.0] * len(gap) + [float(x) for x in _get(comp, "logprobs")]
    seq.versions += [-1] * len(gap) + list(versions)
    experts = _get(comp, "routed_experts")
    # The later record covers the whole prefix and agrees with the earlier one there (`_mergeable`).
    seq.experts = [list(e) for e in experts] if experts is not None and seq.experts is not None else None
    seq.completions.append(index)
    seq.completion_tokens.append(len(ids))


_NOT_DISTRIBUTION = ("seed", "max_tokens", "stop", "stop_token_ids", "top_logprobs")


def _distribution(sampling: dict | None) -> dict:
    """The sampling parameters that shape the distribution tokens were drawn from. A seeded
    policy sends seed + i with request i, and a turn's token cap says nothing about its logprobs:
    comparing those too kept every turn of a seeded rollout in a sequence of its own (the default
    speedrun's RL merged 0-75% of its turns and trained a 5-turn rollout as five forwards of its
    whole context)."""
    return {k: v for k, v in (sampling or {}).items() if k not in _NOT_DISTRIBUTION}


def _mergeable(seq: RLSequence, comp: Any) -> bool:
    """The next prompt extends the sequence token for token, under the same sampling parameters,
    and (MoE) the sampler routed the shared prefix the same way both times — else one router
    replay cannot reproduce both completions' logprobs (weights changed in between)."""
    prompt = _get(comp, "prompt_token_ids")
    if len(prompt) < len(seq.ids) or list(prompt[: len(seq.ids)]) != seq.ids:
        return False
    if _distribution(seq.sampling) != _distribution(_get(comp, "sampling")):
        return False
    experts = _get(comp, "routed_experts")
    if (seq.experts is None) != (experts is None):
        return False
    return seq.experts is None or [list(e) for e in experts[: len(seq.experts)]] == seq.experts


def build_sequences(trajectory: Any, *, merge: bool = True) -> tuple[list[RLSequence], BuildStats]:
    """Sequences of one trajectory (a Trajectory or its dict), segment by segment."""
    segments = trajectory["segments"] if isinstance(trajectory, dict) else trajectory.segments
    out: list[RLSequence] = []
    stats = BuildStats()
    for si, seg in enumerate(segments):
        comps = seg["completions"] if isinstance(seg, dict) else seg.completions
        cur: RLSequence | None = None
        for ci, comp in enumerate(comps):
            _check(comp, f"segment {si} completion {ci}")
            stats.completions += 1
            if cur is not None:
                stats.merge_opportunities += 1
                if merge and _mergeable(cur, comp):
                    _extend(cur, comp, ci)
                    stats.merges += 1
                    continue
                out.append(cur)
            cur = _start(comp, si, ci)
        if cur is not None:
            out.append(cur)
    stats.sequences = len(out)
    return out, stats
