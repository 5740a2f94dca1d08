"""Compile the Triton kernels ahead of time for sm_90 and sm_100 (Triton's own ptxas; no GPU or
driver needed) and print, as JSON, the PTX instructions each uses. Run in its own process by
test_triton_compile.py: Triton picks compile-or-interpret when a kernel is decorated, and the
interpreter tests import the same modules with TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs TRITON_INTERPRET unset"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from opencomposer.kernels import triton_gemm as tg  # noqa: E402
from opencomposer.kernels import triton_quant as tq  # noqa: E402

GEMM_TYPES = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "ta_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32",
              "tb_ptr": "*fp32", "c_ptr": "*fp32", "offs_ptr": "*i32", **dict.fromkeys(
                  ("K", "M", "stride_am", "stride_sam", "stride_bg", "stride_bm", "stride_sbg", "stride_sbm",
                   "stride_tbg", "stride_cm"), "i32")}
GEMM_MODES = {"mxfp8": {"BK": 32, "SK": 32, "B_ROWS": 1, "DEQUANT": False},
              "fp8-block": {"BK": 128, "SK": 128, "B_ROWS": 128, "DEQUANT": False},
              "nvfp4": {"BK": 64, "SK": 16, "B_ROWS": 1, "DEQUANT": True}}
WGRAD_TYPES = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*fp32",
               "poffs_ptr": "*i32", **dict.fromkeys(("M", "N", "stride_am", "stride_sam", "stride_bn", "stride_sbn",
                                                     "stride_cg", "stride_cm"), "i32")}
QUANT_TYPES = {"x_ptr": "*bf16", "idx_ptr": "*i64", "q_ptr": "*u8", "s_ptr": "*fp32", "t_ptr": "*fp32",
               **dict.fromkeys(("N", "K", "NB", "stride_x", "stride_q", "stride_s"), "i32")}


def instructions(fn, types: dict, consts: dict, arch: int, **options) -> list[str]:
    signature = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                            target=GPUTarget("cuda", arch, 32), options=options)
    words = {w for line in kernel.asm["ptx"].splitlines() for w in line.split() if "." in w and w[0].isalpha()}
    return sorted(words)


@triton.jit
def _plain_division(x_ptr, y_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(x_ptr + i) / tl.load(y_ptr + i))


def main() -> None:
    out = {}
    for arch in (90, 100):
        for fmt, mode in GEMM_MODES.items():
            out[f"gemm/{fmt}/sm_{arch}"] = instructions(tg._grouped_kernel, GEMM_TYPES,
                                                        {"BM": 128, "BN": 128, "BF16_DOT": True, **mode}, arch,
                                                        num_warps=8, num_stages=3)
        for fmt in ("mxfp8", "fp8-block"):
            out[f"wgrad/{fmt}/sm_{arch}"] = instructions(tg._wgrad_kernel, WGRAD_TYPES,
                                                         {"BM": 128, "BN": 128, "BK": tg.SPECS_BLOCK[fmt]}, arch,
                                                         num_warps=8, num_stages=3)
    for fmt, (mode, block, elem) in tq.SPECS.items():
        fmax, mbits, emin, emax = tq.ELEMENTS[elem]
        s_bias, s_mbits, s_emin = (15, 2, -14) if elem == "e5m2" else (7, 3, -6)
        consts = {"HAS_IDX": True, "MODE": mode, "BLOCK": block, "BR": 16, "FMAX": fmax, "MBITS": mbits,
                  "EMIN": emin, "EMAX": emax, "S_BIAS": s_bias, "S_MBITS": s_mbits, "S_EMIN": s_emin}
        out[f"quant/{fmt}/sm_90"] = instructions(tq._quant_kernel, QUANT_TYPES, consts, 90)
    out["plain-division/sm_90"] = instructions(_plain_division, {"x_ptr": "*fp32", "y_ptr": "*fp32",
                                                                 "o_ptr": "*fp32"}, {"N": 128}, 90)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
