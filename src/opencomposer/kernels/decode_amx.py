"""The decode-products kernel's AMX form (`decode_products.set_amx`): products of 9-32 rows on CPUs
with AMX-BF16 (Intel Xeon since Sapphire Rapids), within float32 rounding through bfloat16 limbs.
C++ source only, compiled into the same extension as `decode_products.py` and ahead of it (its
`products` op calls `oc_amx::products` where `amx_on()`); the comments below say how and why, and
docs/inference.md what was measured.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>
#include <algorithm>
#include <cstring>
#include <atomic>
// ---- The AMX form: 9-32 rows on CPUs with AMX-BF16 (Intel Xeon since Sapphire Rapids) ----
// At 9-32 rows the 16-lane form's FMAs take about as long as its weight stream on such a CPU, and
// the two take turns (docs/inference.md). The tile unit multiplies bfloat16 pairs into float32 at many
// times AVX-512's rate, so the products go there, exactly enough for float32: each float is split
// by truncation into three bfloat16 limbs, hi + mid + lo, that sum back to it exactly (8 + 8 + 8
// bits of its 24; outside the normal range the lo limb flushes to zero), and of the nine products
// of an x limb and a w limb the six whose orders add to at most 2 are accumulated (the other three
// are below float32's rounding of the sum), each exact in float32. Every weight is read once, in
// float32 as it is stored, and split on the fly: no second copy of the model.
// Layout: a tile of 16 weight rows x 32 k (the weights' own row-major order, as bfloat16 limbs)
// times a tile of x's limbs (16 k-pairs x 16 rows of x, built once a call: the VNNI order the unit
// takes) gives 16 weight rows x 16 rows of x: at 9-16 rows one accumulator, at 17-32 (two groups of
// x's rows) four, since a step then takes two blocks of weight rows.
// Numerics: an output is the six limb products of each 32-wide step of k accumulated by the tile
// unit in float32, step after step in order: the same bits for a row whatever else is in a batch of
// 9-32 rows, but not the 16- or 8-lane forms' bits (those run 1-8 rows). Non-finite inputs give NaN.
#if defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define OC_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")
namespace oc_amx {

struct Config {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// every tile 16 rows of 64 bytes (OC_STEP1 and OC_STEP2 below say which holds what)
static inline void tiles_on() {
  Config c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// three bfloat16 limbs of 32 floats (the first `n` of them where n < 32, zeros after), in order
template <bool TAIL>
static inline void limbs(const float* p, int n, __m512i& h, __m512i& m, __m512i& l) {
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 a, b;
  if (TAIL) {
    a = _mm512_maskz_loadu_ps(__mmask16(n >= 16 ? 0xFFFF : (1u << n) - 1), p);
    b = _mm512_maskz_loadu_ps(__mmask16(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0), p + 16);
  } else {
    a = _mm512_loadu_ps(p);
    b = _mm512_loadu_ps(p + 16);
  }
  const __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
  const __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top));
  const __m512 ar = _mm512_sub_ps(a, ah), br = _mm512_sub_ps(b, bh);  // exact
  const __m512 am = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(ar), top));
  const __m512 bm = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(br), top));
  const __m512 al = _mm512_sub_ps(ar, am), bl = _mm512_sub_ps(br, bm);  // exact, 8 bits at most
  // Each value is already a bfloat16 (its low 16 bits zero), so its bfloat16 is its high half. A shift
  // and a bitwise select put a's i-th and b's i-th into one 32-bit unit: the unit's pair i holds k = i
  // and k = 16 + i of the step, for x (whose limbs are made here too) as for w. Two simple
  // instructions where `_mm512_cvtne2ps_pbh` (k in order) was one slow one (~2 cycles here): on this
  // host the split and the tile unit's products do not overlap, so each instruction of the split
  // counts (docs/inference.md).
  h = _mm512_ternarylogic_epi32(top, _mm512_castps_si512(bh), _mm512_srli_epi32(_mm512_castps_si512(ah), 16), 0xCA);
  m = _mm512_ternarylogic_epi32(top, _mm512_castps_si512(bm), _mm512_srli_epi32(_mm512_castps_si512(am), 16), 0xCA);
  l = _mm512_ternarylogic_epi32(top, _mm512_castps_si512(bl), _mm512_srli_epi32(_mm512_castps_si512(al), 16), 0xCA);
}

// 16x16 transpose of 32-bit units held in 16 registers
static inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// The six limb products of one step. Per accumulator in the order w_hi x_lo, w_hi x_mid, w_mid x_mid,
// w_mid x_hi, w_lo x_hi, w_hi x_hi, whatever the rows of x: a row's bits do not depend on the batch.
// x's limbs are at t (group g's hi, mid, lo at t + g * 48, + 16, + 32: 16 registers each), the
// weight limbs at w (block a's hi, mid, lo at w[0..2], block b's at w[3..5]). Macros: g++'s tile
// intrinsics paste their tile numbers into the assembly, so they must be literal digits.
// One group (9-16 rows of x), one block of 16 weight rows: tile 0 accumulates, 2-4 hold the weight
// limbs, 5-7 x's.
#define OC_STEP1(w, t)           \
  do {                           \
    _tile_loadd(2, (w)[0], 64);  \
    _tile_loadd(3, (w)[1], 64);  \
    _tile_loadd(4, (w)[2], 64);  \
    _tile_loadd(5, (t) + 32, 64); \
    _tile_dpbf16ps(0, 2, 5);     \
    _tile_loadd(6, (t) + 16, 64); \
    _tile_dpbf16ps(0, 2, 6);     \
    _tile_dpbf16ps(0, 3, 6);     \
    _tile_loadd(7, (t), 64);     \
    _tile_dpbf16ps(0, 3, 7);     \
    _tile_dpbf16ps(0, 4, 7);     \
    _tile_dpbf16ps(0, 2, 7);     \
  } while (0)
// Two groups (17-32 rows), two blocks a step (a and b), so that a tile of x's limbs loaded serves
// both blocks: the tile unit's loads (which cost here about as much as its products) fall from 9 to 7
// a block. Tiles 0-3 accumulate (a, g0), (a, g1), (b, g0), (b, g1); 4-5 hold a limb of a and of b,
// 6-7 a limb of each group.
#define OC_FOUR()              \
  do {                         \
    _tile_dpbf16ps(0, 4, 6);   \
    _tile_dpbf16ps(2, 5, 6);   \
    _tile_dpbf16ps(1, 4, 7);   \
    _tile_dpbf16ps(3, 5, 7);   \
  } while (0)
#define OC_STEP2(w, t)                                         \
  do {                                                         \
    _tile_loadd(4, (w)[0], 64);                                \
    _tile_loadd(5, (w)[3], 64);                                \
    _tile_loadd(6, (t) + 32, 64);                              \
    _tile_loadd(7, (t) + 48 + 32, 64);                         \
    OC_FOUR();                                                 \
    _tile_loadd(6, (t) + 16, 64);                              \
    _tile_loadd(7, (t) + 48 + 16, 64);                         \
    OC_FOUR();                                                 \
    _tile_loadd(4, (w)[1], 64);                                \
    _tile_loadd(5, (w)[4], 64);                                \
    OC_FOUR();                                                 \
    _tile_loadd(6, (t), 64);                                   \
    _tile_loadd(7, (t) + 48, 64);                              \
    OC_FOUR();                                                 \
    _tile_loadd(4, (w)[2], 64);                                \
    _tile_loadd(5, (w)[5], 64);                                \
    OC_FOUR();                                                 \
    _tile_loadd(4, (w)[0], 64);                                \
    _tile_loadd(5, (w)[3], 64);                                \
    OC_FOUR();                                                 \
  } while (0)

// The CPU has the tile unit and AVX-512 BF16, and Linux lets this process use the tiles.
static bool probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx = (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
  if (!amx || !__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a >> 5 & 1)) return false;  // AVX512_BF16
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return false;
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: once for the whole process, its threads included
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
static bool usable() {
  static const bool ok = probe();  // asked once a process
  return ok;
}

// Steps of k ahead that a step's weight lines are fetched into L2 (SmolLM2's layer products at 32
// rows on the AMX Xeon, scratch runs: 31.1-32.4 ms at 2-17 steps ahead, 32.7-35.3 one block of rows
// ahead as the 16-lane form fetches, 47-51 with no prefetch; with two blocks a step, 2 and 8 steps
// ahead 0.97-1.01x of 4).
constexpr int kAhead = 4;

// y (M, N) = x (M, K) @ cat(w).T for G groups of 16 rows of x (1 or 2: 9 <= M <= 32), the weights as
// `products` gathers them; a step takes G blocks of 16 weight rows (a "part")
template <int G>
static void products_g(const float* x, int64_t sx, int64_t M, int64_t K, const std::vector<const float*>& ptrs,
                       const std::vector<int64_t>& strides, const std::vector<int64_t>& starts, float* y) {
  constexpr int R = 16 * G;  // weight rows a step
  const int64_t N = starts.back(), S = (K + 31) / 32;
  const int last = int(K - (S - 1) * 32);  // k in the last step, 1-32
  // x's limbs as tiles, xt[s][g][limb]: 16 k-pairs x 16 rows, 32-bit units (a pair of bfloat16, `limbs`)
  // (torch's CPU allocator aligns to 64 bytes; a std::vector of __m512i need not, and the
  // stores below are aligned)
  auto xt_store = torch::empty({S * G * 3 * 16 * 16}, torch::dtype(torch::kInt32));
  __m512i* xt = reinterpret_cast<__m512i*>(xt_store.data_ptr<int32_t>());
  // over the threads where there are weight rows enough: SmolLM2's output and down products at 32
  // rows 1.05-1.08x so, but 32 weight rows took 12.5 -> 20.8 us (a grain this large runs inline)
  at::parallel_for(0, S * G, N >= 256 ? 8 : S * G, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / G, g = i % G;
      __m512i r[3][16];
      for (int m = 0; m < 16; ++m) {
        const int64_t row = g * 16 + m;
        if (row >= M)
          r[0][m] = r[1][m] = r[2][m] = _mm512_setzero_si512();
        else if (s + 1 < S || last == 32)
          limbs<false>(x + row * sx + s * 32, 32, r[0][m], r[1][m], r[2][m]);
        else
          limbs<true>(x + row * sx + s * 32, last, r[0][m], r[1][m], r[2][m]);
      }
      for (int li = 0; li < 3; ++li) {
        transpose16(r[li]);
        for (int j = 0; j < 16; ++j) xt[((s * G + g) * 3 + li) * 16 + j] = r[li][j];
      }
    }
  });
  const int64_t Nw = int64_t(ptrs.size()), NP = (N + R - 1) / R;  // steps' rows: "parts" of R weight rows
  at::parallel_for(0, NP, 8 / G, [&](int64_t b0, int64_t b1) {
    tiles_on();
    alignas(64) uint16_t wl[2][3 * G][16 * 32];  // a step's weight limbs (per block hi mid lo), two steps in turn
    alignas(64) float acc[G * G][16 * 16];       // a part's accumulators, [block * G + group], stored for `flush`
    const float* rows[2][R];                     // a part's weight rows (nullptr past N)
    auto rows_of = [&](int64_t part, const float** rp) {
      int64_t i = 0;
      for (int r = 0; r < R; ++r) {
        const int64_t n = part * R + r;
        if (n >= N) {
          rp[r] = nullptr;
          continue;
        }
        while (i + 1 < Nw && starts[i + 1] <= n) ++i;
        rp[r] = ptrs[i] + (n - starts[i]) * strides[i];
      }
    };
    // weight step s of the rows `rp` into limb buffer `buf`; lines kAhead steps on (in `pn`'s
    // rows past the part's end) into L2 meanwhile
    auto split = [&](const float* const* rp, int64_t s, uint16_t (*buf)[16 * 32], const float* const* pn,
                     int64_t sp) {
      const bool tail = s + 1 == S && last < 32;
      for (int r = 0; r < R; ++r) {
        if (pn && pn[r]) {
          const char* q = reinterpret_cast<const char*>(pn[r] + sp * 32);
          _mm_prefetch(q, _MM_HINT_T1);
          _mm_prefetch(q + 64, _MM_HINT_T1);
        }
        __m512i h, m, l;
        if (!rp[r])
          h = m = l = _mm512_setzero_si512();
        else if (tail)
          limbs<true>(rp[r] + s * 32, last, h, m, l);
        else
          limbs<false>(rp[r] + s * 32, 32, h, m, l);
        uint16_t (*o)[16 * 32] = buf + (r >> 4) * 3;
        _mm512_store_si512(&o[0][(r & 15) * 32], h);
        _mm512_store_si512(&o[1][(r & 15) * 32], m);
        _mm512_store_si512(&o[2][(r & 15) * 32], l);
      }
    };
    // a finished part's rows of y, from its stored accumulators (16 weight rows x 16 rows of x each)
    auto flush = [&](int64_t part) {
      for (int64_t half = 0; half < G; ++half) {
        const int64_t n0 = part * R + half * 16;
        if (n0 >= N) break;
        const __mmask16 cols = __mmask16(N - n0 >= 16 ? 0xFFFF : (1u << (N - n0)) - 1);
        for (int64_t g = 0; g < G; ++g) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(acc[half * G + g] + i * 16);
          transpose16(r);  // r[m]: outputs n0..n0+15 of x's row g*16+m
          for (int64_t m = 0; m < std::min<int64_t>(16, M - g * 16); ++m)
            _mm512_mask_storeu_epi32(y + (g * 16 + m) * N + n0, cols, r[m]);
        }
      }
    };
    rows_of(b0, rows[b0 & 1]);
    if (b0 + 1 < b1) rows_of(b0 + 1, rows[(b0 + 1) & 1]);
    split(rows[b0 & 1], 0, wl[0], nullptr, 0);
    int64_t at = 0;  // steps done, whose parity picks the limb buffer
    for (int64_t part = b0; part < b1; ++part) {
      const float* const* cur = rows[part & 1];
      const float* const* nxt = part + 1 < b1 ? rows[(part + 1) & 1] : nullptr;
      _tile_zero(0);
      if (G > 1) {
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t s = 0; s < S; ++s, ++at) {
        // the next step's limbs while the tile unit works on this one's (their stores finish
        // before the unit loads them, a step later)
        if (s + 1 < S) {
          const int64_t sp = s + 1 + kAhead;
          split(cur, s + 1, wl[(at + 1) & 1], sp < S ? cur : nxt, sp < S ? sp : sp - S);
        } else if (nxt) {
          split(nxt, 0, wl[(at + 1) & 1], nxt, std::min<int64_t>(kAhead, S - 1));
        }
        uint16_t (*w)[16 * 32] = wl[at & 1];
        const __m512i* t = xt + (s * G) * 3 * 16;
        if (G == 1)
          OC_STEP1(w, t);
        else
          OC_STEP2(w, t);
      }
      _tile_stored(0, acc[0], 64);
      if (G > 1) {
        _tile_stored(1, acc[1], 64);
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
      }
      flush(part);
      if (part + 2 < b1) rows_of(part + 2, rows[part & 1]);
    }
    _tile_release();
  });
}

// y (M, N) = x (M, K) @ cat(w).T for 9 <= M <= 32, the weights as `products` gathers them
static void products(const float* x, int64_t sx, int64_t M, int64_t K, const std::vector<const float*>& ptrs,
                     const std::vector<int64_t>& strides, const std::vector<int64_t>& starts, float* y) {
  if (M > 16)
    products_g<2>(x, sx, M, K, ptrs, strides, starts, y);
  else
    products_g<1>(x, sx, M, K, ptrs, strides, starts, y);
}

}  // namespace oc_amx
#undef OC_STEP1
#undef OC_STEP2
#undef OC_FOUR
#pragma GCC pop_options
#endif

// Whether 9-32 rows run on the AMX form: -1 not chosen yet, then 0 or 1 (atomic, as g_wide below).
static std::atomic<int> g_amx{-1};
static bool amx_on() {
#ifdef OC_AMX
  if (g_amx < 0) g_amx = oc_amx::usable() ? 1 : 0;
  return g_amx == 1;
#else
  return false;
#endif
}

// on: 1 or 0 to choose (1 only where the CPU and the kernel allow it), -1 to ask; returns the choice in force.
int64_t set_amx(int64_t on) {
#ifdef OC_AMX
  if (on >= 0) g_amx = (on && oc_amx::usable()) ? 1 : 0;
#endif
  return amx_on() ? 1 : 0;
}
"""
