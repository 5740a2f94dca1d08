"""Weight files an engine loads in flight: a Hugging Face folder's safetensors, and the checksum an
update request quotes."""

from __future__ import annotations

import torch

from opencomposer.inference.engine import WeightUpdateError


def read_update(folder, model) -> dict[str, torch.Tensor]:
    """Read a weight update (a Hugging Face folder's safetensors) for `Engine.update_weights`;
    unreadable files are named."""
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise WeightUpdateError(f"{folder}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001
            raise WeightUpdateError(f"{f}: unreadable safetensors ({e})") from None
    return tensors


def checksum(folder) -> str:
    """sha256 over the folder's safetensors files in name order (what an update request quotes)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
