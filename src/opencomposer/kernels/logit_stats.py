"""What sampling needs of each row of logits, without writing a (B, V) of log-probabilities: the
maximum, the first index of the maximum (the greedy token) and log(sum(exp(x - max))), in two passes
over the row, from which a token's log-probability is (x[t] - max) - that, the formula of torch's
`log_softmax`; and a drawn token, by walking the running sum of exp(x - max) to where one uniform
lands (`draw`).

Why: the decode step's sampling ran `log_softmax` over all (B, V) logits and, for greedy rows,
`argmax` too: about 1.8 ms each at 32 rows of SmolLM2's 49,152 logits in the engine on the AMX Xeon
(torch profiler, 2026-12-06), 3.6 of a ~55 ms step, and the full (B, V) of log-probabilities was
kept only to read one entry a row; a drawing row then took softmax, renormalisation, max and a
cumulative sum over the whole row (docs/inference.md has the measurements). Here the passes run on
AVX2 in the decode kernel's extension, the exponentials summed in float64.

Numerics: exp from the same polynomial as the fused decode layer (`decode_layer.py`'s `exp8`; a -inf
logit counts 0), the sum in float64 lane by lane, then in order: a log-probability within float32
rounding of `log_softmax`'s (`tests/unit/test_logit_stats.py` compares them). A row's result depends
on that row alone. Where one row has a NaN or an infinite maximum, `stats` leaves the whole call to
torch, so such rows get torch's result as before.
"""

from __future__ import annotations

import torch

from opencomposer.kernels import decode_products

# Compiled after `decode_layer.SOURCE` (it uses `exp8`), into the decode-products extension.
SOURCE = r"""
#include <cmath>
#include <limits>
// exp(x - m) of 8 logits, 0 where x is -inf (exp8 clamps its input: it would give ~1e-38 there)
static inline __m256 exp_from(const float* p, __m256 m) {
  const __m256 v = _mm256_loadu_ps(p);
  const __m256 masked = _mm256_cmp_ps(v, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  return _mm256_andnot_ps(masked, exp8(_mm256_sub_ps(v, m)));
}

// exp_from for the last k < 8 logits of a row, into out[0..k)
static inline void exp_tail(const float* p, int64_t k, __m256 m, float* out) {
  alignas(32) float t[8];
  for (int u = 0; u < 8; ++u) t[u] = u < k ? p[u] : -std::numeric_limits<float>::infinity();
  _mm256_store_ps(out, exp_from(t, m));
}

// max, first index of the max and log(sum(exp(x - max))) of one row; false where the row has a NaN or
// its max is not finite (the caller leaves those to torch)
static bool stats_row(const float* p, int64_t n, float* mx, int64_t* am, float* ls) {
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i vi = _mm256_set1_epi32(0), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 nan = _mm256_setzero_ps();
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    const __m256 gt = _mm256_cmp_ps(v, vm, _CMP_GT_OQ);  // strictly greater: a lane keeps its first max
    vm = _mm256_blendv_ps(vm, v, gt);
    vi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vi), _mm256_castsi256_ps(idx), gt));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    idx = _mm256_add_epi32(idx, eight);
  }
  if (_mm256_movemask_ps(nan)) return false;
  alignas(32) float lm[8];
  alignas(32) int32_t li[8];
  _mm256_store_ps(lm, vm);
  _mm256_store_si256(reinterpret_cast<__m256i*>(li), vi);
  float m = -std::numeric_limits<float>::infinity();
  int64_t a = n;  // the first index of the max over the lanes, then the tail in order
  for (int u = 0; u < 8; ++u)
    if (i > 0 && (lm[u] > m || (lm[u] == m && li[u] < a))) { m = lm[u]; a = li[u]; }
  for (; i < n; ++i) {
    if (std::isnan(p[i])) return false;
    if (p[i] > m || a == n) { m = p[i]; a = i; }
  }
  if (!std::isfinite(m)) return false;
  // sum of exp(x - m): exp8 on 8 lanes, each lane's sum in float64, then the lanes in order
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  const __m256 sv = _mm256_set1_ps(m);
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_from(p + i, sv);
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double d[8];
  _mm256_store_pd(d, s0);
  _mm256_store_pd(d + 4, s1);
  double total = 0.0;
  for (int u = 0; u < 8; ++u) total += d[u];
  if (i < n) {
    alignas(32) float tail[8];
    exp_tail(p + i, n - i, sv, tail);
    for (int64_t u = 0; u < n - i; ++u) total += tail[u];
  }
  *mx = m;
  *am = a;
  *ls = float(std::log(total));
  return true;
}

// (max, argmax, log(sum(exp(x - max)))) of each row of a contiguous float32 (B, V); an empty `max`
// where a row needs torch's handling (a NaN, an infinite max)
std::vector<torch::Tensor> logit_stats(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) > 0,
              "logit_stats: a contiguous float32 (B, V) with V > 0");
  const int64_t B = x.size(0), V = x.size(1);
  auto mx = torch::empty({B}, x.options());
  auto am = torch::empty({B}, x.options().dtype(torch::kLong));
  auto ls = torch::empty({B}, x.options());
  std::atomic<bool> ok{true};
  const float* p = x.data_ptr<float>();
  float* mp = mx.data_ptr<float>();
  int64_t* ap = am.data_ptr<int64_t>();
  float* lp = ls.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      if (!stats_row(p + b * V, V, mp + b, ap + b, lp + b)) ok = false;
  });
  if (!ok) return {torch::empty({0}, x.options()), am, ls};
  return {mx, am, ls};
}

// The first index whose running sum of exp(x - m), in index order, reaches `target`; a block of 8
// whose sum (in float64, in a fixed order) leaves the running sum below it is added whole, else its
// entries one by one. Where rounding leaves the running sum short of the target at the end, the last
// index with mass. An entry of mass 0 (a -inf logit) is never the answer.
static int64_t draw_row(const float* p, int64_t n, float m, double target) {
  const __m256 sv = _mm256_set1_ps(m);
  double cum = 0.0;
  int64_t last = -1;
  alignas(32) float ev[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_from(p + i, sv);
    const int nz = _mm256_movemask_ps(_mm256_cmp_ps(e, _mm256_setzero_ps(), _CMP_GT_OQ));
    if (!nz) continue;
    const __m256d h = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                    _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    alignas(32) double hd[4];
    _mm256_store_pd(hd, h);
    const double bs = (hd[0] + hd[1]) + (hd[2] + hd[3]);
    if (cum + bs < target) {
      cum += bs;
      last = i + 31 - __builtin_clz(unsigned(nz));
      continue;
    }
    _mm256_store_ps(ev, e);
    for (int u = 0; u < 8; ++u)
      if (ev[u] > 0.0f) {
        last = i + u;
        cum += ev[u];
        if (cum >= target) return last;
      }
  }
  if (i < n) {
    exp_tail(p + i, n - i, sv, ev);
    for (int64_t u = 0; u < n - i; ++u)
      if (ev[u] > 0.0f) {
        last = i + u;
        cum += ev[u];
        if (cum >= target) return last;
      }
  }
  return last;
}

// For each row b of x (B, V): the index drawn by u[b] in (0, 1] (`draw_row`'s walk to u[b] times
// exp(ls[b]), the row's sum from `logit_stats`), with m[b] its max
torch::Tensor logit_draw(torch::Tensor x, torch::Tensor m, torch::Tensor ls, torch::Tensor u) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) > 0,
              "logit_draw: a contiguous float32 (B, V) with V > 0");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(m.numel() == B && ls.numel() == B && u.numel() == B, "logit_draw: one max, sum and u a row");
  auto mc = m.contiguous(), lc = ls.contiguous();
  auto uc = u.to(torch::kDouble).contiguous();
  auto out = torch::empty({B}, x.options().dtype(torch::kLong));
  const float* p = x.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  const float* lp = lc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = draw_row(p + b * V, V, mp[b], up[b] * std::exp(double(lp[b])));
      op[b] = t;
    }
  });
  return out;
}

TORCH_LIBRARY(opencomposer_logit_stats, m) {
  m.def("stats(Tensor x) -> Tensor[]");
  m.def("draw(Tensor x, Tensor m, Tensor ls, Tensor u) -> Tensor");
}
TORCH_LIBRARY_IMPL(opencomposer_logit_stats, CPU, m) {
  m.impl("stats", &logit_stats);
  m.impl("draw", &logit_draw);
}
"""


def _torch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, idx = x.max(-1)  # the first index of the max, as argmax
    return m, idx, torch.logsumexp(x - m[:, None], -1)


def _on_kernel(x: torch.Tensor, kernel: bool) -> bool:
    """Whether the extension's code takes x: float32 (B, V) on CPU, B and V > 0, the extension built."""
    return (kernel and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 0
            and x.shape[1] > 0 and decode_products.load() is not None)


def stats(x: torch.Tensor, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, first index of the max, log(sum(exp(x - max)))) of each row of float32 (B, V) logits: on
    the decode extension's AVX2 code where it is built and the rows are finite, else on torch (so
    also with `kernel=False`, for comparisons)."""
    if _on_kernel(x, kernel):
        m, idx, ls = torch.ops.opencomposer_logit_stats.stats(x.contiguous())
        if m.numel() == x.shape[0]:
            return m, idx, ls
    return _torch_stats(x)


def draw(x: torch.Tensor, st: tuple[torch.Tensor, torch.Tensor, torch.Tensor], u: torch.Tensor,
         kernel: bool = True) -> torch.Tensor:
    """One index a row of float32 (B, V) logits, distributed as softmax(x): the first index whose
    running sum of exp(x - max), in index order, reaches u * sum (u in (0, 1], one a row; `st` is
    `stats(x)`). A row whose statistics are not finite (a NaN) gets its index of the max. Never an
    entry of probability 0 (a -inf logit)."""
    m, idx, ls = st
    if _on_kernel(x, kernel):
        out = torch.ops.opencomposer_logit_stats.draw(x.contiguous(), m, ls, u)
    else:
        e = (x - m[:, None]).double().exp()
        cum = e.cumsum(-1)
        target = u.double()[:, None] * ls.double().exp()[:, None]
        out = torch.searchsorted(cum, target)[:, 0]
        # rounding short of the target: the last index with mass
        last = x.shape[1] - 1 - (e > 0).flip(-1).int().argmax(-1)
        out = torch.minimum(out, last)
    bad = ~(m.isfinite() & ls.isfinite())
    return torch.where(bad, idx, out) if bool(bad.any()) else out


def logprobs(x: torch.Tensor, st: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cols: torch.Tensor) -> torch.Tensor:
    """The log-probabilities of x[row, cols[row, ...]] from `stats`' (max, _, log-sum) of x: (x - max)
    - log-sum, as `log_softmax` computes them."""
    m, _, ls = st
    return (x.gather(-1, cols) - m[:, None]) - ls[:, None]
