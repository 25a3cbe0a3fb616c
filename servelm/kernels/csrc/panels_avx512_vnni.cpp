// The int8 scheme's GEMM for many rows of x (prompts, large decode batches) on AVX-512 VNNI, every nibble
// format (and Q8_0 with int16 codes: kPanelsQ8 below): x's int8 codes and scales are exactly the decode
// kernel's (quant_ops' quant_block_i8), only the order of the fp32 steps differs, so its rows are not bitwise the micro-kernel's (deterministic mode never
// takes it, as it never took the fp32 tiles this replaces there).
//
// Why a layout of its own: the decode kernel (quant_avx512.inc micro_i8) reads a quad of blocks per step and
// its 16 int32 lanes hold 4 lanes of each block, so each 128 weights cost two vpdpbusd and three fp32 steps
// (convert, scale, fma) per (weight row, x row). Here a group of 16 blocks is laid out with lane l = block l:
// slice i (0..7) holds k 4i..4i+3 of each of the 16 blocks, so eight vpdpbusd accumulate whole blocks into
// the lanes and the three fp32 steps come once per 512 weights (split formats: twice, once per half).
// The weights are decoded into that layout a panel of kNp rows at a time (L2-sized, codes as unsigned bytes
// with the bit planes added, scales as fp32), and used against every row of x: the decoding is amortised
// over M, x's rows are walked in L2-sized blocks, and the micro-kernel is kNr weight rows x kR x rows.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace servelm_quant {
namespace {

constexpr int kGb = 16;  // blocks per group (int32 lanes of a zmm)
constexpr int kNp = kPanelRows;  // weight rows per decoded panel
// Q8_0 too (quant_ops.cpp q8_panel), as on AVX2 (panels_avx2.cpp): the int16 scheme's codes of x, exactly its
// micro-kernel's (prep_row_panel_i16), against its codes sign-extended to int16, vpdpwssd. int8 codes of x
// (its codes + 128 against them, vpdpbusd: twice the products an instruction) had cost the default model 1.8
// points of teacher-forced top-1 agreement with fp32 in --quantization int8 (97.85% -> 96.09%, under the
// issue's 97%).
constexpr bool kPanelsQ8 = true;
template <Fmt F>
constexpr int64_t kWidth = F == Q8_0 ? 2 : 1;  // bytes per code (Q8_0: 16 slices of 64 bytes a group)
template <Fmt F>
constexpr int64_t kS1 = 1;  // floats of s1 per block (the driver's scale buffer)
constexpr int kNr = 4;   // weight rows per micro-tile
constexpr int kR = 3;    // rows of x per micro-tile
constexpr int64_t kGroupBytes = kGb * kBlock;  // one group of 16 blocks: 8 slices of 64 bytes

// 4 registers whose 128-bit lane i is row i of a 4x4 grid of 128-bit lanes -> out[i] = column i.
inline void transpose_lanes(const __m512i t[4], __m512i out[4]) {
  const __m512i u0 = _mm512_shuffle_i32x4(t[0], t[1], 0x44), u1 = _mm512_shuffle_i32x4(t[0], t[1], 0xEE);
  const __m512i u2 = _mm512_shuffle_i32x4(t[2], t[3], 0x44), u3 = _mm512_shuffle_i32x4(t[2], t[3], 0xEE);
  out[0] = _mm512_shuffle_i32x4(u0, u2, 0x88);
  out[1] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
  out[2] = _mm512_shuffle_i32x4(u1, u3, 0x88);
  out[3] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
}

// Rows [n, n + rows) of w into a panel: codes [kNp][G][8 slices][64] (slice i, bytes 4l..4l+3: block 16g + l's
// k 4i..4i+3, unsigned, the planes added, the offset not taken out), s0/s1 [kNp][G * 16] fp32 (row_scales_ref's,
// zero past KB). Rows past `rows` are zero.
template <Fmt F>
void decode_panel(const QWeight& w, int64_t n, int rows, int64_t G, uint8_t* codes, float* s0, float* s1) {
  const int64_t kb = w.KB, kp = plane_stride(w), kbg = G * kGb;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i sixteen = _mm512_set1_epi8(Traits<F>::plane_value), thirty_two = _mm512_set1_epi8(32);
  // a quad's 16 dwords are (block e, k 4i..) at 4e + i; to (i, e) at 4i + e
  const __m512i tr = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int j = 0; j < kNp; ++j) {
    uint8_t* cj = codes + j * G * kGroupBytes * kWidth<F>;
    float* s0j = s0 + j * kbg;
    float* s1j = s1 + j * kbg;
    if (j >= rows) {
      std::memset(cj, 0, G * kGroupBytes * kWidth<F>);
      std::fill(s0j, s0j + kbg, 0.0f);
      std::fill(s1j, s1j + kbg, 0.0f);
      continue;
    }
    const int64_t row = n + j;
    std::fill(s1j, s1j + kbg, 0.0f);
    row_scales_avx512(w, row, s0j, s1j, kbg);
    if constexpr (F == Q8_0) {  // block b's k 2i, 2i + 1 as int16 at slice i, lane b % 16
      std::memset(cj, 0, G * kGroupBytes * kWidth<F>);
      const int8_t* src = reinterpret_cast<const int8_t*>(w.qs) + row * kb * kBlock;
      for (int64_t b = 0; b < kb; ++b) {
        alignas(64) uint32_t dw[16];
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + b * kBlock));
        _mm512_store_si512(dw, _mm512_cvtepi8_epi16(v));
        uint8_t* dst = cj + (b / kGb) * kWidth<F> * kGroupBytes + (b % kGb) * 4;
        for (int i = 0; i < 16; ++i) std::memcpy(dst + i * 64, &dw[i], 4);
      }
      continue;
    }
    const uint8_t* q = w.qs + row * kb * Traits<F>::payload;
    const uint64_t* h1 = Traits<F>::planes >= 1 ? w.qh + row * kp : nullptr;
    const uint64_t* h2 = Traits<F>::planes >= 2 && !Traits<F>::crumbs ? w.qh2 + row * kp : nullptr;
    for (int64_t g = 0; g < G; ++g) {
      __m512i tl[4], th[4];
      for (int e = 0; e < 4; ++e) {
        const int64_t b = g * 16 + e * 4;
        if (b >= kb) {
          tl[e] = th[e] = _mm512_setzero_si512();
          continue;
        }
        const __mmask64 tail = kb - b >= 4 ? ~0ull : (1ull << (16 * (kb - b))) - 1ull;
        __m512i lo, hi;
        if constexpr (Traits<F>::crumb_codes) {  // Q2_K, Q3_K: whole quads, 32 crumb bytes
          crumb_codes_quad(q + b * 8, Traits<F>::crumb_base, lo, hi);
        } else {
          const __m512i raw = _mm512_maskz_loadu_epi8(tail, q + b * 16);
          lo = lut_bytes<F>(_mm512_and_si512(raw, low4));
          hi = lut_bytes<F>(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
        }
        if constexpr (Traits<F>::crumbs) {  // whole quads (k-quants): no tail
          add_crumbs_quad(reinterpret_cast<const uint8_t*>(h1 + b), lo, hi);
        } else if constexpr (Traits<F>::planes >= 1) {
          lo = _mm512_mask_add_epi8(lo, h1[b / 2] & tail, lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, h1[b / 2 + 1] & tail, hi, sixteen);
        }
        if constexpr (Traits<F>::planes >= 2 && !Traits<F>::crumbs) {
          lo = _mm512_mask_add_epi8(lo, h2[b / 2] & tail, lo, thirty_two);
          hi = _mm512_mask_add_epi8(hi, h2[b / 2 + 1] & tail, hi, thirty_two);
        }
        tl[e] = _mm512_permutexvar_epi32(tr, lo);  // 128-bit lane i: slice i's lanes 4e..4e+3
        th[e] = _mm512_permutexvar_epi32(tr, hi);
      }
      __m512i out[4];
      uint8_t* dst = cj + g * kGroupBytes;
      transpose_lanes(tl, out);
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(dst + i * 64, out[i]);
      transpose_lanes(th, out);
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(dst + (4 + i) * 64, out[i]);
    }
  }
}

// Q8_0: int16 weights x int16 x (the int16 scheme's codes), sixteen vpdpwssd a group into int32 lanes (a block's
// 32 products: at most 32 x 128 x 32767), then as the nibble formats.
template <int R>
inline void micro_q8(const uint8_t* wc, const float* s0, int64_t G, const XP& x, int64_t i0, float out[kNr][kR]) {
  const int64_t kbg = G * kGb, wstride = G * 2 * kGroupBytes;
  __m512 acc[kNr][R];
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t gb = g * kGb;
    __m512i ia[kNr][R];
    for (int j = 0; j < kNr; ++j)
      for (int r = 0; r < R; ++r) ia[j][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 16; ++i) {
      __m512i xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(x.q + (i0 + r) * wstride + g * 2 * kGroupBytes + i * 64);
      for (int j = 0; j < kNr; ++j) {
        const __m512i wv = _mm512_loadu_si512(wc + j * wstride + g * 2 * kGroupBytes + i * 64);
        for (int r = 0; r < R; ++r) ia[j][r] = _mm512_dpwssd_epi32(ia[j][r], wv, xv[r]);
      }
    }
    for (int j = 0; j < kNr; ++j) {
      const __m512 wsv = _mm512_loadu_ps(s0 + j * kbg + gb);
      for (int r = 0; r < R; ++r)
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[j][r]),
                                    _mm512_mul_ps(wsv, _mm512_loadu_ps(x.s + (i0 + r) * x.ss + gb)), acc[j][r]);
    }
  }
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) out[j][r] = _mm512_reduce_add_ps(acc[j][r]);
}

// kNr panel rows (from `wc`, row stride G * 512) x R rows of x (from row i0): out[j][r] = the dot product.
// Per group: int32 lanes from x's offset correction, eight vpdpbusd (split formats: four per half), then
// lanes * (weight scale * x scale) into fp32 lane accumulators, the minimum term (s1 * x's block sums) too;
// the 16 lanes summed at the end.
template <Fmt F, int R>
inline void micro(const uint8_t* wc, const float* s0, const float* s1, int64_t G, const XP& x, int64_t i0,
                  float out[kNr][kR]) {
  if constexpr (F == Q8_0) {
    micro_q8<R>(wc, s0, G, x, i0, out);
    return;
  }
  constexpr bool split = Traits<F>::split, off = Traits<F>::offset != 0;
  const int64_t kbg = G * kGb, wstride = G * kGroupBytes;
  __m512 acc[kNr][R];
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  const int8_t* xq[R];
  const float* xs[R];
  const int32_t* xc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q + (i0 + r) * wstride;
    xs[r] = x.s + (i0 + r) * x.ss;
    xc[r] = x.corr + (i0 + r) * x.ss;
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t gb = g * kGb;
    for (int h = 0; h < (split ? 2 : 1); ++h) {
      __m512i ia[kNr][R];
      for (int r = 0; r < R; ++r) {
        const __m512i c = off ? _mm512_loadu_si512(xc[r] + h * kbg + gb) : _mm512_setzero_si512();
        for (int j = 0; j < kNr; ++j) ia[j][r] = c;
      }
      const int i_end = split ? 4 * h + 4 : 8;
#pragma GCC unroll 8
      for (int i = split ? 4 * h : 0; i < i_end; ++i) {
        __m512i xv[R];
        for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(xq[r] + g * kGroupBytes + i * 64);
        for (int j = 0; j < kNr; ++j) {
          const __m512i wv = _mm512_loadu_si512(wc + j * wstride + g * kGroupBytes + i * 64);
          for (int r = 0; r < R; ++r) ia[j][r] = _mm512_dpbusd_epi32(ia[j][r], wv, xv[r]);
        }
      }
      const float* ws = (split && h) ? s1 : s0;
      for (int j = 0; j < kNr; ++j) {
        const __m512 wsv = _mm512_loadu_ps(ws + j * kbg + gb);
        for (int r = 0; r < R; ++r)
          acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[j][r]), _mm512_mul_ps(wsv, _mm512_loadu_ps(xs[r] + gb)),
                                      acc[j][r]);
      }
    }
    if constexpr (Traits<F>::has_min) {
      for (int j = 0; j < kNr; ++j) {
        const __m512 wm = _mm512_loadu_ps(s1 + j * kbg + gb);
        for (int r = 0; r < R; ++r)
          acc[j][r] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(xs[r] + kbg + gb), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) out[j][r] = _mm512_reduce_add_ps(acc[j][r]);
}

#include "panels_driver.inc"

}  // namespace

void panels_avx512_vnni_i8(const XP& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1) {
  run_any(x, w, bias, y, n0, n1);
}

}  // namespace servelm_quant

#pragma GCC pop_options
