"""Benchmark metrics (report §7): accuracy averaged over passes, pass@k, best-of-K, tokens, latency, cost.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of which c pass,
pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks. best-of-K is the share of tasks where at
least one of the K passes succeeded (an oracle selector; report §3.5 selects with a verifier).
Infrastructure failures are counted apart and excluded from accuracy.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def wilson(outcomes, z: float = 1.96) -> list[float] | None:
    """The 95% Wilson score interval of a pass rate. It treats episodes as independent; several
    samples of one task are correlated, so with few tasks the true interval is wider."""
    n = len(outcomes)
    if not n:
        return None
    p = sum(bool(x) for x in outcomes) / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def summarize(records: list[dict], passes: int) -> dict:
    graded = [r for r in records if r["status"] != "infra_error"]
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in graded:
        by_task[r["task"]].append(r)
    out: dict = {
        "episodes": len(records),
        "infra_errors": len(records) - len(graded),
        "tasks": len(by_task),
        "accuracy": _mean([r["passed"] for r in graded]),
        "accuracy_ci95": wilson([r["passed"] for r in graded]),
    }
    for k in range(1, passes + 1):
        vals = [pass_at_k(len(rs), sum(r["passed"] for r in rs), k) for rs in by_task.values() if len(rs) >= k]
        out[f"pass@{k}"] = _mean(vals)
    out[f"best_of_{passes}"] = _mean([any(r["passed"] for r in rs) for rs in by_task.values()])
    for key in ("category", "split"):
        groups: dict[str, list[bool]] = defaultdict(list)
        for r in graded:
            groups[r.get(key) or "?"].append(r["passed"])
        out[f"accuracy_by_{key}"] = {g: _mean(v) for g, v in sorted(groups.items())}
    out["median_completion_tokens"] = _median([r["completion_tokens"] for r in graded])
    out["median_latency_s"] = _median([r["seconds"] for r in graded])
    out["mean_cost_usd"] = _mean([r["cost_usd"] for r in graded])
    out["tool_error_rate"] = _mean([r["tool_errors"] / max(1, r["tool_calls"]) for r in graded])
    rubric = [r["rubric"] for r in graded if r.get("rubric") is not None]
    out["mean_rubric"] = _mean(rubric)
    out["statuses"] = dict(sorted(_count(r["status"] for r in records).items()))
    return out


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else None


def _median(xs) -> float | None:
    return statistics.median(xs) if xs else None


def _count(xs) -> dict:
    out: dict = defaultdict(int)
    for x in xs:
        out[x] += 1
    return out
