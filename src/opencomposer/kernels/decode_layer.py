"""One decoder layer of the dense family (`model/llama.py`) for a decode step, as one C++ call: the
norms, the q/k/v, output and MLP products (on `decode_products`' kernel), RoPE, the cache write,
attention over each row's cached keys and SwiGLU, for 1-32 rows of one new token each, float32
(past 8 rows the products take them in groups of 4).

Why: in eager mode a batch-8 decode step of SmolLM2-135M made ~130 torch calls a layer (norms,
RoPE, the cache write, attention, views), each a few microseconds of dispatch and Python. Profiled
on the AVX-512 Xeon (2 cores, 2026-12-05): the products took ~38 of a ~70 ms step and those calls
most of the rest (docs/inference.md). Here a layer is one call; what a step still does in Python is
the embedding, the rotary tables, the final norm and the head.

Numerics: the same steps in float32 as the eager layer, in a different order of summation (the
norm's mean, the attention's dot products and softmax sum), and `exp` from a polynomial (Cephes'
expf, as in avx_mathfun; its own error was not measured here) where torch uses its own vectorised
one; so logits differ from the eager path's by float32 rounding, well inside the train/serve bound
of 1e-4 that the conformance tests assert
(`tests/unit/test_decode_layer.py` compares both paths). Each row's attention reads only its own
keys (its slot, or for positions inside a shared prefix the one slot all sharing rows read it from:
the same bytes, so the rows read the same memory, which can stay in cache between them; how often
it does was not measured), so a row's output does not depend on the other rows in the batch.
While a task (a row and a key head) computes its attention, it brings the next task's keys and
values into L2 (`set_kv_prefetch`; they are read cold, and a task that waited on its own read them
at about half a plain stream's rate): SmolLM2's 30 fused layers of a 32-row step at 96-300 positions
1.02-1.09x faster on the AMX Xeon, no bit changed (docs/inference.md).

It runs where `prepare_inference(decode=True)` enabled it, the decode-products kernel was built (the
layer is compiled into the same extension), the step decodes one token per row without gradients,
in float32 on CPU, with at most 32 rows, a head size that is a multiple of 8 and every layer weight a
contiguous float32 tensor; everywhere else the eager layer runs. `OPENCOMPOSER_DECODE_LAYER=off` turns it off alone.
"""

from __future__ import annotations

import os

import torch

from opencomposer.kernels import decode_products

SOURCE = r"""
// exp(x) for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial),
// the form of avx_mathfun (its error not measured here; the layer's logits are, against the eager path).
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// a[i] = exp(a[i] - shift) for i < n; returns their sum
static float exp_shifted(float* a, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(a + i), s));
    _mm256_storeu_ps(a + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  if (i < n) {
    alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = i; j < n; ++j) tail[j - i] = a[j] - shift;
    __m256 e = exp8(_mm256_load_ps(tail));
    _mm256_store_ps(tail, e);
    for (int64_t j = i; j < n; ++j) { a[j] = tail[j - i]; total += tail[j - i]; }
  }
  return total;
}

// y = x / sqrt(mean(x^2) + eps) * w for each of B rows of D (torch's rms_norm: (x * r) * w)
static void rms_rows(const float* x, const float* w, float* y, int64_t B, int64_t D, float eps) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x + b * D;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) { __m256 v = _mm256_loadu_ps(xr + i); acc = _mm256_fmadd_ps(v, v, acc); }
    float ss = hsum(acc);
    for (; i < D; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / float(D) + eps);
    for (int64_t j = 0; j < D; ++j) y[b * D + j] = (xr[j] * r) * w[j];
  }
}

// rotate-half RoPE of one head in place: x * cos + roll(x, D/2) * sin', sin' = sin with its first half negated
static void rope_head(float* x, const float* c, const float* s, int64_t D) {
  float tmp[512];
  const int64_t h = D / 2;  // two halves, no index modulo: a division per element cost ~6 ms a 32-row step
  for (int64_t i = 0; i < h; ++i) tmp[i] = x[i] * c[i] + x[i + h] * s[i];
  for (int64_t i = h; i < D; ++i) tmp[i] = x[i] * c[i] + x[i - h] * s[i];
  std::memcpy(x, tmp, D * sizeof(float));
}

// a[u] += the products of NV vectors of a query (from `off`) with the same of keys kr[u], u < 8
template <int NV>
static inline void dot8(const float* qv, const float* const* kr, int64_t off, __m256* a) {
  for (int i = 0; i < NV; ++i) {
    const __m256 qi = _mm256_loadu_ps(qv + off + 8 * i);
    for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(kr[u] + off + 8 * i), a[u]);
  }
}

// [sum of a[0], ..., sum of a[7]]
static inline __m256 hsum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[q L + p] = scale * (query q . key p) for the g query heads of one key head (queries g rows
// of hd from qv) and p < L (keys below P from kpre, the rest from kown). Eight positions at a time,
// each one 8-lane accumulator over the head in order, then one 8-way reduction: eight independent
// chains of FMAs, where one dot product at a time waited on each FMA's latency (8 rows at 1,000
// positions, one layer's attention: 595 -> 362 us with its keys in cache). The g heads take their
// turns on the same eight keys, read once for all of them (docs/inference.md).
static void scores(const float* qv, int64_t g, const float* kpre, const float* kown, int64_t P, int64_t L,
                   int64_t hd, float scale, float* out, Ahead* ah) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t p0 = 0; p0 < L; p0 += 8) {
    if (ah) ah->step();
    const float* kr[8];
    for (int u = 0; u < 8; ++u) {
      const int64_t p = std::min(p0 + u, L - 1);  // past the end: a repeat, its score not kept
      kr[u] = (p < P ? kpre : kown) + p * hd;
    }
    for (int64_t q = 0; q < g; ++q) {
      const float* qq = qv + q * hd;
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
      int64_t off = 0;
      for (; off + 64 <= hd; off += 64) dot8<8>(qq, kr, off, a);
      switch ((hd - off) / 8) {
        case 1: dot8<1>(qq, kr, off, a); break;
        case 2: dot8<2>(qq, kr, off, a); break;
        case 3: dot8<3>(qq, kr, off, a); break;
        case 4: dot8<4>(qq, kr, off, a); break;
        case 5: dot8<5>(qq, kr, off, a); break;
        case 6: dot8<6>(qq, kr, off, a); break;
        case 7: dot8<7>(qq, kr, off, a); break;
        default: break;
      }
      const __m256 r = _mm256_mul_ps(hsum8x8(a), sv);
      float* dst = out + q * L + p0;
      if (p0 + 8 <= L) {
        _mm256_storeu_ps(dst, r);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, r);
        for (int64_t u = 0; p0 + u < L; ++u) dst[u] = t[u];
      }
    }
  }
}

// o[q hd + d0 + i] = inv[q] * sum over p < L of w[q L + p] * value p [d0 + i], for G query heads
// and i < 8 NV: G * NV accumulators in registers, each summed over p in order, and each value read
// once for the G heads.
template <int G, int NV>
static void weigh(const float* w, int64_t L, const float* vpre, const float* vown, int64_t P, int64_t hd,
                  int64_t d0, const float* inv, float* o, Ahead* ah) {
  __m256 acc[G][NV];
  for (int q = 0; q < G; ++q)
    for (int i = 0; i < NV; ++i) acc[q][i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < L; ++p) {
    if (ah) ah->step();
    const float* vr = (p < P ? vpre : vown) + p * hd + d0;
    __m256 wp[G];
    for (int q = 0; q < G; ++q) wp[q] = _mm256_set1_ps(w[q * L + p]);
    for (int i = 0; i < NV; ++i) {
      const __m256 v = _mm256_loadu_ps(vr + 8 * i);
      for (int q = 0; q < G; ++q) acc[q][i] = _mm256_fmadd_ps(wp[q], v, acc[q][i]);
    }
  }
  for (int q = 0; q < G; ++q)
    for (int i = 0; i < NV; ++i)
      _mm256_storeu_ps(o + q * hd + d0 + 8 * i, _mm256_mul_ps(acc[q][i], _mm256_set1_ps(inv[q])));
}

// the values' part of attention for g heads: up to 3 heads and 32 dimensions at a time (12
// accumulators, 3 weights and a value in AVX2's 16 registers)
template <int G>
static void weigh_heads(const float* w, int64_t L, const float* vpre, const float* vown, int64_t P, int64_t hd,
                        const float* inv, float* o, Ahead* ah) {
  int64_t d0 = 0;
  for (; d0 + 32 <= hd; d0 += 32) weigh<G, 4>(w, L, vpre, vown, P, hd, d0, inv, o, ah);
  switch ((hd - d0) / 8) {
    case 1: weigh<G, 1>(w, L, vpre, vown, P, hd, d0, inv, o, ah); break;
    case 2: weigh<G, 2>(w, L, vpre, vown, P, hd, d0, inv, o, ah); break;
    case 3: weigh<G, 3>(w, L, vpre, vown, P, hd, d0, inv, o, ah); break;
    default: break;
  }
}

// Whether a task brings the next task's keys and values into L2 (on unless switched off for a comparison;
// atomic: a benchmark may switch it while a server decodes)
static std::atomic<int> g_kv_ahead{1};
int64_t set_kv_ahead(int64_t on) {
  if (on >= 0) g_kv_ahead = on ? 1 : 0;
  return g_kv_ahead;
}

// One decode step of one layer, in place on x (B, D). ws: input norm, q, k, v, o, post-attention
// norm, gate, up, down. ks / vs: the layer's cache (slots, Hk, cap, hd). Row b writes its new key
// and value at position starts[b] of slot slots[b] and attends over positions [0, starts[b]]: those
// below prefix[b] from slot src[b] (a prefix that slot holds the same bytes of), the rest from its own.
torch::Tensor layer(torch::Tensor x, const std::vector<torch::Tensor>& ws, torch::Tensor ks, torch::Tensor vs,
                    const torch::Tensor& slots, const torch::Tensor& starts, const torch::Tensor& src,
                    const torch::Tensor& prefix, const torch::Tensor& cos, const torch::Tensor& sin, double eps,
                    int64_t hq, int64_t hk) {
  TORCH_CHECK(ws.size() == 9, "nine weights: norm, q, k, v, o, norm, gate, up, down");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: (B, D) float32, contiguous");
  TORCH_CHECK(ks.is_contiguous() && vs.is_contiguous() && ks.scalar_type() == torch::kFloat &&
              vs.scalar_type() == torch::kFloat && ks.dim() == 4 && ks.sizes() == vs.sizes(),
              "cache: (slots, Hk, cap, hd) float32");
  const int64_t B = x.size(0), D = x.size(1), hd = ks.size(3), cap = ks.size(2), g = hq / hk;
  TORCH_CHECK(B >= 1 && B <= 64, "1-64 rows");
  TORCH_CHECK(hd % 8 == 0 && hd <= 512 && ks.size(1) == hk && hq % hk == 0, "head size a multiple of 8, GQA heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * hd && sin.numel() == B * hd,
              "cos/sin (B, hd)");
  for (const auto& t : {slots, starts, src, prefix})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.numel() == B && t.is_contiguous(), "rows: (B,) int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* sr = src.data_ptr<int64_t>();
  const int64_t* pf = prefix.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] < ks.size(0) && sr[b] >= 0 && sr[b] < ks.size(0) && st[b] >= 0 && st[b] < cap &&
                pf[b] >= 0 && pf[b] <= st[b], "row ", b, " outside the cache");
  const float eps_f = float(eps);
  float* xp = x.data_ptr<float>();

  // attention block
  auto h = torch::empty({B, D}, x.options());
  rms_rows(xp, ws[0].data_ptr<float>(), h.data_ptr<float>(), B, D, eps_f);
  auto qkv = products(h, {ws[1], ws[2], ws[3]});  // (B, (hq + 2 hk) hd): q heads, k heads, v heads
  const int64_t nqkv = qkv.size(1);
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kst = ks.data_ptr<float>();
  float* vst = vs.data_ptr<float>();
  const int64_t s_slot = hk * cap * hd, s_head = cap * hd;
  auto att = torch::empty({B, hq * hd}, x.options());
  float* ap = att.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(float(hd));
  // One task per (row, key head): RoPE on the key head and its g query heads, the new key and value
  // into the row's slot, then attention over the row's positions. A task touches only its own row's
  // heads and slot (a shared prefix is read, never written: it ends before the new position).
  at::parallel_for(0, B * hk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sc, inv(g);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / hk, j = t % hk, L = st[b] + 1, P = pf[b];
      float* qrow = qp + b * nqkv;
      float* kn = qrow + (hq + j) * hd;
      const float* vn = qrow + (hq + hk + j) * hd;
      rope_head(kn, cp + b * hd, sp + b * hd, hd);
      for (int64_t q = 0; q < g; ++q) rope_head(qrow + (j * g + q) * hd, cp + b * hd, sp + b * hd, hd);
      std::memcpy(kst + sl[b] * s_slot + j * s_head + st[b] * hd, kn, hd * sizeof(float));
      std::memcpy(vst + sl[b] * s_slot + j * s_head + st[b] * hd, vn, hd * sizeof(float));
      const float* kown = kst + sl[b] * s_slot + j * s_head;
      const float* vown = vst + sl[b] * s_slot + j * s_head;
      const float* kpre = kst + sr[b] * s_slot + j * s_head;
      const float* vpre = vst + sr[b] * s_slot + j * s_head;
      sc.resize(g * L);
      // The next task's keys and values (when this thread runs it), brought into L2 (`Ahead`) a few
      // lines a step of this task's scores and values, spread over its work: the keys and values are
      // read cold, and a task that waited on its own read them at about half a plain stream's rate
      // (docs/inference.md).
      Ahead ah;
      Ahead* ahp = nullptr;
      if (g_kv_ahead && t + 1 < t1) {
        const int64_t b2 = (t + 1) / hk, j2 = (t + 1) % hk, L2 = st[b2] + 1, P2 = pf[b2];
        const float* ko = kst + sl[b2] * s_slot + j2 * s_head;
        const float* vo = vst + sl[b2] * s_slot + j2 * s_head;
        const float* kp = kst + sr[b2] * s_slot + j2 * s_head;
        const float* vp = vst + sr[b2] * s_slot + j2 * s_head;
        auto add = [&](const float* a, int64_t lo, int64_t hi) {
          if (lo < hi) {
            ah.p[ah.n] = reinterpret_cast<const char*>(a + lo * hd);
            ah.e[ah.n] = reinterpret_cast<const char*>(a + hi * hd);
            ++ah.n;
          }
        };
        add(kp, 0, P2); add(ko, P2, L2); add(vp, 0, P2); add(vo, P2, L2);
        const int64_t lines = 2 * L2 * hd * 4 / 64;
        const int64_t steps = (L + 7) / 8 + ((g + 2) / 3) * ((hd + 31) / 32) * L;
        ah.per = int(std::max<int64_t>(1, (lines + steps - 1) / steps));
        ahp = &ah;
      }
      scores(qrow + j * g * hd, g, kpre, kown, P, L, hd, scale, sc.data(), ahp);
      for (int64_t q = 0; q < g; ++q) {
        float* s = sc.data() + q * L;
        float m = s[0];
        for (int64_t p = 1; p < L; ++p) m = std::max(m, s[p]);
        inv[q] = 1.0f / exp_shifted(s, L, m);
      }
      float* o = ap + b * hq * hd + j * g * hd;
      for (int64_t q0 = 0; q0 < g; q0 += 3) {
        const float* w = sc.data() + q0 * L;
        switch (std::min<int64_t>(3, g - q0)) {
          case 1: weigh_heads<1>(w, L, vpre, vown, P, hd, inv.data() + q0, o + q0 * hd, ahp); break;
          case 2: weigh_heads<2>(w, L, vpre, vown, P, hd, inv.data() + q0, o + q0 * hd, ahp); break;
          default: weigh_heads<3>(w, L, vpre, vown, P, hd, inv.data() + q0, o + q0 * hd, ahp); break;
        }
      }
    }
  });
  auto o = products(att, {ws[4]});
  const float* op = o.data_ptr<float>();
  for (int64_t i = 0; i < B * D; ++i) xp[i] += op[i];

  // MLP block: down(silu(gate) * up)
  rms_rows(xp, ws[5].data_ptr<float>(), h.data_ptr<float>(), B, D, eps_f);
  auto gu = products(h, {ws[6], ws[7]});  // (B, 2 I): gate, then up
  const int64_t I = ws[6].size(0);
  auto a = torch::empty({B, I}, x.options());
  float* gp = gu.data_ptr<float>();
  float* aa = a.data_ptr<float>();
  at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* gr = gp + b * 2 * I;
      float* e = aa + b * I;
      for (int64_t i = 0; i < I; ++i) e[i] = -gr[i];
      exp_shifted(e, I, 0.0f);  // exp(-gate)
      for (int64_t i = 0; i < I; ++i) e[i] = gr[i] / (1.0f + e[i]) * gr[I + i];
    }
  });
  auto dn = products(a, {ws[8]});
  const float* dp = dn.data_ptr<float>();
  for (int64_t i = 0; i < B * D; ++i) xp[i] += dp[i];
  return x;
}

TORCH_LIBRARY(opencomposer_decode_layer, m) {
  m.def("layer(Tensor(a!) x, Tensor[] ws, Tensor(b!) ks, Tensor(c!) vs, Tensor slots, Tensor starts, Tensor src, "
        "Tensor prefix, Tensor cos, Tensor sin, float eps, int hq, int hk) -> Tensor(a!)");
  m.def("set_kv_ahead(int on) -> int", &set_kv_ahead);
}
TORCH_LIBRARY_IMPL(opencomposer_decode_layer, CPU, m) { m.impl("layer", &layer); }
"""

MAX_ROWS = 32
_enabled: dict = {"on": None}


def enabled() -> bool:
    """On unless OPENCOMPOSER_DECODE_LAYER=off or set_enabled(False) (the decode-products kernel's
    own switch turns this off too: the layer runs its products)."""
    if _enabled["on"] is None:
        _enabled["on"] = os.environ.get("OPENCOMPOSER_DECODE_LAYER", "on").lower() not in ("off", "0", "false")
    return _enabled["on"] and decode_products.enabled()


def set_enabled(on: bool) -> bool:
    """Turn the fused layer on or off in this process (for comparisons); returns the setting before."""
    before = enabled()
    _enabled["on"] = bool(on)
    return before


def set_kv_prefetch(on: bool | None = None) -> bool:
    """Whether the layer's attention brings the next task's keys and values into L2 while a task
    computes (on by default; off only for comparisons: it moves no arithmetic), after setting it,
    or with None only asking; False where the op is not built."""
    if op() is None:
        return False
    return bool(torch.ops.opencomposer_decode_layer.set_kv_ahead(-1 if on is None else int(bool(on))))


def op():
    """The compiled layer op (built with the decode-products kernel), or None where it is unavailable."""
    if decode_products.load() is None:
        return None
    return torch.ops.opencomposer_decode_layer.layer


def applies(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a decode step with hidden states x (B, 1, D) can run on the op (module docstring)."""
    return (x.dim() == 3 and x.shape[1] == 1 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32
            and x.device.type == "cpu" and head_dim % 8 == 0 and head_dim <= 512 and not torch.is_grad_enabled()
            and enabled())
