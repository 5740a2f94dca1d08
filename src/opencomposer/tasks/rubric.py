"""The optional rubric grader: a judge model scores a change beyond its tests.

Public harnesses grade with tests only; Composer 2 also grades code quality and adherence to the
codebase's abstractions with an agentic grader (anchors-env §5.3, report §3.2). This grader asks
any `Policy` (a hosted model, our server) to score a diff against named criteria, each 1-5, with a
reason, as JSON. Its score is reported next to the test result, never instead of it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from opencomposer.harness.policy import Policy, PolicyError

CRITERIA = {
    "correctness": "Does the change do what the request asks, without breaking other behaviour?",
    "abstractions": "Does it reuse the codebase's existing functions, types and patterns instead of inventing new ones?",
    "quality": "Is it readable, idiomatic for this codebase, free of dead code, debugging leftovers and hacks?",
    "scope": "Does it stay focused on the request (no unrelated edits, no edits to tests to make them pass)?",
}

SYSTEM = """You review code changes made by a coding agent. Score the change on each criterion from 1 (poor) to 5 \
(excellent). Reply with JSON only: {"scores": {"<criterion>": {"score": <1-5>, "reason": "<one sentence>"}}}."""


@dataclass(frozen=True)
class RubricResult:
    scores: dict[str, int]
    reasons: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def mean(self) -> float | None:
        return sum(self.scores.values()) / len(self.scores) / 5.0 if self.scores else None


def grade_rubric(judge: Policy, request: str, diff: str, *, criteria: dict[str, str] | None = None,
                 max_diff_chars: int = 60_000) -> RubricResult:
    criteria = criteria or CRITERIA
    listing = "\n".join(f"- {k}: {v}" for k, v in criteria.items())
    clipped = diff if len(diff) <= max_diff_chars else diff[:max_diff_chars] + "\n[... diff truncated ...]"
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Request:\n{request}\n\nCriteria:\n{listing}\n\nChange:\n```diff\n{clipped}\n```"}]
    try:
        text = judge.complete(msgs, []).content or ""
    except PolicyError as e:
        return RubricResult({}, error=f"judge failed: {e}")
    return parse_scores(text, criteria)


def parse_scores(text: str, criteria: dict[str, str]) -> RubricResult:
    match = re.search(r"\{.*\}", text, re.S)
    if not match:
        return RubricResult({}, error=f"judge reply has no JSON: {text[:200]!r}")
    try:
        data = json.loads(match.group(0))
    except json.JSONDecodeError as e:
        return RubricResult({}, error=f"judge reply is not valid JSON: {e}")
    raw = data.get("scores", data) if isinstance(data, dict) else {}
    scores, reasons = {}, {}
    for name in criteria:
        item = raw.get(name)
        value = item.get("score") if isinstance(item, dict) else item
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value <= 5:
            scores[name] = int(round(value))
            if isinstance(item, dict) and isinstance(item.get("reason"), str):
                reasons[name] = item["reason"]
    missing = [c for c in criteria if c not in scores]
    return RubricResult(scores, reasons, error=f"missing or invalid scores: {missing}" if missing else None)
