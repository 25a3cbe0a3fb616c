// The AVX2 kernel over weights interleaved by 16 rows ("rows16", layout in quant_common.h R16W): the avx2_i8
// path's kernel at every M for Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (int8 x, vpmaddubsw + vpmaddwd) and
// Q8_0 (int16 x, vpmaddwd), on the same bytes as rows16_avx512_vnni.cpp.
//
// A group's 64-byte chunk is two 8-row halves (rows 16g .. 16g + 7 in its first 32 bytes), 8 lanes a vector and
// one fp32 accumulator per (half, row of x); a tile of few rows of x walks the group's blocks once for both halves,
// one of more rows once per half (tile_h). vpmaddubsw
// (codes unsigned, x's int8 codes signed) gives the pair sums in int16, which are summed in int16 as long as no
// sum can pass 32,767 (kFlush: 8 pair sums of 4-bit codes, 4 of 5-bit, 2 of Q6_K's 6-bit; |x| <= 127), then
// vpmaddwd by ones into int32: llama.cpp's AVX2 scheme, one vpmaddwd per 8 (4, 2) vpmaddubsw instead of one each.
//
// Numerics: the block dot products are exact int32, as vpdpbusd's, and the fp32 steps are the AVX-512 kernel's,
// one for one (the same conversions, multiplies and fmas in the same order), so the outputs are bitwise those of
// rows16_avx512_vnni.cpp and batch-invariant at every M.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace servelm_quant {
namespace {

// Rows of x per tile: a tile's accumulators and the decoded codes fit the 16 ymm registers. Q8_0 too: at 6 rows
// its 12 accumulators, codes and broadcasts spilled (the 1B shape's Q8_0 matrices: M = 64 took 37-42 ms, 31-34 at
// 4 rows; M = 128 66-79 and 62-68 ms).
template <Fmt F>
constexpr int kTile = Traits<F>::split ? 3 : 4;
// Up to this many rows of x, a tile takes both halves of a group in one pass over its blocks. Q8_0 at 4 rows: 8
// accumulators, the 4 broadcasts and a row of codes, no spill; one pass instead of two took the 1B shape's 512-token
// prompt on this path from x1.41 to x1.56 llama.cpp's AVX2 build (docs/measurements/quant-kernels.md,
// "Twenty-seventh session"). The nibble formats' int16 sums need more registers: 3.
template <Fmt F>
constexpr int kBoth = Traits<F>::split ? 2 : (F == Q8_0 ? 4 : 3);

// vpmaddubsw results (each up to 2 * code max * 127) summed in int16 before one vpmaddwd
template <Fmt F>
constexpr int kFlush = F == Q6_K ? 2 : (Traits<F>::planes == 1 ? 4 : 8);

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// An opaque step on v: GCC would otherwise re-associate a tile's integer sums into a tree of all its vpmaddubsw
// (vpmaddwd) results at once (measured: half the tile's registers spilled to the stack, the kernel 1.2-2x slower)
inline __m256i opaque(__m256i v) {
  __asm__("" : "+x"(v));
  return v;
}

inline __m256 half8(const uint16_t* p) {  // 8 fp16 -> fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows i0 .. i0 + R of x against group g, H halves of the group a pass over its blocks: H = 2 (both halves as
// each block comes: one stream over the weights, for the few rows of decode and verify steps) or 1 (half by half,
// the second pass finding the group's lines in L1/L2: room in the registers for more rows of x).
template <Fmt F, int R, int H, bool PF>
void tile_h(const R16X& x, const R16W& w, int64_t g, int64_t i0, const float* bias, float* y) {
  using T = Traits<F>;  // the formats rows16_format names: no lookup table, no crumb codes
  static_assert(!T::lut && !T::crumb_codes && (T::nibbles || F == Q8_0), "a format without a 16-row layout");
  constexpr bool q8 = !T::nibbles, kq = T::kquant, split = T::split;
  constexpr bool offset = T::offset != 0;
  constexpr bool plane = T::planes == 1;  // a fifth bit per code (+16)
  static_assert(!split || T::crumbs, "split scales: Q6_K's crumbs");
  constexpr bool minimum = T::has_min && !kq;  // per-block fp16 minimum
  constexpr bool kmin = T::has_min && kq;      // dmin * 6-bit minimum
  constexpr int flush = kFlush<F>;
  const R16Tile<F, R> at(x, w, g, i0);
  const auto& [qs, dg, mg, scg, hbg, xq, xw, xs, xm, xi] = at;
  constexpr int64_t qb = R16Tile<F, R>::qb, hbb = R16Tile<F, R>::hbb;
  const int64_t KB = w.KB, N = w.G * 16;
  const __m256i low4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  for (int h0 = 0; h0 < 2; h0 += H) {  // half h: rows 16g + 8h .. 16g + 8h + 7, bytes 32h .. 32h + 31 of each 64
    __m256 tot[H][R];
    for (int u = 0; u < H; ++u)
      for (int r = 0; r < R; ++r) tot[u][r] = _mm256_setzero_ps();
    __m256 dsup[H], msup[H];
    for (int u = 0; u < H; ++u) dsup[u] = msup[u] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* p = qs + b * qb;
      if constexpr (PF) {
        if (h0 == 0) at.prefetch(b);  // a second pass finds the group's lines in cache
      }
      __m256i a0[H][R], a1[H][R];
      for (int u = 0; u < H; ++u)
        for (int r = 0; r < R; ++r) {
          a0[u][r] = offset ? _mm256_set1_epi32(xi[r][2 * b]) : _mm256_setzero_si256();
          a1[u][r] = split ? _mm256_set1_epi32(xi[r][2 * b + 1]) : _mm256_setzero_si256();
        }
      if constexpr (q8) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)  // pair j: elements 2j, 2j + 1 of the 8 rows, sign-extended
          for (int u = 0; u < H; ++u) {
            const __m256i wv =
                _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * j + 16 * (h0 + u))));
            for (int r = 0; r < R; ++r)  // one int32 sum (exact: the same value as the AVX-512 kernel's two)
              a0[u][r] = opaque(_mm256_add_epi32(a0[u][r], _mm256_madd_epi16(wv, bcast4(xw[r] + b * kBlock + 2 * j))));
          }
      } else {
        const int64_t qd = (b >> 2) * 128 + (b & 3) * 16;  // block b in x's quad layout
        __m256i hv[H];
        for (int u = 0; u < H; ++u)
          hv[u] = plane ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hbg + b * 64 + 32 * (h0 + u)))
                        : _mm256_setzero_si256();
        __m256i s0[H][R], s1[H][R];  // int16 sums of the low (s0) and high (s1; split formats) nibbles' pair sums
        int pending = 0;             // vpmaddubsw results in each int16 sum
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          for (int u = 0; u < H; ++u) {
            const int h = h0 + u;
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
            __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if constexpr (split) {  // Q6_K's two high bits, as +16 and +32 (0x30) over the nibble
              if ((j & 1) == 0) {
                hv[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hbg + b * 128 + (j / 2) * 64 + 32 * h));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hv[u], 4), two));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hv[u], 2), two));
              } else {
                lo = _mm256_or_si256(lo, _mm256_and_si256(hv[u], two));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(hv[u], 2), two));
              }
            }
            if constexpr (plane) {  // chunk j's fifth bits: byte bit 2j (low nibbles') and 2j + 1 (high), to 0x10
              const __m256i bit = _mm256_set1_epi8(0x10);
              const auto at4 = [&](int from) {  // bit `from` of each byte moved to bit 4 (within the byte)
                return from <= 4 ? _mm256_slli_epi16(hv[u], 4 - from) : _mm256_srli_epi16(hv[u], from - 4);
              };
              lo = _mm256_or_si256(lo, _mm256_and_si256(at4(2 * j), bit));
              hi = _mm256_or_si256(hi, _mm256_and_si256(at4(2 * j + 1), bit));
            }
            for (int r = 0; r < R; ++r) {
              const __m256i pl = _mm256_maddubs_epi16(lo, bcast4(xq[r] + qd + 4 * j));
              const __m256i ph = _mm256_maddubs_epi16(hi, bcast4(xq[r] + qd + 64 + 4 * j));
              __m256i& t0 = s0[u][r];
              if constexpr (split) {
                __m256i& t1 = s1[u][r];
                t0 = opaque(pending ? _mm256_add_epi16(t0, pl) : pl);
                t1 = opaque(pending ? _mm256_add_epi16(t1, ph) : ph);
              } else {  // pl + ph first: one add a chunk on the sum's dependency chain (14% faster than two)
                t0 = opaque(pending ? _mm256_add_epi16(t0, _mm256_add_epi16(pl, ph)) : _mm256_add_epi16(pl, ph));
              }
            }
          }
          pending += split ? 1 : 2;
          if (pending == flush || j == 3) {
            for (int u = 0; u < H; ++u)
              for (int r = 0; r < R; ++r) {
                a0[u][r] = _mm256_add_epi32(a0[u][r], _mm256_madd_epi16(s0[u][r], ones));
                if constexpr (split) a1[u][r] = _mm256_add_epi32(a1[u][r], _mm256_madd_epi16(s1[u][r], ones));
              }
            pending = 0;
          }
        }
      }
      for (int u = 0; u < H; ++u) {
        const int h = h0 + u;
        if constexpr (kq) {
          if ((b & (kSuper - 1)) == 0) {
            dsup[u] = half8(dg + b / kSuper * 16 + 8 * h);
            if constexpr (kmin) msup[u] = half8(mg + b / kSuper * 16 + 8 * h);
          }
        }
        if constexpr (split) {  // an int8 scale per half block: d * scale, exact
          const uint8_t* sp = scg + b * 32 + 8 * h;
          const __m256 ds = dsup[u];
          const auto scale = [sp, ds](int part) {
            return _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + 16 * part)))));
          };
          const __m256 d0 = scale(0), d1 = scale(1);
          for (int r = 0; r < R; ++r) {
            const __m256 sx = _mm256_set1_ps(xs[r][b]);
            tot[u][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[u][r]), _mm256_mul_ps(d0, sx), tot[u][r]);
            tot[u][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[u][r]), _mm256_mul_ps(d1, sx), tot[u][r]);
          }
        } else {
          __m256 dv, mv = _mm256_setzero_ps();
          if constexpr (kmin) {  // d * 6-bit scale and dmin * 6-bit minimum, exact
            const uint8_t* sp = scg + b * 32 + 8 * h;
            dv = _mm256_mul_ps(dsup[u], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp)))));
            mv = _mm256_mul_ps(msup[u], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + 16)))));
          } else {
            dv = half8(dg + b * 16 + 8 * h);
            if constexpr (minimum) mv = half8(mg + b * 16 + 8 * h);
          }
          for (int r = 0; r < R; ++r) {
            const __m256 iv = _mm256_cvtepi32_ps(_mm256_add_epi32(a0[u][r], a1[u][r]));
            tot[u][r] = _mm256_fmadd_ps(iv, _mm256_mul_ps(dv, _mm256_set1_ps(xs[r][b])), tot[u][r]);
            if constexpr (minimum) tot[u][r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xm[r][b]), tot[u][r]);
            if constexpr (kmin) tot[u][r] = _mm256_fnmadd_ps(mv, _mm256_set1_ps(xm[r][b]), tot[u][r]);
          }
        }
      }
    }
    for (int u = 0; u < H; ++u) {
      const int64_t col = g * 16 + 8 * (h0 + u);
      const __m256 bv = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r)
        _mm256_storeu_ps(y + (i0 + r) * N + col, bias ? _mm256_add_ps(tot[u][r], bv) : tot[u][r]);
    }
  }
}

template <Fmt F, int R, bool PF>
void tile(const R16X& x, const R16W& w, int64_t g, int64_t i0, const float* bias, float* y) {
  tile_h<F, R, (R <= kBoth<F>) ? 2 : 1, PF>(x, w, g, i0, bias, y);
}

#include "rows16_driver.inc"

}  // namespace

void rows16_gemm_avx2(const R16X& x, const R16W& w, const float* bias, float* y, int64_t g0, int64_t g1) {
  run_any(x, w, bias, y, g0, g1);
}

}  // namespace servelm_quant

#pragma GCC pop_options
