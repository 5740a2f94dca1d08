"""RL sequences from recorded ids (rl/sequences.py) and the compact token arrays of trajectories."""

from __future__ import annotations

import json

import pytest

from opencomposer.harness.trajectory import Segment, Trajectory, TrajectoryError, tokens_path
from opencomposer.rl.sequences import build_sequences


def comp(prompt, ids, lps=None, experts=None, sampling=None):
    return {"prompt_token_ids": prompt, "token_ids": ids, "logprobs": lps or [-0.5] * len(ids),
            "policy_versions": [3] * len(ids), "routed_experts": experts, "sampling": sampling or {"temperature": 1.0}}


def test_merge_where_the_next_prompt_extends_and_nowhere_else():
    a = comp([1, 2], [3, 4])
    b = comp([1, 2, 3, 4, 9, 9], [5])           # extends a: merged, tool tokens 9 9 are prompt
    c = comp([1, 2, 7], [8])                     # does not extend: a new sequence
    seqs, st = build_sequences({"segments": [{"completions": [a, b, c]}, {"completions": [comp([1], [2])]}]})
    assert [s.ids for s in seqs] == [[1, 2, 3, 4, 9, 9, 5], [1, 2, 7, 8], [1, 2]]
    assert seqs[0].loss_mask == [0, 0, 1, 1, 0, 0, 1] and seqs[0].versions == [-1, -1, 3, 3, -1, -1, 3]
    assert seqs[0].logprobs == [0, 0, -0.5, -0.5, 0, 0, -0.5] and seqs[0].completions == [0, 1]
    assert st.merges == 1 and st.merge_opportunities == 2 and st.merge_rate == 0.5
    assert [s.segment for s in seqs] == [0, 0, 1]  # a segment boundary always starts anew
    # Different sampling parameters cannot share one sequence (the logprobs were taken differently).
    seqs, st = build_sequences({"segments": [{"completions": [a, {**b, "sampling": {"temperature": 0.5}}]}]})
    assert len(seqs) == 2 and st.merges == 0
    # A seeded policy's per-request seed and a turn's token cap do not change the distribution: merged.
    sa, sb = ({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": m, "seed": 27 + i} for i, m in ((0, 128),
                                                                                                        (1, 64)))
    seqs, st = build_sequences({"segments": [{"completions": [{**a, "sampling": sa}, {**b, "sampling": sb}]}]})
    assert len(seqs) == 1 and st.merges == 1 and seqs[0].sampling == sa
    seqs, st = build_sequences({"segments": [{"completions": [{**a, "sampling": sa},
                                                              {**b, "sampling": {**sb, "top_p": 0.9}}]}]})
    assert len(seqs) == 2  # truncation changes what was sampled from: not merged


def test_moe_prefix_routed_differently_is_not_merged():
    e1 = [[[0, 1]], [[1, 2]], [[2, 3]]]                      # 3 positions for prompt 2 + 2 tokens
    same = e1 + [[[0, 0]], [[1, 1]], [[2, 2]]]               # extends, same prefix routing
    other = [[[5, 6]]] + e1[1:] + [[[0, 0]], [[1, 1]], [[2, 2]]]
    a = comp([1, 2], [3, 4], experts=e1)
    seqs, _ = build_sequences({"segments": [{"completions": [a, comp([1, 2, 3, 4, 9], [5, 6], experts=same)]}]})
    assert len(seqs) == 1 and seqs[0].experts == same
    seqs, _ = build_sequences({"segments": [{"completions": [a, comp([1, 2, 3, 4, 9], [5, 6], experts=other)]}]})
    assert len(seqs) == 2


def test_trajectory_token_arrays_round_trip_and_fail_clearly(tmp_path):
    experts = [[[i % 7, (i + 1) % 7] for _ in range(3)] for i in range(9)]
    c = comp(list(range(5)), [7, 8, 9, 2, 1], lps=[-0.1, -0.25, -1e-3, -2.0, -0.75], experts=experts)
    msg = {"role": "assistant", "content": "x", "opencomposer": {"token_ids": [7, 8, 9, 2, 1]}}
    t = Trajectory(id="t", task="x", policy="p", segments=[Segment(0, messages=[msg], completions=[c])])
    p = t.save(tmp_path / "a.json")
    raw = json.loads(p.read_text())["segments"][0]
    assert raw["completions"][0]["routed_experts"] == {"array": "s0.c0.routed_experts"}
    assert raw["messages"][0]["opencomposer"]["token_ids"] == {"array": "s0.m0.token_ids"}
    back = Trajectory.load(p)
    assert back.segments[0].completions[0] == c and back.segments[0].messages[0] == msg
    tokens_path(p).write_bytes(b"garbage")
    with pytest.raises(TrajectoryError, match="unreadable"):
        Trajectory.load(p)
    tokens_path(p).unlink()
    with pytest.raises(TrajectoryError, match="missing"):
        Trajectory.load(p)
    # Ragged experts (no rectangular array) stay in the JSON, and still round-trip.
    ragged = Trajectory(id="r", task="x", policy="p",
                        segments=[Segment(0, completions=[comp([1], [2], experts=[[[1], [1, 2]]])])])
    assert Trajectory.load(ragged.save(tmp_path / "r.json")).segments[0].completions[0]["routed_experts"] == \
        [[[1], [1, 2]]]


def test_the_policy_calls_that_failed_a_tool_call_are_found_and_their_tokens_located():
    """`completions_with_failed_calls` finds each policy call that issued a broken call or a failed
    edit (by the tool call's id, within its segment: ids repeat across segments), and a merged
    sequence knows which of its trained tokens each call sampled."""
    from opencomposer.rl.rewards import completions_with_failed_calls

    def call(i):
        return [{"id": f"c{i}", "name": "search_replace", "arguments": "{}"}]

    a, b, c = comp([1, 2], [3, 4]), comp([1, 2, 3, 4, 9], [5, 6, 7]), comp([1, 2, 3, 4, 9, 5, 6, 7, 9], [8])
    traj = {"segments": [{"completions": [{**a, "tool_calls": call(0)}, {**b, "tool_calls": call(1)},
                                          {**c, "tool_calls": []}]},
                         {"completions": [{**comp([1], [2]), "tool_calls": call(1)}]}],
            "tool_calls": [{"segment": 0, "id": "c0", "name": "search_replace", "error_type": None},
                           {"segment": 0, "id": "c1", "name": "search_replace", "error_type": "NoMatch"},
                           {"segment": 1, "id": "c1", "name": "search_replace", "error_type": None}]}
    assert completions_with_failed_calls(traj) == {(0, 1)}
    traj["tool_calls"][2]["error_type"] = "MalformedArguments"  # a broken call counts too
    assert completions_with_failed_calls(traj) == {(0, 1), (1, 0)}
    traj["tool_calls"][0]["error_type"] = "NoMatch"
    traj["tool_calls"][0]["name"] = "grep"  # a search that found nothing is not a failed edit
    assert completions_with_failed_calls(traj) == {(0, 1), (1, 0)}

    from opencomposer.rl.rewards import completion_calls  # `call_advantage`'s verdicts: tool called first, ok
    # a grep that found nothing ran as written; the final message (0, 2) called nothing
    assert completion_calls(traj) == {(0, 0): ("grep", True), (0, 1): ("search_replace", False),
                                      (1, 0): ("search_replace", False)}

    seqs, _ = build_sequences(traj)
    assert seqs[0].completions == [0, 1, 2] and seqs[0].completion_tokens == [2, 3, 1]
    seqs[0].failed_calls = [1]
    assert seqs[0].token_factors(0.0) == [1, 1, 0, 0, 0, 1]
    assert seqs[0].token_factors(1.0) is None  # nothing scaled
    seqs[0].calls = ["grep", "search_replace", ""]
    assert seqs[0].call_verdicts() == [(0, "grep", True), (1, "search_replace", False)]
    assert seqs[0].token_call_advantages({1: -0.5}) == [0, 0, -0.5, -0.5, -0.5, 0]
    assert seqs[0].token_call_advantages({0: 0.0}) is None  # nothing applies
    seqs[0].completion_tokens = []  # a record written before the field existed: left as it is
    assert seqs[0].token_factors(0.0) is None and seqs[0].token_call_advantages({1: -0.5}) is None
