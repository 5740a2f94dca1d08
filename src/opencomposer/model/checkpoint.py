"""Checkpoints: model, optimiser, step, RNG states and data position — resuming gives a
bit-identical next loss.

    <dir>/step_000120/
      model.safetensors     weights (Hugging Face names; `transformers` can load the folder)
      config.json           the model config
      optimizer.pt          optimiser state (torch.save)
      rng.pt                python, numpy and torch RNG states
      meta.json             step, data position, model/tokenizer fingerprints, free-form extras

A checkpoint is written to a temporary folder and renamed into place, so a crash never leaves a
half-written one. Loading checks that the checkpoint belongs to the same model (parameter names and
shapes) and tokenizer (a fingerprint), and names the mismatch otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opencomposer.core.errors import UserError


class CheckpointError(ValueError, UserError):
    pass


@dataclass
class TrainState:
    step: int = 0
    data_position: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def model_fingerprint(model: torch.nn.Module) -> str:
    spec = ";".join(f"{k}:{tuple(v.shape)}" for k, v in sorted(model.state_dict().items()))
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer_json: str | Path | None) -> str | None:
    if tokenizer_json is None:
        return None
    return hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()[:16]


def save(root: str | Path, model, optimizer: torch.optim.Optimizer | None, state: TrainState, *,
         tokenizer_json: str | Path | None = None) -> Path:
    import numpy as np

    from opencomposer.model.hf import save_model

    root = Path(root)
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp-step_{state.step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp / "rng.pt")
    meta = {"step": state.step, "data_position": state.data_position, "extra": state.extra,
            "model_fingerprint": model_fingerprint(model), "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer_json)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest(root: str | Path) -> Path | None:
    steps = sorted(Path(root).glob("step_*")) if Path(root).is_dir() else []
    return steps[-1] if steps else None


def load(path: str | Path, model, optimizer: torch.optim.Optimizer | None = None, *,
         tokenizer_json: str | Path | None = None, restore_rng: bool = True) -> TrainState:
    import numpy as np

    from opencomposer.model.errors import ModelLoadError
    from opencomposer.model.hf import load_weights

    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a checkpoint (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta["model_fingerprint"] != model_fingerprint(model):
        raise CheckpointError(f"{path}: saved from a different model (parameter names or shapes differ)")
    tok = tokenizer_fingerprint(tokenizer_json)
    if tok is not None and meta.get("tokenizer_fingerprint") not in (None, tok):
        raise CheckpointError(f"{path}: saved with a different tokenizer ({meta['tokenizer_fingerprint']} != {tok})")
    try:
        load_weights(model, path)
    except ModelLoadError as e:
        raise CheckpointError(str(e)) from None
    if optimizer is not None:
        if not (path / "optimizer.pt").exists():
            raise CheckpointError(f"{path}: no optimizer state")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    if restore_rng:
        rng = torch.load(path / "rng.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
    return TrainState(step=meta["step"], data_position=meta["data_position"], extra=meta.get("extra", {}))
