"""The sampling engine on tiny real models: batching, sampling, prefix sharing, aborts, in-flight
weight updates, and the train/serve numerics check."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.inference.engine import Engine, EngineConfig, EngineError, WeightUpdateError  # noqa: E402
from opencomposer.inference.sampling import SamplingError, SamplingParams, sample  # noqa: E402
from opencomposer.model.deepseek import DeepseekModel, preset  # noqa: E402
from opencomposer.model.llama import PRESETS, LlamaModel  # noqa: E402
from opencomposer.model.loss import token_logprobs  # noqa: E402


def llama():
    torch.manual_seed(0)
    return LlamaModel(PRESETS["tiny"]).eval()


def moe():
    torch.manual_seed(0)
    return DeepseekModel(preset("tiny-moe")).eval()


def run_all(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not drain")


def recomputed_logprobs(model, seq, temperature):
    ids = torch.tensor([seq.prompt + seq.tokens])
    with torch.no_grad():
        h = model.run(ids, logits=False).hidden
        return token_logprobs(h[:, len(seq.prompt) - 1:-1], model.lm_head.weight, torch.tensor([seq.tokens]),
                              temperature)[0]


@pytest.mark.parametrize("make", [llama, moe], ids=["llama", "moe"])
@pytest.mark.parametrize("scale", [1, 2], ids=["6 rows", "12 rows"])
def test_batched_sampling_matches_a_training_forward(make, scale):
    """The train/serve numerics check: logprobs from ragged batched decoding equal a training-mode
    forward over the same tokens; at 12 rows the decode kernel's products take more than 8 rows (on
    the AMX form where it runs)."""
    model = make()
    engine = Engine(model, config=EngineConfig(slots=6 * scale, max_len=64))
    seqs = []
    for n, length in ((2, 5), (1, 11), (3, 2)):
        seqs += engine.submit(torch.randint(0, 512, (length,)).tolist(), SamplingParams(temperature=0.7, max_tokens=9,
                                                                                         seed=3), n=n * scale)
    run_all(engine)
    for s in seqs:
        assert s.finish_reason == "length" and len(s.tokens) == 9 and s.versions == [0] * 9
        assert (recomputed_logprobs(model, s, 0.7) - torch.tensor(s.logprobs)).abs().max() < 1e-4
    assert sorted(engine._free) == list(range(6 * scale)) and not engine._running


def test_moe_experts_replay_through_the_model():
    model = moe()
    engine = Engine(model, config=EngineConfig(slots=2, max_len=64))
    (s,) = engine.generate(torch.randint(0, 512, (6,)).tolist(), SamplingParams(temperature=1.0, max_tokens=8, seed=0))
    experts = torch.tensor(s.experts)  # (positions, layers, k): every input position but the last token
    assert experts.shape == (6 + 8 - 1, model.config.num_moe_layers, model.config.num_experts_per_tok)
    replay = torch.cat([experts, torch.full((1, *experts.shape[1:]), -1)])[None]
    ids = torch.tensor([s.prompt + s.tokens])
    with torch.no_grad():
        out = model.run(ids, replay=replay)
        plain = model.run(ids)
    assert torch.equal(out.routed_experts[0, :-1], experts)
    assert torch.allclose(out.logits, plain.logits, atol=1e-5)
    assert all(st.mismatch == 0.0 for st in out.router)


def test_n_samples_share_a_prefill_in_a_long_context():
    """n > 1 copies one slot's cache into the others; at a context of 1024 positions and more that
    copy once raised (index_put refused a source that shares memory with its target), so every
    n > 1 request to a server at the model's full context failed."""
    model = llama()
    engine = Engine(model, config=EngineConfig(slots=4, max_len=1024))
    seqs = engine.generate(list(range(1, 101)), SamplingParams(temperature=1.0, max_tokens=4, seed=1), n=3)
    assert [len(s.tokens) for s in seqs] == [4, 4, 4]


def test_prefix_sharing_and_seeds():
    model = llama()
    engine = Engine(model, config=EngineConfig(slots=4, max_len=64))
    prompt = torch.randint(0, 512, (7,)).tolist()
    a = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=42), n=3)
    b = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=42), n=3)
    assert [s.tokens for s in a] == [s.tokens for s in b]            # seeded: reproducible
    assert len({tuple(s.tokens) for s in a}) > 1                      # each sample has its own stream
    greedy = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), n=2)
    assert greedy[0].tokens == greedy[1].tokens
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy[0].tokens == ids[7:]  # the cache-shared decode equals plain greedy


def test_sampling_filters_and_validation():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(top_k=1), gen)[0] for _ in range(20)} == {0}
    assert {sample(logits, SamplingParams(top_p=0.3), gen)[0] for _ in range(20)} == {0}
    assert {sample(logits, SamplingParams(top_k=2), gen)[0] for _ in range(100)} == {0, 1}
    tok, lp, top = sample(logits, SamplingParams(temperature=0.0, top_logprobs=2), gen)
    assert tok == 0 and abs(lp - float(torch.log_softmax(logits, -1)[0])) < 1e-6 and [t for t, _ in top] == [0, 1]
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0), dict(top_logprobs=50)):
        with pytest.raises(SamplingError):
            SamplingParams(**bad).validate()



def test_draw_follows_the_distribution_and_never_picks_zero_mass():
    from opencomposer.inference.sampling import draw

    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    counts = torch.zeros(6)
    for _ in range(20000):
        counts[draw(p, gen)] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert (counts / counts.sum() - p).abs().max() < 0.015
    assert draw(torch.tensor([0.0, 1.0, 0.0]), gen) == 1

def test_batched_sampling_equals_row_by_row():
    """The decode step samples all rows at once (`sample_rows`); every row must get the token, the
    log-probability, the alternatives and the generator state that `sample` gives it alone."""
    from opencomposer.inference.sampling import sample_rows

    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.3, top_logprobs=3),
              SamplingParams(temperature=0.5, top_p=0.9)]
    for trial in range(30):
        logits = torch.randn(len(params), 300) * 3
        logits[2, 5] = 1e4  # a one-hot row: argmax, no draw
        g1 = [torch.Generator().manual_seed(trial * 10 + i) for i in range(len(params))]
        g2 = [torch.Generator().manual_seed(trial * 10 + i) for i in range(len(params))]
        alone = [sample(logits[i], p, g1[i]) for i, p in enumerate(params)]
        batched = sample_rows(logits, params, g2)
        for a, b in zip(alone, batched):
            assert a[0] == b[0] and abs(a[1] - b[1]) < 1e-6 and [t for t, _ in a[2]] == [t for t, _ in b[2]]
        assert [float(torch.rand((), generator=g)) for g in g1] == [float(torch.rand((), generator=g)) for g in g2]
    assert sample_rows(logits[:0], [], []) == []


@pytest.mark.parametrize("temps", [(1.0,) * 4, (0.0,) * 4, (1.0, 1.0, 0.0, 1.0), (2.0,) * 4])
@pytest.mark.parametrize("one_hot", [False, True])
def test_batched_sampling_skips_nothing_a_row_needs(temps, one_hot):
    """`sample_rows` divides by no temperature of 1, and runs the argmax and the copies only for the
    rows that need them (all rows at 1, all greedy, one greedy row among sampled ones, a one-hot row
    that draws nothing): each row still gets what `sample` gives it alone."""
    from opencomposer.inference.sampling import sample_rows

    params = [SamplingParams(temperature=t, top_logprobs=2 if i == 1 else 0) for i, t in enumerate(temps)]
    for trial in range(10):
        logits = torch.randn(len(params), 500) * 4
        if one_hot:
            logits[0, 7] = 1e4
        g1 = [torch.Generator().manual_seed(trial * 10 + i) for i in range(len(params))]
        g2 = [torch.Generator().manual_seed(trial * 10 + i) for i in range(len(params))]
        alone = [sample(logits[i], p, g1[i]) for i, p in enumerate(params)]
        assert sample_rows(logits, params, g2) == alone
        assert [float(torch.rand((), generator=g)) for g in g1] == [float(torch.rand((), generator=g)) for g in g2]


def test_bad_requests_and_limits():
    engine = Engine(llama(), config=EngineConfig(slots=2, max_len=16))
    with pytest.raises(EngineError, match="context is 16"):
        engine.submit(list(range(16)), SamplingParams())
    with pytest.raises(EngineError, match="n must be"):
        engine.submit([1, 2], SamplingParams(), n=3)
    with pytest.raises(EngineError, match="token ids"):
        engine.submit([1, 99999], SamplingParams())
    with pytest.raises(EngineError, match="integers"):
        engine.submit([True, 2], SamplingParams())
    (s,) = engine.generate(list(range(10)), SamplingParams(max_tokens=100, seed=0))
    assert s.finish_reason == "length" and len(s.prompt) + len(s.tokens) == 16


def test_continuous_batching_and_abort():
    engine = Engine(llama(), config=EngineConfig(slots=2, max_len=128))
    p = SamplingParams(max_tokens=50, seed=0)
    first = engine.submit([1, 2, 3], p)
    engine.step()
    second = engine.submit([4, 5], p)   # joins while the first is running
    third = engine.submit([6], p)       # waits: no free slot
    engine.step()
    assert len(engine._running) == 2 and len(engine._waiting) == 1
    engine.abort(first)
    engine.step()                       # the abort frees a slot; the third is admitted
    assert first[0].finish_reason == "abort" and third[0].slot is not None
    run_all(engine)
    assert second[0].finish_reason == third[0].finish_reason == "length"
    assert engine.stats["aborted"] == 1


def test_in_flight_weight_update_tags_versions():
    model = llama()
    engine = Engine(model, config=EngineConfig(slots=2, max_len=128))
    seqs = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, seed=0))
    for _ in range(5):
        engine.step()
    new = {k: v + 0.01 for k, v in model.to_hf_state().items()}
    with pytest.raises(WeightUpdateError, match="has shape"):
        engine.update_weights({"model.norm.weight": torch.ones(3)}, 1)
    with pytest.raises(WeightUpdateError, match="NaN"):
        engine.update_weights({"model.norm.weight": torch.full((64,), float("nan"))}, 1)
    with pytest.raises(WeightUpdateError, match="unknown tensor"):
        engine.update_weights({"model.nope": torch.ones(1)}, 1)
    assert engine.version == 0 and torch.equal(model.norm.weight, torch.ones(64))  # untouched
    before = len(seqs[0].tokens)
    engine.update_weights(new, 1)
    run_all(engine)
    v = seqs[0].versions
    assert 0 < before < 20 and v == [0] * before + [1] * (20 - before)  # the sequence survived the swap
    assert torch.allclose(model.norm.weight, torch.full((64,), 1.01))
    with pytest.raises(WeightUpdateError, match="not newer"):
        engine.update_weights(new, 1)


def test_background_loop_serves_many_threads():
    import threading

    model = llama()
    engine = Engine(model, config=EngineConfig(slots=4, max_len=64)).start()
    results, errors = {}, []

    def client(i):
        try:
            (s,) = engine.generate([i + 1, i + 2, i + 3], SamplingParams(max_tokens=6, seed=i), timeout=60)
            results[i] = s
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    engine.stop()
    assert not errors and len(results) == 10
    for i, s in results.items():
        assert s.prompt == [i + 1, i + 2, i + 3]
        assert (recomputed_logprobs(model, s, 1.0) - torch.tensor(s.logprobs)).abs().max() < 1e-4


def _spec_run(model, spec, params, drafter=None):
    engine = Engine(model, config=EngineConfig(slots=6, max_len=64, speculative=spec))
    if drafter is not None:
        engine._draft_logits = lambda live: drafter(model, live)
    torch.manual_seed(5)
    seqs = [x for n in (5, 1, 9) for x in engine.submit(torch.randint(0, 512, (n,)).tolist(), params, n=2)]
    run_all(engine)
    return seqs, engine


def perfect_drafter_fake(model, live):
    """A FAKE drafter for the accept path: it 'predicts' the main model's own greedy next token by
    running the full model, so every draft is right."""
    out = []
    for s in live:
        s.pending = []
        with torch.no_grad():
            nxt = int(model(torch.tensor([s.prompt + s.tokens]))[0, -1].argmax())
        out.append(torch.nn.functional.one_hot(torch.tensor(nxt), model.config.vocab_size).float() * 50)
    return torch.stack(out)


def test_mtp_speculative_decoding_reproduces_plain_decoding():
    model = moe()
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    plain, _ = _spec_run(model, False, greedy)
    spec, engine = _spec_run(model, True, greedy)  # random MTP heads: drafts mostly rejected
    assert [s.tokens for s in spec] == [s.tokens for s in plain]
    assert [s.experts for s in spec] == [s.experts for s in plain]
    assert all(max(abs(a - b) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4 for x, y in zip(spec, plain))
    assert engine.stats["drafted"] > 0
    good, engine = _spec_run(model, True, greedy, perfect_drafter_fake)  # every draft right
    assert [s.tokens for s in good] == [s.tokens for s in plain]
    assert [s.experts for s in good] == [s.experts for s in plain]
    assert engine.stats["accepted"] == engine.stats["drafted"] > 0
    assert engine.stats["decode_steps"] <= 11  # two tokens per step
    sampled, _ = _spec_run(model, True, SamplingParams(temperature=1.0, max_tokens=12, seed=1))
    for s in sampled:  # sampled tokens carry their logprobs under the target model
        assert (recomputed_logprobs(model, s, 1.0) - torch.tensor(s.logprobs)).abs().max() < 1e-4
    with pytest.raises(EngineError, match="MTP heads"):
        Engine(llama(), config=EngineConfig(speculative=True))


def test_speculative_sampling_emits_the_target_distribution():
    from opencomposer.inference.sampling import speculative_accept

    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.1, 0.2, 0.6])
    counts = torch.zeros(4)
    for _ in range(20000):
        d = int(torch.multinomial(q, 1, generator=gen))
        counts[speculative_accept(p, q, d, gen)[1]] += 1
    assert (counts / counts.sum() - p).abs().max() < 0.015


def test_two_updates_before_a_step_both_apply_and_versions_check_the_pending_one():
    model = llama()
    engine = Engine(model, config=EngineConfig(slots=2, max_len=64)).start()
    try:
        a = {"model.norm.weight": torch.full((64,), 2.0)}
        b = {"model.embed_tokens.weight": model.to_hf_state()["model.embed_tokens.weight"] + 1.0}
        with engine._cond:  # the loop cannot swap in between (the condition's lock is re-entrant)
            engine.update_weights(a, 1, wait=None)
            with pytest.raises(WeightUpdateError, match="pending version 1"):
                engine.update_weights(a, 1, wait=None)
            engine.update_weights(b, 2, wait=None)
        deadline = __import__("time").monotonic() + 30
        while engine.version < 2 and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.01)
        assert engine.version == 2 and engine.stats["weight_updates"] == 1
        assert torch.equal(model.norm.weight, torch.full((64,), 2.0))  # the first update was not lost
        assert torch.equal(model.to_hf_state()["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    finally:
        engine.stop()
