from __future__ import annotations

import pytest

from opencomposer.evals.metrics import pass_at_k, summarize


def test_pass_at_k_estimator():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(3, 2, 2) == 1.0  # any 2 of 3 contain a success
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def rec(task, k, passed, status=None, **kw):
    base = dict(task=task, pass_=k, category="feature", split="train", completion_tokens=10, seconds=1.0,
                cost_usd=0.0, tool_errors=0, tool_calls=2)
    base.update(kw)
    base["pass"] = base.pop("pass_")
    return {**base, "passed": passed, "status": status or ("passed" if passed else "failed")}


def test_summary():
    records = [rec("a", 0, True), rec("a", 1, False), rec("b", 0, False), rec("b", 1, False),
               rec("c", 0, False, status="infra_error"), rec("c", 1, True, category="bug_fix", completion_tokens=30)]
    s = summarize(records, passes=2)
    assert s["infra_errors"] == 1 and s["tasks"] == 3 and s["episodes"] == 6
    assert s["accuracy"] == pytest.approx(2 / 5)
    assert s["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert s["pass@2"] == pytest.approx(1 / 2)  # only a and b have 2 graded passes: a 1, b 0
    assert s["best_of_2"] == pytest.approx(2 / 3)
    assert s["accuracy_by_category"] == {"bug_fix": 1.0, "feature": 0.25}
    assert s["median_completion_tokens"] == 10
