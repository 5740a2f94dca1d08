"""The fused decode layer (`kernels/decode_layer.py`): a dense model's decode step as one C++ call a
layer must give each row the logits of its own sequence's full forward, write the same keys and
values into the cache as the eager layers, read a shared prefix from the slot it names, give a row
the same bits whatever else is in the batch, and leave every other forward to the eager layers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.kernels import decode_layer, decode_products  # noqa: E402
from opencomposer.model.cache import SharedPrefix  # noqa: E402
from opencomposer.model.linear import prepare_inference  # noqa: E402
from opencomposer.model.llama import PRESETS, LlamaConfig, LlamaModel  # noqa: E402

# head size 16 (a multiple of 8), 3 query heads per key head
CFG = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def models():
    if decode_products.load() is None:
        pytest.skip(decode_products.unavailable() or "decode kernel unavailable")
    torch.manual_seed(0)
    fused = LlamaModel(CFG).eval()
    plain = LlamaModel(CFG).eval()
    plain.load_state_dict(fused.state_dict())
    assert prepare_inference(fused, decode=True)["layers"] == 1 and fused.fused_decode
    return fused, plain


def _calls(monkeypatch):
    """Count the fused op's calls (a wrapper around the real op)."""
    real, n = decode_layer.op(), [0]

    def counted(*a):
        n[0] += 1
        return real(*a)

    monkeypatch.setattr(decode_layer, "op", lambda: counted)
    return n


def test_scattered_rows_equal_each_sequence_alone_and_the_eager_cache(models, monkeypatch):
    """Slots with gaps, different lengths, rows listed out of order: each row's logits equal its own
    full forward, and the cache holds what the eager layers write (float32 rounding apart)."""
    fused, plain = models
    calls = _calls(monkeypatch)
    lengths = {0: 5, 1: 9, 3: 3, 4: 7, 6: 4}
    g = torch.Generator().manual_seed(1)
    prompts = {s: torch.randint(0, 300, (1, n), generator=g) for s, n in lengths.items()}
    with torch.no_grad():
        caches = {m: m.new_cache(7, 64) for m in (fused, plain)}
        for m, c in caches.items():
            for s, p in prompts.items():
                m.run(p, cache=c, rows=[s])
        for rows in ([0, 1, 3, 4, 6], [6, 1, 4], [3], [1, 0]):
            nxt = torch.randint(0, 300, (len(rows), 1), generator=g)
            before = calls[0]
            out = fused.run(nxt, cache=caches[fused], rows=rows).logits[:, -1]
            assert calls[0] == before + CFG.num_hidden_layers
            eager = plain.run(nxt, cache=caches[plain], rows=rows).logits[:, -1]
            assert (out - eager).abs().max() < 1e-5
            for i, s in enumerate(rows):
                prompts[s] = torch.cat([prompts[s], nxt[i:i + 1]], 1)
                assert torch.allclose(out[i], plain(prompts[s])[0, -1], atol=1e-5), (rows, s)
    assert torch.equal(caches[fused].lengths, caches[plain].lengths)
    for layer in range(CFG.num_hidden_layers):
        for a, b in zip(caches[fused].storage(layer), caches[plain].storage(layer)):
            assert (a - b).abs().max() < 1e-5


def test_a_shared_prefix_is_read_from_the_slot_it_names(models):
    """Rows that share a prefix read it from the first member row's slot (slot 0 here). To show that
    the op reads it there (and not from each row's own copy), the other members' copies are
    overwritten with noise:
    the logits still equal each sequence's full forward. Slot 6 is not a member."""
    fused, plain = models
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 300, (1, 10), generator=g)
    prompts = {s: torch.cat([prefix, torch.randint(0, 300, (1, n), generator=g)], 1) for s, n in
               {0: 1, 1: 4, 3: 2, 4: 6}.items()}
    prompts[6] = torch.randint(0, 300, (1, 12), generator=g)
    with torch.no_grad():
        cache = fused.new_cache(7, 64)
        fused.run(prefix, cache=cache, rows=[0])
        cache.copy(0, [1, 3, 4])
        for s, p in prompts.items():
            fused.run(p[:, 10:] if s != 6 else p, cache=cache, rows=[s])
        for layer in range(CFG.num_hidden_layers):
            for t in cache.storage(layer):
                t[[1, 3, 4], :, :10] = torch.randn(3, t.shape[1], 10, t.shape[3], generator=g)
        cache.shared = SharedPrefix(10, [0, 1, 3, 4])
        rows = [0, 6, 1, 4, 3]
        nxt = torch.randint(0, 300, (len(rows), 1), generator=g)
        out = fused.run(nxt, cache=cache, rows=rows).logits[:, -1]
        for i, s in enumerate(rows):
            assert torch.allclose(out[i], plain(torch.cat([prompts[s], nxt[i:i + 1]], 1))[0, -1], atol=1e-5), s


@pytest.mark.parametrize("hd,g", [(64, 1), (64, 2), (128, 4), (40, 5)])
def test_other_head_shapes_match_the_eager_layers(hd, g):
    """The attention's paths the module's model does not take: head sizes of 64 and more (whole
    64-wide blocks of the scores, 32-wide of the values) and odd ones (40: the tails), and 1, 2, 4
    or 5 query heads a key head (the values' pass takes them 3 at a time). Contexts past 8
    positions, so the scores' 8-position groups end in a partial one."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=hd * g, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=g, num_key_value_heads=1, max_position_embeddings=256)
    fused, plain = LlamaModel(cfg).eval(), LlamaModel(cfg).eval()
    plain.load_state_dict(fused.state_dict())
    assert prepare_inference(fused, decode=True)["layers"] == 1
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, 300, (3, 21), generator=gen)
    with torch.no_grad():
        caches = {m: m.new_cache(3, 64) for m in (fused, plain)}
        for m, c in caches.items():
            m.run(prompts, cache=c)
        for _ in range(3):
            nxt = torch.randint(0, 300, (3, 1), generator=gen)
            out = fused.run(nxt, cache=caches[fused]).logits[:, -1]
            eager = plain.run(nxt, cache=caches[plain]).logits[:, -1]
            assert (out - eager).abs().max() < 1e-5


@pytest.mark.parametrize("batch,amx", [(8, False), (20, False), (20, True)])
def test_a_row_gets_the_same_bits_whatever_else_is_in_the_batch(models, batch, amx):
    """Up to 8 rows and past 8 (the products then take the rows in groups of 4), and on the AMX form
    (past 8 rows where it runs) whatever else is in a batch of 9-32: its bits are not the 1-8 rows'
    forms'. The final hidden states: the head is not the layer's (past 8 rows without the AMX form it
    runs on oneDNN, whose result depends on the batch)."""
    fused, _ = models
    before = decode_products.set_amx()
    if amx and not decode_products.set_amx(True):
        pytest.skip("no AMX form here")
    if not amx:
        decode_products.set_amx(False)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 300, (batch, 6), generator=g)
    nxt = torch.randint(0, 300, (batch, 1), generator=g)
    subsets = ((list(range(batch)), [batch - 2], [0, batch - 2, 3]) if not amx else
               (list(range(batch)), [batch - 2, *range(8)], [0, batch - 2, 3, *range(9, 16)], list(range(batch))[::-1]))
    outs = []
    try:
        with torch.no_grad():
            for rows in subsets:
                cache = fused.new_cache(batch, 16)
                fused.run(prompts, cache=cache)
                hidden = fused.run(nxt[rows], cache=cache, rows=rows, logits=False).hidden[:, -1]
                outs.append(dict(zip(rows, hidden)))
    finally:
        decode_products.set_amx(before)
    for o in outs[1:]:
        for r, v in o.items():
            assert torch.equal(v, outs[0][r]), r


@pytest.mark.parametrize("batch", [9, 32])
def test_past_8_rows_on_the_amx_form_the_logits_match_the_eager_layers(models, batch):
    """Decode steps of 9-32 rows with the layers' products and the head on the AMX form: each row's
    logits within float32 rounding of the eager layers' (oneDNN's products), over three steps."""
    fused, plain = models
    before = decode_products.set_amx()
    if not decode_products.set_amx(True):
        pytest.skip("no AMX form here")
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(0, 300, (batch, 5), generator=g)
    try:
        with torch.no_grad():
            caches = {m: m.new_cache(batch, 16) for m in (fused, plain)}
            for m, c in caches.items():
                m.run(prompts, cache=c)
            for _ in range(3):
                nxt = torch.randint(0, 300, (batch, 1), generator=g)
                out = fused.run(nxt, cache=caches[fused]).logits[:, -1]
                eager = plain.run(nxt, cache=caches[plain]).logits[:, -1]
                assert (out - eager).abs().max() < 1e-5
    finally:
        decode_products.set_amx(before)


def test_every_other_forward_stays_on_the_eager_layers(models, monkeypatch):
    fused, plain = models
    calls = _calls(monkeypatch)
    ids = torch.randint(0, 300, (2, 5))
    with torch.no_grad():
        cache = fused.new_cache(40, 16)
        fused.run(ids, cache=cache, rows=[0, 1])  # prefill: more than one token a row
        fused.run(torch.randint(0, 300, (33, 1)), cache=cache, rows=list(range(33)))  # more than 32 rows
        fused(ids)  # no cache
        fused.double()
        try:
            fused.run(torch.randint(0, 300, (2, 1)), cache=fused.new_cache(2, 16), rows=[0, 1])  # float64
        finally:
            fused.float()
    with torch.enable_grad():
        fused.run(torch.randint(0, 300, (2, 1)), cache=fused.new_cache(2, 16), rows=[0, 1])  # gradients on
    before = decode_layer.set_enabled(False)
    try:
        with torch.no_grad():
            fused.run(torch.randint(0, 300, (2, 1)), cache=fused.new_cache(2, 16), rows=[0, 1])
    finally:
        decode_layer.set_enabled(before)
    strided = LlamaModel(CFG).eval()  # a weight the op cannot read as it is (columns not contiguous)
    strided.load_state_dict(plain.state_dict())
    prepare_inference(strided, decode=True)
    w = strided.layers[1].mlp.up_proj.weight
    w.data = w.data.t().contiguous().t()
    nxt = torch.randint(0, 300, (2, 1))
    with torch.no_grad():
        caches = [m.new_cache(2, 16) for m in (strided, plain)]
        for m, c in zip((strided, plain), caches):
            m.run(ids, cache=c, rows=[0, 1])
        out = strided.run(nxt, cache=caches[0], rows=[0, 1]).logits
        assert (out - plain.run(nxt, cache=caches[1], rows=[0, 1]).logits).abs().max() < 1e-5
    assert calls[0] == 0
    tiny = LlamaModel(PRESETS["tiny"]).eval()  # head size 16: applies
    assert prepare_inference(tiny, decode=True)["layers"] == 1
    assert prepare_inference(tiny)["layers"] == 0 and not tiny.fused_decode  # a plain set-up turns it off


def test_the_op_refuses_rows_outside_the_cache(models):
    fused, _ = models
    op = decode_layer.op()
    blk = fused.layers[0]
    a, m = blk.self_attn, blk.mlp
    ws = [blk.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
          blk.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    ks, vs = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    one = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        for slots, starts in ((torch.tensor([2]), one), (one, torch.tensor([8]))):
            with pytest.raises(RuntimeError, match="outside the cache"):
                op(torch.zeros(1, 96), ws, ks, vs, slots, starts, one, one, torch.zeros(1, 16), torch.zeros(1, 16),
                   1e-5, 6, 2)


def test_prefetching_the_next_tasks_keys_changes_no_bit(models):
    """The attention's prefetch of the next task's keys and values (`set_kv_prefetch`) moves no
    arithmetic: the same logits and the same cache, bit for bit, with it on and off, for rows that
    read a shared prefix from another slot and rows that read only their own."""
    fused, _ = models
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 300, (1, 40), generator=g)
    tails = {s: torch.randint(0, 300, (1, n), generator=g) for s, n in {0: 3, 1: 7, 2: 1, 4: 30}.items()}
    before = decode_layer.set_kv_prefetch(None)
    outs = {}
    try:
        for on in (False, True):
            assert decode_layer.set_kv_prefetch(on) is on
            with torch.no_grad():
                cache = fused.new_cache(6, 128)
                fused.run(prefix, cache=cache, rows=[0])
                cache.copy(0, [1, 2])
                for s, t in tails.items():
                    fused.run(t if s != 4 else torch.cat([prefix, t], 1), cache=cache, rows=[s])
                cache.shared = SharedPrefix(40, [0, 1, 2])
                rows = [4, 0, 2, 1]
                logits = [fused.run(torch.full((4, 1), 11 + i), cache=cache, rows=rows).logits[:, -1]
                          for i in range(3)]
            outs[on] = (torch.stack(logits), [t.clone() for layer in range(CFG.num_hidden_layers)
                                              for t in cache.storage(layer)])
    finally:
        decode_layer.set_kv_prefetch(before)
    assert torch.equal(outs[False][0], outs[True][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[False][1], outs[True][1]))


def test_weights_replaced_between_steps_are_the_ones_the_next_step_reads():
    """The fused path keeps each layer's weight list between steps (`LlamaModel._decode_weights`):
    a weight replaced by a new tensor, a module replaced, or a weight's data made non-contiguous
    must be what the next step computes with (or the eager layers, for the last)."""
    if decode_products.load() is None:
        pytest.skip(decode_products.unavailable() or "decode kernel unavailable")
    torch.manual_seed(3)
    fused, plain = LlamaModel(CFG).eval(), LlamaModel(CFG).eval()
    plain.load_state_dict(fused.state_dict())
    prepare_inference(fused, decode=True)
    prompt, nxt = torch.randint(0, 300, (2, 6)), torch.randint(0, 300, (2, 1))

    def step(m):
        with torch.no_grad():
            c = m.new_cache(2, 32)
            m.run(prompt, cache=c)
            return m.run(nxt, cache=c).logits[:, -1]

    assert (step(fused) - step(plain)).abs().max() < 1e-4  # the lists are now kept
    for change in (lambda m: setattr(m.layers[1].mlp.up_proj, "weight",
                                     torch.nn.Parameter(m.layers[1].mlp.up_proj.weight.detach() * 1.5)),
                   lambda m: setattr(m.layers[0].input_layernorm.weight, "data",
                                     m.layers[0].input_layernorm.weight.detach() + 0.5)):
        change(fused)
        change(plain)
        assert (step(fused) - step(plain)).abs().max() < 1e-4
    # a module replaced: its weight is the one handed to the op (the eager layers' fused products
    # keep the modules `prepare_inference` saw, so a replaced module needs preparing again there)
    new = type(fused.layers[2].self_attn.q_proj)(96, 96, bias=False)
    fused.layers[2].self_attn.q_proj = new
    assert fused._decode_weights()[2][1] is new.weight
    k = fused.layers[0].self_attn.k_proj.weight
    k.data = k.data.t().contiguous().t()  # the same values, not contiguous: the eager layers run
    assert fused._decode_weights() is None
