"""The matrix products of both model families on CPU: `x @ w.T` through oneDNN where torch ships it.

Why not `F.linear`: on x86 torch's CPU build runs `F.linear` and `@` through MKL's sgemm, and on
the AMD EPYC this project is developed on (AVX-512 with BF16) MKL runs them at about half of what
oneDNN's float32 kernel does on the same tensors, for every shape that matters here (decode in
`benchmarks/rollouts.py --part decode`; single products in scratch runs: 2x for 1536 x 576 at
1-1,024 rows, 2-3.8x for SmolLM2's 49,152-row vocabulary head). On an AVX2-only EPYC the two ran
level (within 10% either way, docs/benchmarks.md), so there the gain is the fused and packed
products below, not the kernel. oneDNN ships inside torch
(`torch.ops.mkldnn._linear_pointwise`, the op inductor's CPU backend calls), computes in float32
with float32 accumulation, and is used with the weights as they are (no packed copy), so an
in-flight weight update or an optimizer step is seen at once.

`linear(x, w)` takes that path when it applies (CPU, float32 tensors, a plain tensor or
Parameter, no autocast) and `F.linear` otherwise: GPU tensors, bf16, FSDP2's DTensors and autocast
regions never see it. Under autograd a small Function computes the backward's two products through
the same kernel. `OPENCOMPOSER_LINEAR=aten` (read at import) or `set_backend("aten")` turns it off,
for comparison (`benchmarks/rollouts.py --part decode` measures both in one run).

For an inference engine's model (`prepare_inference`), two more steps, both off under autograd:
- `FusedProducts`: the products of one input by several weights (q, k and v; an MLP's gate and up)
  run as one product over their concatenation, as vLLM's merged QKV and gate-up layers do: one
  call instead of three, and a wider product runs closer to this machine's bandwidth.
- packed weights: oneDNN's own blocked layout for a given batch size
  (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU weight prepacking uses):
  measured faster for decode-sized products here; why inside oneDNN was not looked into.
Both keep derived copies (the fused and packed weights cost the model's product weights once more:
about 540 MB for SmolLM2-135M in float32), built on first use and rebuilt whenever a weight's
storage or version changes (an in-place update or an optimizer step bumps the version), so they
never serve stale weights. And with `decode` (on in the engine: `EngineConfig.decode_kernel`), a
product of at most 8 rows (a decode step) runs on `kernels/decode_products.py`'s AVX2 kernel (in
16 lanes where the CPU has AVX-512F; of up to 32 rows on its AMX form where the CPU has AMX-BF16)
over the weights as they are (the fused ones side by side, no copy), which reads them faster than
oneDNN does at those sizes on an AVX2-only CPU; where it cannot run, the oneDNN path above does. Measured
in `benchmarks/rollouts.py --part decode` (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_op():
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # a torch without the op: F.linear everywhere
        return None


_PLAIN = (torch.Tensor, nn.Parameter)
_OP = _onednn_op() if os.environ.get("OPENCOMPOSER_LINEAR", "onednn") != "aten" else None


def backend() -> str:
    """"onednn" or "aten": what a float32 CPU product in this process runs on."""
    return "aten" if _OP is None else "onednn"


def set_backend(name: str) -> str:
    """Use "onednn" (where torch has it; otherwise this stays "aten") or "aten" from now on, in
    this process; returns the backend before."""
    global _OP
    if name not in ("onednn", "aten"):
        raise ValueError(f"unknown linear backend {name!r} (onednn or aten)")
    before = backend()
    _OP = _onednn_op() if name == "onednn" else None
    return before


def _eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (_OP is not None and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and w.device.type == "cpu" and type(x) in _PLAIN and type(w) in _PLAIN
            and not torch.is_autocast_enabled("cpu"))


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T on oneDNN (no bias, no fused activation)."""
    return _OP(x, w, None, "none", [], "")


def times_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T without autograd (x (..., K), w (N, K), either may be a strided view)."""
    return _product(x, w) if _eligible(x, w) else x @ w.T


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _product(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _product(g, w.t())  # g @ w
        if ctx.needs_input_grad[1]:
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            gw = _product(g2.t(), x2.t())  # g2.T @ x2
        return gx, gw


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), through oneDNN where it applies (module docstring)."""
    if bias is not None or not _eligible(x, w):
        return F.linear(x, w, bias)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Linear.apply(x, w)
    return _product(x, w)


def _reorder_op():
    try:
        return torch.ops.mkldnn._reorder_linear_weight
    except (AttributeError, RuntimeError):  # a torch without it: weights are used as they are
        return None


class _Derived:
    """A copy derived from weights (their concatenation, in oneDNN's packed layout for `pack` rows
    when given), rebuilt whenever one of them changes storage, version or shape."""

    def __init__(self, pack: int | None):
        self.pack = pack if _reorder_op() is not None else None
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None

    def get(self, ws: list[torch.Tensor]) -> torch.Tensor:
        key = tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in ws)
        if key != self._key:
            w = torch.cat([w.detach() for w in ws]) if len(ws) > 1 else ws[0].detach()
            self._weight = _reorder_op()(w.contiguous(), self.pack) if self.pack else w
            self._key = key
        return self._weight


def _inference(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A product that no gradient flows through, on the oneDNN path."""
    return not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) and _eligible(x, w)


def _decode_product(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor | None:
    from opencomposer.kernels import decode_products

    return decode_products.products(x, ws)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) whose product is `linear`; in an
    inference engine's model (`prepare_inference`) with a packed copy of its weight, and decode-sized
    products on the decode kernel."""

    packed: _Derived | None = None
    decode: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.packed is not None or self.decode) and self.bias is None and _inference(x, self.weight):
            y = _decode_product(x, [self.weight]) if self.decode else None
            if y is not None:
                return y
            if self.packed is not None and self.packed.pack:
                return _product(x, self.packed.get([self.weight]))
        return linear(x, self.weight, self.bias)


class FusedProducts:
    """`x @ cat(w_1, ..., w_n).T` split back into the n products, for modules whose weights all
    take the same input (module docstring)."""

    def __init__(self, modules: list[nn.Linear], pack: int | None = None, decode: bool = False):
        self.modules = modules
        self.derived = _Derived(pack)
        self.decode = decode

    def product(self, x: torch.Tensor) -> torch.Tensor | None:
        """The n products side by side (..., sum of out_features), or None where the fused path
        does not apply (gradients, a bias, or what `linear` would not send to oneDNN): the caller
        then runs its own modules."""
        ws = [m.weight for m in self.modules]
        if any(m.bias is not None for m in self.modules) or not _inference(x, ws[0]):
            return None
        y = _decode_product(x, ws) if self.decode else None
        return y if y is not None else _product(x, self.derived.get(ws))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The n products, or None (as `product`)."""
        y = self.product(x)
        return None if y is None else list(y.split([m.out_features for m in self.modules], -1))


def prepare_inference(model: nn.Module, *, fuse: bool = True, pack: int | None = None,
                      decode: bool = False) -> dict[str, int]:
    """Set up `model` for an inference engine (module docstring): with `fuse`, every module that
    names weights to fuse (a `FUSE` tuple of sub-module names) gets its `FusedProducts`; with
    `pack` (the batch size to pack for), every `Linear` and fused product uses packed weights; with
    `decode`, their products of at most 8 rows (32 on its AMX form) run on the decode kernel, built
    here (not in the first decode step) where it is not built yet, packing for at most 8 rows is
    skipped, and a model with `fused_decode` runs its decode steps of 1-32 rows one C++ call a layer
    (`kernels/decode_layer.py`; "layers" counts such models). Calling
    it again replaces the previous set-up (fuse=False, pack=None, decode=False: the plain model).
    Returns how many modules got each ("decode": 0 where the kernel is unavailable, for the reason
    `decode_products.unavailable()` gives)."""
    if decode:
        from opencomposer.kernels import decode_products

        decode = decode_products.load() is not None
        if decode and pack is not None and pack <= decode_products.MAX_ROWS:
            # Packed for at most 8 rows, the copy would serve only what the kernel does not take:
            # prefill, which ran as fast or faster unpacked (512 / 1,600 tokens, SmolLM2: 1.08 / 3.94 s
            # packed against 1.09 / 3.53 s, scratch, 3 rounds): skip the ~540 MB copy.
            pack = None
    n = {"fused": 0, "packed": 0, "decode": 0, "layers": 0}
    for m in model.modules():
        if hasattr(type(m), "fused_decode"):  # a model whose decode steps can run one C++ call a layer
            from opencomposer.kernels import decode_layer

            m.fused_decode = bool(decode) and decode_layer.op() is not None
            n["layers"] += m.fused_decode
        names = getattr(type(m), "FUSE", None)
        if names:
            m.fused = FusedProducts([getattr(m, k) for k in names], pack, decode) if fuse else None
            n["fused"] += bool(fuse)
        if isinstance(m, Linear):
            m.packed = _Derived(pack) if pack else None
            m.decode = decode
            n["packed"] += bool(pack)
            n["decode"] += decode
    return n
