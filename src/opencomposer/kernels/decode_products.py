"""Decode-sized float32 products on an x86 CPU: `x @ cat(w_1, ..., w_n).T` for 1-8 rows of x, in a
small AVX2 kernel compiled on first use (`torch.utils.cpp_extension`, g++ and ninja), with a 16-lane
form of it chosen at run time on CPUs with AVX-512F (`set_wide`), and, for 9-32 rows on CPUs with
AMX-BF16 (Intel Xeon since Sapphire Rapids), a form on the tile unit (`set_amx`, below; its source
in `decode_amx.py`).

Why: a decode step multiplies a handful of rows (one per running sequence) by every weight of the
model, so it is a stream over the weights, and its speed is how fast they are read. On this
project's AVX2-only EPYC, oneDNN's product read cold weights at about 13 GB/s at 8 rows and MKL's
at about 7, against a machine that streams 30+ GB/s (docs/benchmarks.md, "Decode against
transformers and the roofline"). The kernel below reads each weight row once, from front to back,
and does all of the step's rows against it while it is in registers: R weight rows at a time, 8
lanes of k per load, one accumulator per (weight row, input row), split over torch's intra-op
threads by weight rows. Several weights (q/k/v, gate/up) go in one call with no concatenated copy.
Where 5-8 rows of x pass 32 KB and so would not stay in L1 (at 6-8 rows SmolLM2's down product, K =
1,536), the 8-lane form takes k in chunks with the partial sums kept between them: the same bits,
1.08-1.30x on 60 such products at 6-8 rows on the AVX2-only EPYC (`set_chunked`; docs/inference.md).
It prefetches the weight rows two blocks ahead into L2 while it works on a block, so the reads
overlap the arithmetic: on the AMD EPYC (Zen 4) SmolLM2's layer products took 15.4 / 17.5 / 44.8 ms
at 1 / 8 / 32 rows so, against 18.2 / 23.3 / 51.7 when it prefetched one block ahead into L1 from 4
rows on (as it did until 2026-12-06; docs/inference.md). Past 8 rows, in the 16-lane form, the
groups of inputs after a tile's first bring the next tile's rows into L2 while they compute
(`Ahead`): 1.04-1.16x on SmolLM2's layer products at 32 rows on the same host.

The 16-lane form (AVX-512F) holds up to 24 accumulators in its 32 registers: at 8 inputs 3 weight
rows at a time (11 loads feed 24 FMAs, against 9 loads for 8 in AVX2), at 3-4 inputs 6. Over
SmolLM2's products and head, cold, on an AMD EPYC Zen 4 (2 threads, a scratch script, 7 rounds,
medians): 21.2 / 29.8 / 41.8 / 66.8 ms at 1 / 8 / 16 / 32 rows against AVX2's 23.4 / 35.0 / 43.7 / 67.5
(docs/inference.md).

Numerics: every output is one dot product accumulated over k in order in 8 float32 lanes (16 in
the wide form), then summed across the lanes; the same bits for a row whatever else is in the batch
(for 1-8 rows, and past 8 in the op in these two forms), and within float32 rounding of oneDNN's
(tests/unit/test_decode_products.py). The two forms give different bits, so a process uses one.

The AMX form (9-32 rows; on by default where the CPU has AMX-BF16 and AVX-512 BF16, Linux grants
the process the tiles and g++ 11 or later builds them; `OPENCOMPOSER_DECODE_AMX=off` or
`set_amx(False)` turns it off): at 9-32 rows the 16-lane form's FMAs take about as long as its
weight stream on such a CPU, and the two take turns (docs/inference.md).
Each float32 of x and w is split by truncation into three bfloat16 limbs that sum back to it
exactly, and the six limb products whose orders add to at most 2 are accumulated in float32 by the
tile unit: within float32 rounding of a float64 reference (2-3x the 16-lane form's distance from it
in tests/unit/test_decode_products.py), the same bits for a row whatever else is in a batch of 9-32
rows, but not the bits the same row gets in a batch of 1-8 (the other forms). The weights are read
as they are stored, once, and split on the fly (no second copy). On the AMX Xeon, SmolLM2's 30
layers of products took 23.0 / 23.0 / 27.5 / 28.5 ms at 9 / 16 / 24 / 32 rows against the 16-lane
form's 25.2 / 29.6 / 36.6 / 42.4 (1.10-1.49x; weights read cold, a scratch script, 7 rounds,
medians; docs/inference.md); two blocks of weight rows a step at 17-32 rows and a cheaper split
made them 1.07-1.11x faster again at 16-32 rows, 1.03-1.10x at 9 (2026-12-07). Where it runs,
`products` takes up to 32 rows (the head of a decode step, and products outside the fused layer).

Where it does not apply it says so with None, and the caller uses oneDNN: more than 8 rows (32
where the AMX form runs), not float32, not CPU, a CPU without AVX2 and FMA, no compiler (the first
failure is logged once), or `OPENCOMPOSER_DECODE_PRODUCTS=off`. The build lands in torch's extension folder
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`) under a lock, so processes that start
together (a test session and the servers it starts) build it once; in a folder of its own per Python
environment, since torch rebuilds an extension whose flags changed and the flags name the
environment's include paths (two checkouts' venvs sharing one folder rebuilt it, ~1 min, each time
the other had run). The same extension holds the fused decode layer (`decode_layer.py`), which calls
the kernel from C++. The C++ op also takes more than 8 rows on the 16- and 8-lane forms (groups of 4
against one L2-sized tile of weight rows): `products` sends it more than 8 only where the AMX form
runs, the fused layer in every form, for decode steps of 9-32 rows (tests/unit/test_decode_products.py
checks that path too, in each form).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 8
AMX_ROWS = 32  # the most rows `products` takes where the AMX form runs (`set_amx`)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <atomic>

static inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// The next tile's weight rows (up to 4 ranges of bytes), brought into L2 `per` lines a k-step while
// a tile's later groups of inputs compute from it (more than 8 rows, 16-lane form): their reads
// spread over the tile's work, where otherwise the next tile's first group would wait on them all
// at once. The first group, which reads a tile first, prefetches its own rows instead.
struct Ahead {
  const char* p[4];
  const char* e[4];
  int n = 0, i = 0, per = 1;
  inline void step() {
    for (int j = 0; j < per && i < n; ++j) {
      _mm_prefetch(p[i], _MM_HINT_T1);
      p[i] += 64;
      if (p[i] >= e[i]) ++i;
    }
  }
};

// y[b, n] = sum_k x[b, k] w[n, k] for weight rows n in [n0, n1): R of them at a time, B inputs.
template <int R, int B>
static void block(const float* x, int64_t sx, const float* w, int64_t sw, float* y, int64_t sy,
                  int64_t K, int64_t n0, int64_t n1) {
  const int64_t K8 = K & ~int64_t(7);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m256 acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + (n + r) * sw + k);
      // The weight rows two blocks ahead, one 64-byte line per row every other step, into L2
      // (`_MM_HINT_T1`): their reads overlap this block's arithmetic (a prefetch past the end of w
      // does not fault). Into L1 one block ahead, as until 2026-12-06, was slower at every row
      // count (module docstring; docs/inference.md).
      if ((k & 15) == 0)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + (n + 2 * R + r) * sw + k), _MM_HINT_T1);
      for (int b = 0; b < B; ++b) {
        const __m256 xv = _mm256_loadu_ps(x + b * sx + k);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) {
        float s = hsum(acc[r][b]);
        for (int64_t k = K8; k < K; ++k) s += x[b * sx + k] * w[(n + r) * sw + k];
        y[b * sy + n + r] = s;
      }
  }
  if (R > 1 && n < n1) block<1, B>(x, sx, w, sw, y, sy, K, n, n1);
}

// Whether 5-8 inputs of long rows take k in chunks (`block_chunked`); a switch for comparisons, since
// both give the same bits.
static std::atomic<bool> g_chunked{true};
int64_t set_chunked(int64_t on) {
  if (on >= 0) g_chunked = on != 0;
  return g_chunked ? 1 : 0;
}

// `block<1, B>` with k in chunks whose B input rows fit in L1 (16 KB of them), for 5-8 inputs whose
// rows do not (more than 32 KB: K above 1,024 at 8 rows, as the MLP's down product, K = 1,536 in
// SmolLM2). Otherwise every weight row reads all of x again from L2, and a k-step's 8 input loads wait
// on it: at 8 rows that product streamed its weights at ~7 GB/s on the AVX2-only EPYC (Zen 3), 2
// threads, against ~19 at K = 576. On that host 60 such products (576 x 1,536, cold) ran 1.15-1.20x /
// 1.17-1.30x / 1.08x faster so at 8 / 7 / 6 rows (two runs), and 0.96-0.98x at 5 (30 KB of x, left
// unchunked). A tile of T weight rows takes chunk after chunk, each row's 8-lane partial sums kept in
// `part` between chunks: the same FMAs in the same order per lane, so the same bits as `block`. Weight
// bytes are still read once, a row's chunk at a time.
template <int B>
static void block_chunked(const float* x, int64_t sx, const float* w, int64_t sw, float* y, int64_t sy,
                          int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t T = 24;
  alignas(32) float part[T][B][8];
  const int64_t K8 = K & ~int64_t(7);
  const int64_t chunks = (B * K8 * 4 + 16 * 1024 - 1) / (16 * 1024);
  const int64_t KC = ((K8 + chunks - 1) / chunks + 7) & ~int64_t(7);
  for (int64_t t0 = n0; t0 < n1; t0 += T) {
    const int64_t t1 = std::min(n1, t0 + T);
    for (int64_t k0 = 0; k0 < K8; k0 += KC) {
      const int64_t k1 = std::min(K8, k0 + KC);
      for (int64_t n = t0; n < t1; ++n) {
        __m256 acc[B];
        for (int b = 0; b < B; ++b) acc[b] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(part[n - t0][b]);
        const float* wr = w + n * sw;
        // the row read two rows after this one, in this order: within the tile, this chunk; past its
        // end, the tile's first rows at the next chunk (or the next tile's, after the last chunk)
        const float* ahead = n + 2 < t1 ? w + (n + 2) * sw : k1 < K8 ? w + (t0 + n + 2 - t1) * sw + KC
                                                                     : w + (n + 2) * sw - k0;
        for (int64_t k = k0; k < k1; k += 8) {
          const __m256 wv = _mm256_loadu_ps(wr + k);
          if ((k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T1);
          for (int b = 0; b < B; ++b) acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * sx + k), acc[b]);
        }
        if (k1 < K8) {
          for (int b = 0; b < B; ++b) _mm256_store_ps(part[n - t0][b], acc[b]);
          continue;
        }
        for (int b = 0; b < B; ++b) {
          float s = hsum(acc[b]);
          for (int64_t k = K8; k < K; ++k) s += x[b * sx + k] * wr[k];
          y[b * sy + n] = s;
        }
      }
    }
  }
}

template <int B>
static void rows_of(const float* x, int64_t sx, const float* w, int64_t sw, float* y, int64_t sy, int64_t K,
                    int64_t n0, int64_t n1, Ahead*) {
  // Up to 12 accumulators plus the loaded weight rows and an input fit AVX2's 16 registers. At 3-4
  // inputs, 3 weight rows: 7 loads feed 12 FMAs (at 8 inputs, 9 feed 8), which is what more than 8
  // rows run on (below).
  constexpr int R = B <= 2 ? 4 : B <= 4 ? 3 : 1;
  if (R == 1 && B * K * 4 > 32 * 1024 && g_chunked)
    block_chunked<B>(x, sx, w, sw, y, sy, K, n0, n1);
  else
    block<R, B>(x, sx, w, sw, y, sy, K, n0, n1);
}

// The same products in 16 lanes, for CPUs with AVX-512 (compiled for it here, chosen at run time):
// 32 registers hold 24 accumulators, so a block takes more weight rows per input row than AVX2's 16
// allow (at 8 inputs, 3 weight rows: 11 loads feed 24 FMAs, against 9 for 8), and a load brings 16
// floats. Every output is one 16-lane accumulator over k in order, then `_mm512_reduce_add_ps`:
// the same bits for a row whatever the batch and block, but not AVX2's bits.
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
template <int R, int B>
static void block16(const float* x, int64_t sx, const float* w, int64_t sw, float* y, int64_t sy,
                    int64_t K, int64_t n0, int64_t n1, Ahead* ah) {
  const int64_t K16 = K & ~int64_t(15);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + (n + r) * sw + k);
      // as in `block`: a line of each of the weight rows two blocks ahead, into L2; or, in a tile's
      // later groups, the next tile's lines (`Ahead`)
      if (!ah)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + (n + 2 * R + r) * sw + k), _MM_HINT_T1);
      else
        ah->step();
      for (int b = 0; b < B; ++b) {
        const __m512 xv = _mm512_loadu_ps(x + b * sx + k);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) {
        float s = _mm512_reduce_add_ps(acc[r][b]);
        for (int64_t k = K16; k < K; ++k) s += x[b * sx + k] * w[(n + r) * sw + k];
        y[b * sy + n + r] = s;
      }
  }
  if (R > 1 && n < n1) block16<1, B>(x, sx, w, sw, y, sy, K, n, n1, ah);
}

template <int B>
static void rows16_of(const float* x, int64_t sx, const float* w, int64_t sw, float* y, int64_t sy, int64_t K,
                      int64_t n0, int64_t n1, Ahead* ah) {
  // R x B accumulators + R weight rows + one input within 32 registers
  constexpr int R = B <= 2 ? 8 : B <= 4 ? 6 : B <= 6 ? 4 : 3;
  block16<R, B>(x, sx, w, sw, y, sy, K, n0, n1, ah);
}

#pragma GCC pop_options

// B rows on one of the two forms: rows_of<B> (8 lanes) or rows16_of<B> (16)
#define OC_ROWS(n) (w16 ? rows16_of<n> : rows_of<n>)(x, sx, w, sw, y, sy, K, n0, n1, ah)
static void chunk(bool w16, int64_t B, const float* x, int64_t sx, const float* w, int64_t sw, float* y,
                  int64_t sy, int64_t K, int64_t n0, int64_t n1, Ahead* ah) {
  switch (B) {
    case 1: OC_ROWS(1); break;
    case 2: OC_ROWS(2); break;
    case 3: OC_ROWS(3); break;
    case 4: OC_ROWS(4); break;
    case 5: OC_ROWS(5); break;
    case 6: OC_ROWS(6); break;
    case 7: OC_ROWS(7); break;
    default: OC_ROWS(8); break;
  }
}
#undef OC_ROWS

// Which kernel runs: 16 lanes where the CPU has AVX-512F (unless turned off), else 8.
static std::atomic<int> g_wide{-1};  // -1: not chosen yet (atomic: a benchmark may switch it while a server decodes)
static bool wide() {
  if (g_wide < 0) {
    __builtin_cpu_init();
    g_wide = __builtin_cpu_supports("avx512f") ? 1 : 0;
  }
  return g_wide == 1;
}

// on: 1 or 0 to choose (1 only where the CPU has AVX-512F), -1 to ask; returns the choice in force.
int64_t set_wide(int64_t on) {
  if (on >= 0) {
    __builtin_cpu_init();
    g_wide = (on && __builtin_cpu_supports("avx512f")) ? 1 : 0;
  }
  return wide() ? 1 : 0;
}

torch::Tensor products(const torch::Tensor& x, const std::vector<torch::Tensor>& ws) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x: (B, K) float32, rows contiguous");
  const int64_t B = x.size(0), K = x.size(1);
  TORCH_CHECK(B >= 1, "at least one row");
  std::vector<const float*> ptrs;
  std::vector<int64_t> strides, starts{0};
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == torch::kFloat && w.stride(1) == 1,
                "each weight: (N, K) float32, rows contiguous");
    ptrs.push_back(w.data_ptr<float>());
    strides.push_back(w.stride(0));
    starts.push_back(starts.back() + w.size(0));
  }
  const int64_t N = starts.back();
  auto y = torch::empty({B, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sx = x.stride(0);
#ifdef OC_AMX
  if (B > 8 && B <= 32 && N > 0 && amx_on()) {
    oc_amx::products(xp, sx, B, K, ptrs, strides, starts, yp);
    return y;
  }
#endif
  // Threads split the weight rows. Within a thread, a tile of weight rows small enough to stay in
  // L2 meets every group of input rows before the next tile is read: more than 8 rows read the
  // weights from memory once, in groups of 4 (fewer loads per FMA than groups of 8, and at 9-32 rows
  // the product is bound by arithmetic, not by memory: docs/inference.md), and each output is
  // computed exactly as with 8 or fewer (one 8-lane accumulator over k in order, whatever the group).
  const bool w16 = wide();
  // a tile a multiple of 12, so blocks of 3, 4 and 6 weight rows fill it
  const int64_t tile = std::max<int64_t>(12, (128 * 1024) / (4 * K) / 12 * 12);
  const int64_t group = B > 8 ? 4 : 8;
  const int64_t groups = (B + group - 1) / group;
  // The next tile's rows stream in during the later groups in the 16-lane form only: there they took
  // SmolLM2's layer products at 9 / 16 / 32 rows 1.15 / 1.13 / 1.04-1.16x faster on the AMD EPYC
  // (Zen 4); the 8-lane form on the same host was 0.93 / 0.95 / 1.08x, and on an AVX2-only EPYC (Zen 3),
  // where that form runs, the engine's decode at batch 32 was 0.94x with it (docs/inference.md).
  const bool next = groups > 1 && w16;
  at::parallel_for(0, N, 128, [&](int64_t a, int64_t b) {
    for (int64_t t0 = a; t0 < b; t0 += tile) {
      const int64_t t1 = std::min(b, t0 + tile), t2 = std::min(b, t1 + tile);
      // the next tile's rows, for the groups after the first to bring into L2
      Ahead ah;
      int64_t bytes = 0;
      for (size_t i = 0; next && i + 1 < starts.size() && ah.n < 4; ++i) {
        const int64_t lo = std::max(t1, starts[i]), hi = std::min(t2, starts[i + 1]);
        if (lo < hi) {
          ah.p[ah.n] = reinterpret_cast<const char*>(ptrs[i] + (lo - starts[i]) * strides[i]);
          ah.e[ah.n] = reinterpret_cast<const char*>(ptrs[i] + (hi - starts[i]) * strides[i]);
          bytes += ah.e[ah.n] - ah.p[ah.n];
          ++ah.n;
        }
      }
      // the later groups' k-steps (R = 6 weight rows a block in groups of 4): the tile's lines spread over them
      if (ah.n > 0) {
        const int64_t steps = (groups - 1) * std::max<int64_t>(1, (t1 - t0) / 6) * std::max<int64_t>(1, K / 16);
        ah.per = int(std::min<int64_t>(8, std::max<int64_t>(1, (bytes / 64 + steps - 1) / steps)));
      }
      for (int64_t r0 = 0; r0 < B; r0 += group) {
        const int64_t nb = std::min<int64_t>(group, B - r0);
        for (size_t i = 0; i + 1 < starts.size(); ++i) {
          const int64_t lo = std::max(t0, starts[i]), hi = std::min(t1, starts[i + 1]);
          if (lo < hi)
            chunk(w16, nb, xp + r0 * sx, sx, ptrs[i], strides[i], yp + r0 * N + starts[i], N, K,
                  lo - starts[i], hi - starts[i], r0 > 0 && ah.n > 0 ? &ah : nullptr);
        }
      }
    }
  });
  return y;
}

TORCH_LIBRARY(opencomposer_decode, m) {
  m.def("products(Tensor x, Tensor[] ws) -> Tensor");
  m.def("set_wide(int on) -> int", &set_wide);
  m.def("set_amx(int on) -> int", &set_amx);
  m.def("set_chunked(int on) -> int", &set_chunked);
}
TORCH_LIBRARY_IMPL(opencomposer_decode, CPU, m) { m.impl("products", &products); }
"""

_lock = threading.Lock()
_state: dict = {"op": None, "tried": False, "why": None, "enabled": None, "amx": False}


def _cpu_has_avx2() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except (AttributeError, RuntimeError):
        return False


def enabled() -> bool:
    """Whether products may use the kernel (on unless OPENCOMPOSER_DECODE_PRODUCTS=off or set_enabled(False))."""
    if _state["enabled"] is None:
        _state["enabled"] = os.environ.get("OPENCOMPOSER_DECODE_PRODUCTS", "on").lower() not in ("off", "0", "false")
    return _state["enabled"]


def set_enabled(on: bool) -> bool:
    """Turn the kernel on or off in this process (for comparisons); returns the setting before."""
    before = enabled()
    _state["enabled"] = bool(on)
    return before


def load():
    """The compiled op, building it on first call; None (with the reason in `unavailable()`) where it cannot."""
    if _state["tried"]:
        return _state["op"]
    with _lock:
        if not _state["tried"]:
            _state["op"] = _build()
            _state["tried"] = True
    return _state["op"]


def _switch(name: str, on: bool | None) -> bool:
    """The C++ switch `name` (1 or 0 to choose, -1 to ask), returning the choice in force; False
    where the kernel is not built."""
    if load() is None:
        return False
    return bool(getattr(torch.ops.opencomposer_decode, name)(-1 if on is None else int(bool(on))))


def set_wide(on: bool | None = None) -> bool:
    """Whether the 16-lane (AVX-512) kernel runs, after choosing it (on: only where the CPU has
    AVX-512F) or, with None, only asking; False where the kernel is not built."""
    return _switch("set_wide", on)


def set_amx(on: bool | None = None) -> bool:
    """Whether products of 9-32 rows (the fused decode layer's, and `products`' own: the head's) run on
    the AMX form, after choosing it (on: only where the CPU has AMX-BF16 and AVX-512 BF16, Linux
    grants the tiles and the compiler knows them) or, with None, only asking; False where the kernel
    is not built. On by default where it can run, unless OPENCOMPOSER_DECODE_AMX=off."""
    if load() is None:
        return False
    _state["amx"] = _switch("set_amx", on)
    return _state["amx"]


def set_chunked(on: bool | None = None) -> bool:
    """Whether products of 5-8 rows whose rows of x pass 32 KB (K above 1,024 at 8 rows) take k in
    chunks in the 8-lane form (on by default; the same bits either way), after choosing it or, with
    None, only asking; False where the kernel is not built. A switch for comparisons."""
    return _switch("set_chunked", on)


def unavailable() -> str | None:
    """Why the kernel is not available in this process (None: it is, or it was not asked for yet)."""
    return _state["why"]


def _build():
    if not _cpu_has_avx2():
        _state["why"] = f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
        log.warning("decode-products kernel not used: %s; products stay on oneDNN", _state["why"])
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        try:  # the `ninja` wheel's binary: torch runs `ninja` from PATH, where a venv's bin may not be
            import ninja

            if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass

        from opencomposer.kernels import decode_amx, decode_layer, logit_stats

        env = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:10]
        # one extension: the fused decode layer (`decode_layer.py`) runs its products on this kernel, and
        # sampling's row statistics (`logit_stats.py`) use the layer's exp
        load_inline(name=f"opencomposer_decode_products_{env}",
                    cpp_sources=[decode_amx.SOURCE, _SOURCE, decode_layer.SOURCE, logit_stats.SOURCE],
                    is_python_module=False,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
        off = os.environ.get("OPENCOMPOSER_DECODE_AMX", "on").lower() in ("off", "0", "false")
        _state["amx"] = bool(torch.ops.opencomposer_decode.set_amx(0 if off else -1))
        return torch.ops.opencomposer_decode.products
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: oneDNN keeps every product
        _state["why"] = f"could not build the decode-products kernel ({type(e).__name__}: {str(e)[:300]})"
        log.warning("%s; products stay on oneDNN", _state["why"])
        return None


def products(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor | None:
    """`x @ cat(ws).T` for x (..., K) with at most 8 rows (32 where the AMX form runs: `set_amx`), or
    None where the kernel does not apply (module docstring). No autograd: the caller runs it only
    where no gradient flows."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not (1 <= rows <= AMX_ROWS) or not enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 or w.shape[1] != k
           or w.stride(1) != 1 or w.is_mkldnn for w in ws):
        return None
    op = load()
    # `_state["amx"]` mirrors the op's choice (set where it is made: the build, `set_amx`), so this
    # hot path asks no C++ call
    if op is None or (rows > MAX_ROWS and not _state.get("amx")):
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = op(x2, [w.detach() for w in ws])
    return y.view(*x.shape[:-1], y.shape[-1])
