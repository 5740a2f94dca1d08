from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.model.errors import ModelLoadError  # noqa: E402
from opencomposer.model.hf import load_model, save_model  # noqa: E402
from opencomposer.model.llama import PRESETS, LlamaConfig, LlamaModel  # noqa: E402


def test_round_trip_through_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"]).eval()
    save_model(model, tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    again = load_model(tmp_path / "m").eval()
    ids = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() < 1e-4
        assert torch.equal(model(ids), again(ids))


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"]).eval()
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1, 32)
        steps = [model.run(ids[:, :7], cache=cache).logits]
        for t in range(7, 12):
            steps.append(model.run(ids[:, t:t + 1], cache=cache).logits)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_cache_slots_prefix_sharing_and_limits():
    from opencomposer.model.cache import CacheError

    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"]).eval()
    prompt = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        cache = model.new_cache(3, 9)
        model.run(prompt, cache=cache, rows=[0])
        cache.copy(0, [1, 2])  # the G rollouts of one prompt share its prefill
        nxt = torch.tensor([[5], [6], [7]])
        out = model.run(nxt, cache=cache).logits[:, -1]
        for i in range(3):
            alone = model(torch.cat([prompt, nxt[i:i + 1]], 1))[0, -1]
            assert torch.allclose(out[i], alone, atol=1e-5)
        with pytest.raises(CacheError, match="past the cache's max_len 9"):
            model.run(torch.randint(0, 512, (3, 3)), cache=cache)
        with pytest.raises(CacheError, match="outside the cache's 3 slots"):
            model.run(nxt[:1], cache=cache, rows=[3])


@pytest.mark.parametrize("prepared", [False, True])
def test_decode_over_scattered_slots_equals_each_sequence_alone(prepared):
    """Decoding rows in slots with gaps between them and different lengths (what a server sees
    while other requests prefill or have finished) reads the cache's storage run by run; each row's
    logits must equal its own sequence's full forward. `prepared`: as an engine's model (q/k/v in
    one product, rotated together; packed weights), against the plain model's full forward."""
    from opencomposer.model.linear import prepare_inference

    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"]).eval()
    plain = LlamaModel(PRESETS["tiny"]).eval()
    plain.load_state_dict(model.state_dict())
    if prepared:
        prepare_inference(model, fuse=True, pack=8)
    lengths = {0: 5, 1: 9, 3: 3, 4: 7, 6: 4}  # slots 2 and 5 are empty
    prompts = {slot: torch.randint(0, 512, (1, n)) for slot, n in lengths.items()}
    with torch.no_grad():
        cache = model.new_cache(7, 32)
        for slot, p in prompts.items():
            model.run(p, cache=cache, rows=[slot])
        for rows in ([0, 1, 3, 4, 6], [1, 4, 6], [3], [0, 1]):
            nxt = torch.randint(0, 512, (len(rows), 1))
            out = model.run(nxt, cache=cache, rows=rows).logits[:, -1]
            for i, slot in enumerate(rows):
                prompts[slot] = torch.cat([prompts[slot], nxt[i:i + 1]], 1)
                alone = plain(prompts[slot])[0, -1]
                assert torch.allclose(out[i], alone, atol=1e-5), (rows, slot)


def test_decode_over_a_shared_prefix_reads_it_once_and_equals_each_sequence_alone():
    """Rows whose slots hold the same prefix bytes (copies of one prefill) attend over it in one
    product for all of them, and over the rest of their own keys, merged through the softmax
    normalisers: each row's logits must equal its own sequence's full forward. Slots 2 and 5 are
    empty, slot 6 has a prompt of its own (not a member), and the members' suffixes differ in
    length."""
    from opencomposer.model.cache import SharedPrefix
    from opencomposer.model.linear import prepare_inference

    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"]).eval()
    plain = LlamaModel(PRESETS["tiny"]).eval()
    plain.load_state_dict(model.state_dict())
    prepare_inference(model, fuse=True, pack=8)
    prefix = torch.randint(0, 512, (1, 10))
    suffixes = {0: 1, 1: 4, 3: 2, 4: 6}
    prompts = {slot: torch.cat([prefix, torch.randint(0, 512, (1, n))], 1) for slot, n in suffixes.items()}
    prompts[6] = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        cache = model.new_cache(7, 40)
        model.run(prefix, cache=cache, rows=[0])
        cache.copy(0, [1, 3, 4])
        for slot, p in prompts.items():
            model.run(p[:, 10:] if slot != 6 else p, cache=cache, rows=[slot])
        for rows, members, shared in (([0, 1, 3, 4, 6], [0, 1, 3, 4], True), ([1, 4, 6], [1, 4, 6], True),
                                      ([0, 3], [0, 3], True), ([1, 6], [1], False)):
            nxt = torch.randint(0, 512, (len(rows), 1))
            # slot 6 listed as a member in one case: its prefix differs, so its logits would show it
            cache.shared = SharedPrefix(10, [m for m in members if m != 6])
            out = model.run(nxt, cache=cache, rows=rows).logits[:, -1]
            assert (cache._plan.members is not None) == shared
            cache.shared = None
            for i, slot in enumerate(rows):
                prompts[slot] = torch.cat([prompts[slot], nxt[i:i + 1]], 1)
                alone = plain(prompts[slot])[0, -1]
                assert torch.allclose(out[i], alone, atol=1e-5), (rows, slot)


def test_bad_folders(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    save_model(LlamaModel(PRESETS["tiny"]), tmp_path / "m")
    cfg = (tmp_path / "m" / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 128')
    (tmp_path / "m" / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match="has shape"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="unreadable safetensors"):
        load_model(tmp_path / "m")


def _train(model, opt, steps, start, losses):
    """A tiny training loop whose batches come from the RNG (so RNG restore matters)."""
    for _ in range(steps):
        ids = torch.randint(0, 512, (2, 16))
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 512), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return start + steps


def test_checkpoint_resume_is_bit_identical(tmp_path):
    from opencomposer.model import checkpoint as ckpt

    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    step = _train(model, opt, 3, 0, losses)
    path = ckpt.save(tmp_path, model, opt, ckpt.TrainState(step=step, data_position={"shard": 0, "offset": 96}))
    _train(model, opt, 2, step, losses)  # the uninterrupted run
    torch.manual_seed(123)  # a fresh process state
    model2 = LlamaModel(PRESETS["tiny"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    state = ckpt.load(ckpt.latest(tmp_path), model2, opt2)
    assert state.step == 3 and state.data_position == {"shard": 0, "offset": 96}
    resumed = []
    _train(model2, opt2, 2, state.step, resumed)
    assert resumed == losses[3:]  # bit-identical, not approximately equal
    other = LlamaModel(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ckpt.CheckpointError, match="different model"):
        ckpt.load(path, other)
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.load(tmp_path, model2)
