"""The prefix cache and cache-aware, chunked scheduling on tiny real models: exact against the same
engine with the cache off, across turns, samples, both families, speculative decoding, weight
updates, memory pressure, oversized requests and aborts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.inference.engine import Engine, EngineConfig  # noqa: E402
from opencomposer.inference.prefix_cache import PrefixCache  # noqa: E402
from opencomposer.inference.sampling import SamplingParams  # noqa: E402
from tests.unit.test_engine import llama, moe  # noqa: E402
from tests.unit.test_engine import run_all as drain  # noqa: E402


def episode(engine: Engine, turns: int = 4, n: int = 2, seed: int = 0, system: list[int] | None = None):
    """A multi-turn conversation as an agent sends it: each turn's prompt is the previous prompt,
    the first sample's completion, then a 'tool result' (fresh tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompt = list(system or []) + torch.randint(0, 500, (9,), generator=g).tolist()
    out = []
    for t in range(turns):
        seqs = engine.submit(prompt, SamplingParams(temperature=0.8, max_tokens=7, seed=seed * 100 + t), n=n)
        drain(engine)
        out.append(seqs)
        prompt = prompt + seqs[0].tokens + torch.randint(0, 500, (5,), generator=g).tolist()
    return out


def same(a, b, tol=1e-5):
    for ta, tb in zip(a, b, strict=True):
        for x, y in zip(ta, tb, strict=True):
            assert x.tokens == y.tokens
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < tol
            assert x.experts == y.experts  # MoE: the prompt's experts too, cached positions included


@pytest.mark.parametrize("make", [llama, moe], ids=["llama", "moe"])
def test_multi_turn_episodes_are_exact_with_the_cache(make):
    model = make()
    off = Engine(model, config=EngineConfig(slots=4, max_len=128, prefix_cache_mb=0))
    on = Engine(model, config=EngineConfig(slots=4, max_len=128))
    system = torch.randint(0, 500, (20,)).tolist()  # shared by both episodes, like the tool schemas
    ref = episode(off, system=system) + episode(off, seed=1, system=system)
    got = episode(on, system=system) + episode(on, seed=1, system=system)
    same(ref, got)
    assert all(s.cached_tokens == 0 for t in ref for s in t)
    # turn t+1 starts with turn t's prompt + completion: all of that is cached (minus the last
    # sampled token, whose KV is computed by the next prefill)
    for turns in (got[:4], got[4:]):
        for prev, cur in zip(turns, turns[1:]):
            assert cur[0].cached_tokens == len(prev[0].prompt) + len(prev[0].tokens) - 1
    assert got[4][0].cached_tokens == 20  # the second episode's first turn hits the shared system prompt
    assert on.stats["cached_prompt_tokens"] > on.stats["prompt_tokens"]
    assert off.prefix is None and on.prefix.tokens > 0


def test_speculative_decoding_keeps_working_with_the_cache():
    model = moe()
    ref = episode(Engine(model, config=EngineConfig(slots=4, max_len=128, speculative=True, prefix_cache_mb=0)))
    engine = Engine(model, config=EngineConfig(slots=4, max_len=128, speculative=True))
    got = episode(engine)
    same(ref, got)
    assert got[1][0].cached_tokens > 0 and engine.stats["drafted"] > 0


def test_weight_update_invalidates_unless_stale_prefixes_are_kept():
    model = llama()
    prompt = torch.randint(0, 500, (30,)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    state = {k: v.clone() for k, v in model.to_hf_state().items()}
    for keep in (False, True):
        engine = Engine(model, config=EngineConfig(slots=2, max_len=64, keep_stale_prefix=keep))
        engine.generate(prompt, params)
        assert engine.generate(prompt, params)[0].cached_tokens == 29
        engine.update_weights(state, 1)
        s = engine.generate(prompt, params)[0]
        if keep:
            assert s.cached_tokens == 29 and s.prefix_version == 0 and s.versions == [1, 1, 1]
        else:
            assert s.cached_tokens == 0 and s.prefix_version is None
            assert engine.generate(prompt, params)[0].prefix_version == 1  # re-cached under the new weights


def test_memory_pressure_evicts_and_keeps_serving_exactly():
    model = llama()
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x float32 bytes
    budget = 40 * per_token  # room for about two of the prompts below
    small = EngineConfig(slots=2, max_len=64, prefix_cache_mb=1)
    off = Engine(model, config=EngineConfig(slots=2, max_len=64, prefix_cache_mb=0))
    on = Engine(model, config=small)
    on.prefix = PrefixCache(budget)
    prompts = [torch.randint(0, 500, (15,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    params = SamplingParams(temperature=0.7, max_tokens=4, seed=3)
    for _ in range(2):
        for p in prompts:
            a, b = off.generate(p, params)[0], on.generate(p, params)[0]
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
            assert on.prefix.nbytes <= budget
    assert on.prefix.stats["evictions"] > 0
    # a request larger than the whole cache is served, only not kept
    big = torch.randint(0, 500, (50,)).tolist()
    a, b = off.generate(big, params)[0], on.generate(big, params)[0]
    assert a.tokens == b.tokens and on.prefix.stats["refused"] > 0 and on.prefix.nbytes <= budget


def test_abort_of_one_sharer_does_not_touch_the_other():
    model = llama()
    prefix = torch.randint(0, 500, (25,)).tolist()
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=7)
    ref = Engine(model, config=EngineConfig(slots=4, max_len=64, prefix_cache_mb=0))
    want = ref.generate(prefix + [1, 2], params)[0]
    engine = Engine(model, config=EngineConfig(slots=4, max_len=64))
    engine.generate(prefix, SamplingParams(max_tokens=1))  # the shared prefix is cached
    a = engine.submit(prefix + [1, 2], params)[0]
    b = engine.submit(prefix + [3, 4], params)[0]
    for _ in range(4):
        engine.step()
    engine.abort([b])
    drain(engine)
    assert b.finish_reason == "abort" and a.finish_reason == "length"
    assert a.cached_tokens == 25 and b.cached_tokens == 25
    assert a.tokens == want.tokens
    assert max(abs(x - y) for x, y in zip(a.logprobs, want.logprobs)) < 1e-5
    # the aborted sequence's KV went back into the tree and is reusable; nothing stays referenced
    assert engine.prefix.match(prefix + [3, 4] + b.tokens, 100).length >= 27
    assert all(n.refs == 0 for n in _nodes(engine.prefix))


def test_rows_that_share_a_prefix_read_it_once_exactly():
    """Requests that start with one cached system prompt, and the n samples of each, decode with
    that prefix read once per step for all rows (`EngineConfig.shared_prefix_attention`): the same
    tokens and logprobs as the engine that reads it row by row. A request that does not start
    with it decodes beside them."""
    model = llama()
    system = torch.randint(0, 500, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {}
    for on in (False, True):
        engine = Engine(model, config=EngineConfig(slots=6, max_len=160, shared_prefix_attention=on))
        engine.generate(system + [7], SamplingParams(max_tokens=1))  # the system prompt is cached
        g = torch.Generator().manual_seed(1)
        seqs = [s for i in range(2) for s in engine.submit(
            system + torch.randint(0, 500, (3 + 4 * i,), generator=g).tolist(),
            SamplingParams(temperature=0.9, max_tokens=10, seed=i), n=2)]
        seqs += engine.submit(torch.randint(0, 500, (90,), generator=g).tolist(),
                              SamplingParams(temperature=0.9, max_tokens=10, seed=9))
        drain(engine)
        runs[on] = (seqs, engine.stats["decode_shared_rows"])
    (off, n_off), (on, n_on) = runs[False], runs[True]
    same([off], [on])
    assert n_off == 0 and n_on >= 4 * 9  # four rows share it in every step after their first token
    assert [s.cached_tokens for s in on] == [80, 80, 80, 80, 0]


def _nodes(pc: PrefixCache):
    stack = list(pc.root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        yield n


def test_long_prompt_is_prefilled_in_chunks_while_others_decode():
    model = llama()
    params = SamplingParams(temperature=0.0, max_tokens=40)
    engine = Engine(model, config=EngineConfig(slots=2, max_len=256, prefill_chunk=32, prefix_cache_mb=0))
    short = engine.submit(torch.randint(0, 500, (5,)).tolist(), params)[0]
    engine.step()
    long_prompt = torch.randint(0, 500, (150,)).tolist()
    long = engine.submit(long_prompt, SamplingParams(temperature=0.7, max_tokens=5, seed=1))[0]
    steps = 0
    while not long.tokens:
        before = len(short.tokens)
        engine.step()
        steps += 1
        assert len(short.tokens) == before + 1  # the running sequence decodes every step
    assert steps == 5  # ceil(150 / 32) chunks
    drain(engine)
    whole = Engine(model, config=EngineConfig(slots=1, max_len=256, prefix_cache_mb=0))
    ref = whole.generate(long_prompt, SamplingParams(temperature=0.7, max_tokens=5, seed=1))[0]
    assert ref.tokens == long.tokens
    assert max(abs(x - y) for x, y in zip(ref.logprobs, long.logprobs)) < 1e-5


def test_cached_requests_go_first_within_the_fairness_bound():
    model = llama()
    cached = torch.randint(0, 500, (30,)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for fairness, first in ((8, ["b", "c", "a"]), (1, ["b", "a", "c"])):
        engine = Engine(model, config=EngineConfig(slots=1, max_len=64, fairness=fairness))
        engine.generate(cached, params)
        order = []
        seqs = {"a": engine.submit(torch.randint(0, 500, (30,)).tolist(), params)[0],
                "b": engine.submit(cached + [5], params)[0], "c": engine.submit(cached + [6], params)[0]}
        while engine.has_work():
            engine.step()
            for k, s in seqs.items():
                if s.tokens and k not in order:
                    order.append(k)
        assert order == first


def test_radix_tree_splits_locks_and_evicts_lru():
    from opencomposer.model.cache import KVCache

    cache = KVCache(1, 2, 64)
    x = torch.randn(2, 1, 10, 4)
    cache.write(0, torch.tensor([0, 1]), x, x)
    cache.advance(torch.tensor([0, 1]), 10)
    pc = PrefixCache(10 ** 6)
    assert pc.insert(list(range(10)), cache, 0, 0) == 10
    assert pc.insert(list(range(5)) + [99] * 5, cache, 1, 0) == 5  # splits after 5 shared tokens
    assert sorted(len(n.tokens) for n in _nodes(pc)) == [5, 5, 5] and pc.tokens == 15
    m = pc.match(list(range(10)), 100)
    assert m.length == 10
    pc.load(m, cache, 1)
    assert torch.equal(cache._store[0][0][1, :, :10], x[0])  # slot 1 now holds slot 0's KV
    pc.lock(m)
    pc.evict(0)  # the locked path survives, the other branch goes
    assert pc.tokens == 10 and pc.stats["evictions"] == 1
    pc.lock(m, -1)
    pc.evict(0)
    assert pc.tokens == 0 and pc.nbytes == 0 and not pc.root.children


def test_tags_name_the_same_bytes_through_splits_and_inserts():
    """What the engine's shared-prefix decode trusts: positions named by one tag hold the same
    bytes. A split node's halves keep the tag (their positions differ); a node inserted from a slot
    takes the tag of the slot's span it lies in (it is a copy of those bytes), and a fresh one
    otherwise; spans of one tag side by side are one run."""
    from opencomposer.inference.provenance import common_length, merged
    from opencomposer.model.cache import KVCache

    cache = KVCache(1, 2, 64)
    x = torch.randn(2, 1, 12, 4)
    cache.write(0, torch.tensor([0, 1]), x, x)
    cache.advance(torch.tensor([0, 1]), 12)
    pc = PrefixCache(10 ** 6)
    pc.insert(list(range(8)), cache, 0, 0, spans=((8, 41),))  # a copy of a prefill named 41
    (node,) = _nodes(pc)
    assert node.tag == 41
    pc.insert(list(range(12)), cache, 0, 0, spans=((8, 41), (10, 42)))  # [8, 12) is not inside one span
    pc.insert(list(range(4)) + [99] * 4, cache, 1, 0)  # splits the first node after 4 tokens
    tags = {(n.tokens[0], len(n.tokens)): n.tag for n in _nodes(pc)}
    assert tags[(0, 4)] == tags[(4, 4)] == 41 and tags[(8, 4)] not in (41, 42)
    assert tags[(99, 4)] not in (41, 42, tags[(8, 4)])
    spans = pc.spans(pc.match(list(range(12)), 100), 12)
    assert spans == ((8, 41), (12, tags[(8, 4)]))  # the split halves join into one run
    assert merged(((3, 5), (6, 5), (9, 7))) == ((6, 5), (9, 7))
    assert common_length(((8, 41), (12, 3)), ((8, 41), (20, 9))) == 8
    assert common_length(((8, 41),), ((5, 41), (9, 2))) == 5
    assert common_length(((8, 1),), ((8, 2),)) == 0
