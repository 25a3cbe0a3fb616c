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

inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <Fmt F, int R, bool PF>
void tile(const R16X& x, const R16W& w, int64_t g, int64_t i0, const float* bias, float* y) {
  using T = Traits<F>;  // the formats rows16_format names: no lookup table, no crumb codes
  static_assert(!T::lut && !T::crumb_codes && (T::nibbles || F == Q8_0), "a format without a 16-row layout");
  constexpr bool q8 = !T::nibbles, kq = T::kquant, split = T::split;
  constexpr bool offset = T::offset != 0;
  constexpr bool plane = T::planes == 1;                  // a fifth bit per code (+16)
  static_assert(!split || T::crumbs, "split scales: Q6_K's crumbs");
  constexpr bool minimum = T::has_min && !kq;             // per-block fp16 minimum
  constexpr bool kmin = T::has_min && kq;                 // dmin * 6-bit minimum
  const R16Tile<F, R> at(x, w, g, i0);
  const auto& [qs, dg, mg, scg, hbg, xq, xw, xs, xm, xi] = at;
  constexpr int64_t qb = R16Tile<F, R>::qb, hbb = R16Tile<F, R>::hbb;
  const int64_t KB = w.KB, N = w.G * 16;
  __m512 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x30);
  __m512 dsup = _mm512_setzero_ps(), msup = _mm512_setzero_ps();
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
      __m512i hv = _mm512_setzero_si512();
      if constexpr (plane) hv = _mm512_loadu_si512(hbg + b * 64);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(p + 64 * j);
        __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        if constexpr (split) {  // Q6_K's two high bits, as +16 and +32 (0x30) over the nibble
          if ((j & 1) == 0) {
            hv = _mm512_loadu_si512(hbg + b * 128 + (j / 2) * 64);
            lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(hv, 4), two, 0xF8);
            hi = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi16(hv, 2), two, 0xF8);
          } else {
            lo = _mm512_ternarylogic_epi32(lo, hv, two, 0xF8);
            hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi16(hv, 2), two, 0xF8);
          }
        }
        if constexpr (plane) {  // chunk j's fifth bits: byte bit 2j (low nibbles') and 2j + 1 (high), to 0x10
          const __m512i bit = _mm512_set1_epi8(0x10);
          const auto at4 = [&](int from) {  // bit `from` of each byte moved to bit 4 (within the byte)
            return from <= 4 ? _mm512_slli_epi16(hv, 4 - from) : _mm512_srli_epi16(hv, from - 4);
          };
          lo = _mm512_ternarylogic_epi32(lo, at4(2 * j), bit, 0xF8);
          hi = _mm512_ternarylogic_epi32(hi, at4(2 * j + 1), bit, 0xF8);
        }
        for (int r = 0; r < R; ++r) {
          a0[r] = _mm512_dpbusd_epi32(a0[r], lo, bcast4(xq[r] + qd + 4 * j));
          a1[r] = _mm512_dpbusd_epi32(a1[r], hi, bcast4(xq[r] + qd + 64 + 4 * j));
        }
      }
    }
    if constexpr (kq) {
      if ((b & (kSuper - 1)) == 0) {
        dsup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b / kSuper * 16)));
        if constexpr (kmin)
          msup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b / kSuper * 16)));
      }
    }
    if constexpr (split) {  // an int8 scale per half block: d * scale, exact
      const __m128i* sp = reinterpret_cast<const __m128i*>(scg + b * 32);
      const __m512 d0 = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sp))));
      const __m512 d1 = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sp + 1))));
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(xs[r][b]);
        tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_mul_ps(d0, sx), tot[r]);
        tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), _mm512_mul_ps(d1, sx), tot[r]);
      }
    } else {
      __m512 dv, mv = _mm512_setzero_ps();
      if constexpr (kmin) {  // d * 6-bit scale and dmin * 6-bit minimum, exact
        const __m128i* sp = reinterpret_cast<const __m128i*>(scg + b * 32);
        dv = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sp))));
        mv = _mm512_mul_ps(msup, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sp + 1))));
      } else {
        dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
        if constexpr (minimum)
          mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * 16)));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 iv = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[r], a1[r]));
        tot[r] = _mm512_fmadd_ps(iv, _mm512_mul_ps(dv, _mm512_set1_ps(xs[r][b])), tot[r]);
        if constexpr (minimum) tot[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xm[r][b]), tot[r]);
        if constexpr (kmin) tot[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xm[r][b]), tot[r]);
      }
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + g * 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + (i0 + r) * N + g * 16, bias ? _mm512_add_ps(tot[r], bv) : tot[r]);
}

#include "rows16_driver.inc"

}  // namespace

void rows16_gemm(const R16X& x, const R16W& w, const float* bias, float* y, int64_t g0, int64_t g1) {
  run_any(x, w, bias, y, g0, g1);
}

}  // namespace servelm_quant

#pragma GCC pop_options
