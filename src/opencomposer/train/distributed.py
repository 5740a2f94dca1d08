"""Data-parallel training with FSDP2 (`torch.distributed.fsdp.fully_shard`) under `torchrun`.

    torchrun --nproc_per_node=2 $(which opencomposer) pretrain -c recipe.toml --run_dir=runs/cpt

Every decoder block (and MTP module) is its own FSDP unit and the root holds the embeddings, final
norm and head. Each rank takes every world-th row of the global batch; the loss is scaled so the
averaged gradient equals the single-process gradient of the mean over all labelled tokens of the
global batch (tested against one process). gloo on CPU, nccl on GPUs. Checkpoints are gathered to
full tensors and written by rank 0 in the ordinary format, so a distributed run resumes on any
number of processes (or one) and `transformers` loads its weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist


def setup() -> tuple[int, int]:
    """(rank, world size); initialises the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    for module in getattr(model, "mtp", ()):
        fully_shard(module)
    fully_shard(model)
    return model


def all_sum(x: float | int) -> float:
    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


class _FullOptimizerState:
    """What `checkpoint.save` needs from an optimiser: a state_dict (here the gathered one)."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def save(trainer, data_position: dict) -> Path | None:
    """Gather full weights and optimiser state; rank 0 writes an ordinary checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from opencomposer.model import checkpoint as ckpt

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(trainer.model, options=opts)
    optim_sd = get_optimizer_state_dict(trainer.model, trainer.opt, options=opts)
    path = None
    if is_main():
        plain = type(trainer.model)(trainer.model.config)
        plain.load_state_dict(model_sd)
        path = ckpt.save(trainer.ckpt_dir, plain, _FullOptimizerState(optim_sd),
                         ckpt.TrainState(step=trainer.step, data_position=data_position),
                         tokenizer_json=trainer.tokenizer_json)
    barrier()
    return path


def load(trainer, path: Path):
    """Every rank reads the full checkpoint and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    from opencomposer.model import checkpoint as ckpt

    plain = type(trainer.model)(trainer.model.config)
    state = ckpt.load(path, plain, None, tokenizer_json=trainer.tokenizer_json)
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(trainer.model, plain.state_dict(), options=opts)
    optim_sd = torch.load(Path(path) / "optimizer.pt", weights_only=False)
    set_optimizer_state_dict(trainer.model, trainer.opt, optim_sd, options=opts)
    return state
