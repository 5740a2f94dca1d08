"""Hugging Face model folders: config.json + *.safetensors in the names `transformers` and vLLM use.

`load_model` picks the family from the config (`LlamaForCausalLM`, `DeepseekV3ForCausalLM`), checks
every tensor against the config before copying it, and names the file and tensor on any mismatch.
Each family converts between its own parameters and Hugging Face names (`to_hf_state`,
`hf_target`), so fused layouts (the MoE experts) can differ from the on-disk one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from opencomposer.model.errors import ModelLoadError

# Tensors above this size go to a new shard, as `save_pretrained` does.
SHARD_BYTES = 2 * 1024**3


def family(cfg: dict):
    """(config class, model class) for a Hugging Face config dict."""
    from opencomposer.model.deepseek import DeepseekConfig, DeepseekModel
    from opencomposer.model.llama import LlamaConfig, LlamaModel

    arch = (cfg.get("architectures") or [""])[0]
    mtype = cfg.get("model_type", "")
    if arch == "LlamaForCausalLM" or mtype in ("llama", "mistral"):
        return LlamaConfig, LlamaModel
    if arch == "DeepseekV3ForCausalLM" or mtype in ("deepseek_v3", "kimi_k2"):
        return DeepseekConfig, DeepseekModel
    raise ModelLoadError(f"unknown architecture {arch or mtype!r} (supported: LlamaForCausalLM, DeepseekV3ForCausalLM)")


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not JSON ({e})") from None


def build(cfg_dict: dict):
    cfg_cls, model_cls = family(cfg_dict)
    return model_cls(cfg_cls.from_hf(cfg_dict))


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """A model folder -> our model (LlamaModel or DeepseekModel), weights checked and loaded."""
    folder = Path(folder)
    model = build(read_config(folder))
    load_weights(model, folder)
    return model.to(dtype)


def load_weights(model, folder: Path) -> None:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    expected = set(model.to_hf_state())
    state = model.state_dict()
    seen: set[str] = set()
    with torch.no_grad():
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ModelLoadError(f"{f}: unreadable safetensors ({e})") from None
            for name in names:
                target = model.hf_target(name, state)
                if target is None:
                    raise ModelLoadError(f"{f}: unexpected tensor {name} (does config.json match the weights?)")
                try:
                    t = handle.get_tensor(name)
                except Exception as e:  # noqa: BLE001
                    raise ModelLoadError(f"{f}: tensor {name} is unreadable ({e})") from None
                if tuple(t.shape) != tuple(target.shape):
                    raise ModelLoadError(f"{f}: {name} has shape {tuple(t.shape)}, "
                                         f"config.json says {tuple(target.shape)}")
                target.copy_(t)
                seen.add(name)
    missing = expected - seen - model.optional_hf_keys()
    if missing:
        raise ModelLoadError(f"{folder}: missing tensors {sorted(missing)[:5]} ({len(missing)} in all)")


def save_model(model, folder: str | Path) -> Path:
    """Write config.json and safetensors shards (with an index when there is more than one)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = model.to_hf_state()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    def write(shard: dict[str, torch.Tensor], path: Path) -> None:
        # Copies one shard at a time: fused expert slices and the MTP layers' copies of the
        # embedding share storage with other tensors, which safetensors refuses.
        save_file({n: t.detach().clone() for n, t in shard.items()}, str(path), metadata={"format": "pt"})

    if len(shards) == 1:
        write(shards[0], folder / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write(shard, folder / fname)
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    return folder
