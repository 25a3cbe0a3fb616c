// The AVX-512 VNNI kernel over weights interleaved by 16 rows ("rows16", layout in quant_common.h R16W): every M,
// decode, speculative verify rows and prompts alike, for Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (int8 x, vpdpbusd)
// and Q8_0 (int16 x, vpdpwssd).
//
// Why a layout of its own: the row-layout decode kernel (quant_avx512.inc micro_i8) holds four lanes of each of a
// quad's blocks in a vector, so every 128 weights cost two vpdpbusd plus a convert, a multiply and an fma per
// (weight row, x row), and its tiles decode each weight block again for every 3 rows of x: at 5 rows (a verify
// step of k = 4) it took 1.7x its one-row time on the 1B's matrices from memory, 3x hot in cache. Here lane l of
// every vector is weight row 16g + l: four bytes of x broadcast against 64 bytes of codes, eight vpdpbusd
// accumulate a whole block for 16 rows, and the fp32 steps come once per 512 weights and row of x. A block's 16
// rows are decoded once and used against up to 6 rows of x. Measured in docs/measurements/quant-kernels.md
// ("Twenty-third session").
//
// Numerics: x is rounded exactly as the row-layout path rounds it (quant_ops.cpp); each output is its block dot
// products (exact int32, started from the offset correction), converted, scaled by (weight scale * x scale) and
// added in block order to one fp32 accumulator, the minimum term fma'd after each block, the bias last. No step
// depends on M, on the tile or on the thread split, so the rows are batch-invariant at every M.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace servelm_quant {
namespace {

template <Fmt F>
constexpr int kTile = 6;  // rows of x per tile: 3 accumulators a row, 18 of the 32 registers

#include "rows16_avx512.h"

inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <Fmt F, int R, bool PF>
void tile(const R16X& x, const R16W& w, int64_t g, int64_t i0, const float* bias, float* y) {
  using T = Traits<F>;  // the formats rows16_format names: no lookup table, no crumb codes
  static_assert(!T::lut && !T::crumb_codes && (T::nibbles || F == Q8_0), "a format without a 16-row layout");
  constexpr bool q8 = !T::nibbles, split = T::split, offset = T::offset != 0;
  static_assert(!split || T::crumbs, "split scales: Q6_K's crumbs");
  const R16Tile<F, R> at(x, w, g, i0);
  const auto& [qs, dg, mg, scg, hbg, xq, xw, xs, xm, xi] = at;
  constexpr int64_t qb = R16Tile<F, R>::qb;
  const int64_t KB = w.KB;
  __m512 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
  [[maybe_unused]] R16Unpack<q8 ? Q4_0 : F> un;  // the nibble formats' codes (rows16_avx512.h)
  R16Steps<F, R> steps;
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* p = qs + b * qb;
    if constexpr (PF) at.prefetch(b);
    __m512i a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      a0[r] = offset ? _mm512_set1_epi32(xi[r][2 * b]) : _mm512_setzero_si512();
      a1[r] = split ? _mm512_set1_epi32(xi[r][2 * b + 1]) : _mm512_setzero_si512();
    }
    if constexpr (q8) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
        for (int r = 0; r < R; ++r) {
          __m512i& a = (j & 1) ? a1[r] : a0[r];
          a = _mm512_dpwssd_epi32(a, wv, bcast4(xw[r] + b * kBlock + 2 * j));
        }
      }
    } else {
      const int64_t qd = (b >> 2) * 128 + (b & 3) * 16;  // block b in x's quad layout
      un.start(hbg, b);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        un.chunk(p, hbg, b, j, lo, hi);
        for (int r = 0; r < R; ++r) {
          a0[r] = _mm512_dpbusd_epi32(a0[r], lo, bcast4(xq[r] + qd + 4 * j));
          a1[r] = _mm512_dpbusd_epi32(a1[r], hi, bcast4(xq[r] + qd + 64 + 4 * j));
        }
      }
    }
    steps.block(at, b, [&](int r, int h) { return split ? (h ? a1[r] : a0[r]) : _mm512_add_epi32(a0[r], a1[r]); },
                tot);
  }
  r16_store<R>(tot, bias, y, w.G * 16, g, i0);
}

#include "rows16_driver.inc"

}  // namespace

void rows16_gemm(const R16X& x, const R16W& w, const float* bias, float* y, int64_t g0, int64_t g1) {
  run_any(x, w, bias, y, g0, g1);
}

}  // namespace servelm_quant

#pragma GCC pop_options
