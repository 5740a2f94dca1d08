"""The DeepSeek-V3 / Kimi-K2 family: parity with transformers, MLA cache, MoE routing, router
replay, MTP, Hugging Face interop and bad input."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from opencomposer.model.deepseek import PRESETS, DeepseekConfig, DeepseekModel, preset  # noqa: E402
from opencomposer.model.errors import ModelLoadError  # noqa: E402
from opencomposer.model.hf import load_model, save_model  # noqa: E402
from opencomposer.model.moe import ReplayError, Router  # noqa: E402


def tiny(**kw) -> DeepseekModel:
    torch.manual_seed(0)
    model = DeepseekModel(preset("tiny-moe", **kw)).eval()
    with torch.no_grad():  # a non-zero balancing bias, so that selection and gates differ
        for layer in model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": None, "rope_interleave": False, "rope_theta": 5000.0}])
def test_logit_parity_with_transformers(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    model = tiny(**variant)
    save_model(model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and "moe_backend" not in cfg
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    assert type(ref).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, 512, (2, 19))
    with torch.no_grad():
        ours = model(ids)
        assert (ours - ref(ids).logits).abs().max().item() < 1e-4
        assert torch.equal(load_model(tmp_path / "m").eval()(ids), ours)  # experts and MTP round-trip


def test_parameter_counts_match_instances_and_published_sizes():
    for kw in ({}, {"q_lora_rank": None}, {"num_nextn_predict_layers": 0}, {"tie_word_embeddings": True}):
        cfg = preset("tiny-moe", **kw)
        assert DeepseekModel(cfg).num_parameters() == cfg.num_parameters()
    v3, k2 = PRESETS["deepseek-v3"], PRESETS["kimi-k2"]
    assert abs(v3.num_parameters(include_mtp=False) / 671e9 - 1) < 0.005  # DeepSeek-V3: 671B total
    assert abs(v3.active_parameters() / 37e9 - 1) < 0.03                 # 37B activated
    assert 1.0e12 < k2.num_parameters() < 1.05e12                         # Kimi K2: 1T total
    assert abs(k2.active_parameters() / 32e9 - 1) < 0.03                  # 32B activated


def test_mla_cache_stores_the_latent_and_decodes_like_the_full_forward():
    model = tiny()
    cfg = model.config
    ids = torch.randint(0, 512, (1, 14))
    with torch.no_grad():
        full = model.run(ids)
        cache = model.new_cache(1, 64)
        steps = [model.run(ids[:, :9], cache=cache)]
        for t in range(9, 14):
            steps.append(model.run(ids[:, t:t + 1], cache=cache))
    latent, k_rot = cache._store[0]
    assert latent.shape[1:] == (1, cache._cap, cfg.kv_lora_rank) and k_rot.shape[-1] == cfg.qk_rope_head_dim
    assert torch.allclose(torch.cat([s.logits for s in steps], 1), full.logits, atol=1e-5)
    # the experts chosen incrementally are the ones the full forward chose
    assert torch.equal(torch.cat([s.routed_experts for s in steps], 1), full.routed_experts)


def test_ragged_rows_decode_together():
    """Two sequences of different lengths in one cache decode in one batch, each as if alone."""
    model = tiny()
    a, b = torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 11))
    with torch.no_grad():
        cache = model.new_cache(2, 64)
        model.run(a, cache=cache, rows=[0])
        model.run(b, cache=cache, rows=[1])
        nxt = torch.tensor([[7], [9]])
        both = model.run(nxt, cache=cache).logits
        alone_a = model(torch.cat([a, nxt[:1]], 1))[:, -1]
        alone_b = model(torch.cat([b, nxt[1:]], 1))[:, -1]
    assert torch.allclose(both[0, -1], alone_a[0], atol=1e-5)
    assert torch.allclose(both[1, -1], alone_b[0], atol=1e-5)
    assert cache.lengths.tolist() == [6, 12]


def test_grouped_experts_equal_a_per_token_loop():
    torch.manual_seed(1)
    cfg = preset("tiny-moe")
    moe = DeepseekModel(cfg).layers[1].mlp
    x = torch.randn(3, 6, cfg.hidden_size)
    with torch.no_grad():
        out, idx, stats = moe(x)
        flat, fidx = x.reshape(-1, cfg.hidden_size), idx.reshape(-1, cfg.num_experts_per_tok)
        _, gates, _ = moe.gate(flat)
        isz = cfg.moe_intermediate_size
        ref = torch.zeros_like(flat)
        for n in range(flat.shape[0]):
            for j, e in enumerate(fidx[n].tolist()):
                gu = moe.experts.gate_up[e] @ flat[n]
                h = torch.nn.functional.silu(gu[:isz]) * gu[isz:]
                ref[n] += gates[n, j] * (moe.experts.down[e] @ h)
        ref = ref.view_as(x) + moe.shared_experts(x)
    assert torch.allclose(out, ref, atol=1e-5)
    assert int(stats.load.sum()) == 18 * cfg.num_experts_per_tok  # every (token, slot) counted once


def test_router_respects_group_limits_and_gates_ignore_the_bias():
    cfg = preset("tiny-moe", n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    router = Router(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(200, cfg.hidden_size)
    idx, gates, stats = router(x)
    assert ((idx // 4)[:, :, None] != (idx // 4)[:, None, :]).sum(dim=(1, 2)).max() > 0  # >1 group used
    assert max(len(set(row)) for row in (idx // 4).tolist()) <= 2                          # never > topk_group
    scores = torch.sigmoid(x @ router.weight.T).gather(1, idx)
    assert torch.allclose(gates, scores / scores.sum(-1, keepdim=True) * cfg.routed_scaling_factor, atol=1e-6)
    load = stats.load.clone().float()
    before = router.e_score_correction_bias.clone()
    router.balance_(load, rate=0.01)
    moved = router.e_score_correction_bias - before
    assert (moved[load > load.mean()] < 0).all() and (moved[load < load.mean()] > 0).all()


def test_router_replay_reproduces_sampling_and_lets_gradients_reach_the_router():
    model = tiny()
    ids = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        sampled = model.run(ids)
    model.train()
    replayed = model.run(ids, replay=sampled.routed_experts)
    assert torch.equal(replayed.logits, sampled.logits)  # replaying the sampler's own choice is exact
    assert all(s.mismatch == 0.0 and s.replaced == 0 for s in replayed.router)
    replayed.logits.square().mean().backward()
    router = model.layers[1].mlp.gate
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_overrides_the_router_and_filters_implausible_experts():
    model = tiny(replay_plausibility=0.0)  # no filter: the replay is obeyed as is
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        own = model.run(ids)
        forced = (own.routed_experts + 1) % model.config.n_routed_experts  # other experts
        out = model.run(ids, replay=forced)
    assert torch.equal(out.routed_experts, forced)
    assert not torch.allclose(out.logits, own.logits)
    assert all(s.mismatch > 0 for s in out.router)
    # a strict threshold replaces most forced experts with the router's own candidates
    strict = tiny(replay_plausibility=1.0)
    with torch.no_grad():
        own = strict.run(ids)
        out = strict.run(ids, replay=forced)
        loose = tiny(replay_plausibility=0.0).run(ids, replay=forced)
    assert sum(s.replaced for s in out.router) > 0
    assert (out.logits - own.logits).abs().mean() < (loose.logits - own.logits).abs().mean()


def test_plausibility_filter_on_known_scores():
    router = Router(preset("tiny-moe", n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                           replay_plausibility=0.5))
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.7]])
    own = torch.tensor([[0, 1]])  # threshold: 0.5 * 0.8 = 0.4
    cases = {(2, 3): ([[0, 3]], 1),  # 2 (0.1) is implausible -> the router's best unused candidate, 0
             (1, 2): ([[1, 0]], 1),  # 1 is kept; 2 -> 0
             (2, 0): ([[1, 0]], 1),  # 0 is kept, so 2 -> the next candidate, 1
             (3, 1): ([[3, 1]], 0)}  # both plausible: the replay is obeyed
    cases[(-1, 3)] = ([[0, 3]], 0)   # -1 (not recorded): the router fills it, not counted as replaced
    cases[(1, -1)] = ([[1, 0]], 0)
    for replayed, (want, n) in cases.items():
        got, replaced = router.replay(scores, own, torch.tensor([replayed]))
        assert got.tolist() == want and replaced == n, replayed


def test_bad_replays_are_refused():
    model = tiny()
    ids = torch.randint(0, 512, (1, 4))
    with torch.no_grad():
        routed = model.run(ids).routed_experts
        with pytest.raises(ValueError, match="replay has shape"):
            model.run(ids, replay=routed[:, :2])
        with pytest.raises(ReplayError, match="outside"):
            model.run(ids, replay=routed + 100)


def test_mtp_heads_are_causal_and_shaped():
    model = tiny()
    ids = torch.randint(0, 512, (1, 10))
    with torch.no_grad():
        out = model.run(ids, mtp=True)
        assert [t.shape for t in out.mtp_logits] == [torch.Size([1, 9, 512])]
        changed = ids.clone()
        changed[0, 6] = (changed[0, 6] + 1) % 512
        again = model.run(changed, mtp=True).mtp_logits[0]
    # position i combines hidden state i with token i+1: changing token 6 leaves positions 0..4 alone
    diff = (again - out.mtp_logits[0]).abs().amax(-1)[0]
    # Not exactly 0: another token's change regroups the expert batches, so float sums reorder (~1e-7).
    assert (diff[:5] < 1e-5).all() and (diff[5:] > 1e-3).all()


def test_bad_folders_and_configs(tmp_path):
    model = tiny()
    save_model(model, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    good = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**good, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match="unknown architecture 'GPTNeoXForCausalLM'"):
        load_model(tmp_path / "m")
    cfg_path.write_text(json.dumps({**good, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ModelLoadError, match="quantized"):
        load_model(tmp_path / "m")
    cfg_path.write_text(json.dumps({**good, "n_group": 3}))
    with pytest.raises(ModelLoadError, match="not divisible by n_group"):
        load_model(tmp_path / "m")
    cfg_path.write_text(json.dumps({**good, "moe_intermediate_size": 48}))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: .*experts.* has shape"):
        load_model(tmp_path / "m")
    cfg_path.write_text(json.dumps({**good, "num_nextn_predict_layers": 0, "num_mtp_layers": 0}))
    with pytest.raises(ModelLoadError, match="unexpected tensor model.layers.3"):
        load_model(tmp_path / "m")
    cfg_path.write_text(json.dumps(good))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors \['model.layers.2.mlp.experts.5.down_proj.weight'\]"):
        load_model(tmp_path / "m")
    with pytest.raises(ValueError, match="not divisible"):
        DeepseekConfig(n_routed_experts=10, n_group=4)


def test_sharded_save_writes_an_index(tmp_path, monkeypatch):
    import opencomposer.model.hf as hf

    model = tiny()
    monkeypatch.setattr(hf, "SHARD_BYTES", 200_000)
    save_model(model, tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "m").eval()(ids), model(ids))


def test_incremental_mtp_matches_the_training_mtp():
    model = tiny()
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        full = model.run(ids, mtp=True)
        cache = model.new_cache(1, 32)
        first = model.mtp_step(full.hidden[:, :6], ids[:, 1:7], cache, [0])
        rest = [model.mtp_step(full.hidden[:, t:t + 1], ids[:, t + 1:t + 2], cache, [0]) for t in range(6, 11)]
    assert torch.allclose(torch.cat([first, *rest], 1), full.mtp_logits[0], atol=1e-5)
