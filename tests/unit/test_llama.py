from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.model.llama import PRESETS, LlamaModel, ModelLoadError, load_hf, save_hf  # noqa: E402


def test_round_trip_through_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"]).eval()
    save_hf(model, tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    again = load_hf(tmp_path / "m").eval()
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
        past = [None] * len(model.layers)
        logits, past = model(ids[:, :7], past=past)
        steps = [logits]
        for t in range(7, 12):
            logits, past = model(ids[:, t:t + 1], past=past, start_pos=t)
            steps.append(logits)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_bad_folders(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf(tmp_path)
    save_hf(LlamaModel(PRESETS["tiny"]), tmp_path / "m")
    cfg = (tmp_path / "m" / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 128')
    (tmp_path / "m" / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match="has shape"):
        load_hf(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="unreadable safetensors"):
        load_hf(tmp_path / "m")
