"""Whether this CPU computes bfloat16 products in hardware, and the `bf16 = true / false / "auto"`
setting of the trainers (SFT's `[sft] bf16`, RL's `TrainerConfig.bf16`) that follows it."""

from __future__ import annotations

import torch


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX), where CPU bf16
    autocast is the fast way to train: a 2,048 x 576 x 1,536 product measured 376 GFLOP/s in bf16
    against 173 in float32 on an AMD EPYC with AVX-512 BF16, and 38 in bf16 with oneDNN held to
    AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`), so on AVX2-only CPUs bf16 is ~4x slower (docs/train.md)."""
    cpu = torch.cpu
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: assume not
        return False


def resolve_bf16(setting: bool | str) -> bool:
    """A config's `bf16` (True, False or "auto") -> whether to autocast: "auto" is `native_bf16()`."""
    if setting == "auto":
        return native_bf16()
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"bf16 must be true, false or \"auto\", not {setting!r}")
