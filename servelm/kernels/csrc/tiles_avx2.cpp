// AVX2 + FMA kernel: the AVX-512 kernel's structure with 8 lanes and a 3 x 4 micro-kernel (16 ymm registers).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace servelm_quant {
namespace tiles_avx2 {

constexpr int MR = 3;
constexpr int NR = 4;

// 16 int8 values (signed) -> two 8-float vectors, times the scale (plus the min when given).
static inline void store16(__m128i q, bool is_signed, __m256 dv, const __m256* mv, float* o) {
  const __m128i q_hi = _mm_srli_si128(q, 8);
  __m256i a = is_signed ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
  __m256i b = is_signed ? _mm256_cvtepi8_epi32(q_hi) : _mm256_cvtepu8_epi32(q_hi);
  __m256 fa = _mm256_mul_ps(_mm256_cvtepi32_ps(a), dv);
  __m256 fb = _mm256_mul_ps(_mm256_cvtepi32_ps(b), dv);
  if (mv) {
    fa = _mm256_add_ps(fa, *mv);
    fb = _mm256_add_ps(fb, *mv);
  }
  _mm256_storeu_ps(o, fa);
  _mm256_storeu_ps(o + 8, fb);
}

// 16 bits -> 16 bytes: `value` where the bit is set, else 0 (the q5/q6 plane bits).
static inline __m128i plane_bits(uint32_t bits16, __m128i value) {
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits16)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), value);
}

static void dequant_row(const QWeight& w, int64_t n, float* out) {
  const int64_t kb = w.KB;
  thread_local std::vector<float> s0, s1;
  s0.resize(kb);
  s1.resize(kb);
  row_scales_ref(w, n, s0.data(), s1.data(), kb);
  const bool split = fmt_split(w.fmt), has_min = fmt_has_min(w.fmt);
  const int planes = fmt_planes(w.fmt);
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i offset = _mm_set1_epi8(static_cast<char>(fmt_offset(w.fmt)));
  const bool is_signed = fmt_offset(w.fmt) != 0, lut = fmt_lut(w.fmt);
  const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  for (int64_t b = 0; b < kb; ++b) {
    const __m256 dv = _mm256_set1_ps(s0[b]);
    const __m256 mv = _mm256_set1_ps(s1[b]);
    float* o = out + b * kBlock;
    if (w.fmt == Q8_0) {
      const uint8_t* q = w.qs + (n * kb + b) * 32;
      store16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), true, dv, nullptr, o);
      store16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)), true, dv, nullptr, o + 16);
      continue;
    }
    const __m128i raw = fmt_crumb_codes(w.fmt)
                            ? crumb_nibbles(code_crumbs(w, n), b, fmt_crumb_base(w.fmt))
                            : _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + (n * kb + b) * 16));
    __m128i lo = _mm_and_si128(raw, low4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    for (int p = 0; p < planes; ++p) {
      const uint32_t h = block_plane(w, p, n, b);
      const __m128i v = _mm_set1_epi8(static_cast<char>(p ? 32 : fmt_plane_value(w.fmt)));
      lo = _mm_or_si128(lo, plane_bits(h & 0xFFFFu, v));
      hi = _mm_or_si128(hi, plane_bits(h >> 16, v));
    }
    if (lut) {  // IQ4_NL, IQ4_XS: the nibbles' signed values (kIq4Values)
      lo = _mm_shuffle_epi8(values, lo);
      hi = _mm_shuffle_epi8(values, hi);
    } else if (is_signed) {
      lo = _mm_sub_epi8(lo, offset);
      hi = _mm_sub_epi8(hi, offset);
    }
    store16(lo, is_signed, dv, has_min ? &mv : nullptr, o);
    store16(hi, is_signed, split ? mv : dv, has_min ? &mv : nullptr, o + 16);
  }
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int C>
static inline void micro(const float* x, int64_t kp, const float* w, float* y, int64_t ldy, const float* bias) {
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; k += 8) {
    __m256 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm256_loadu_ps(x + i * kp + k);
    for (int j = 0; j < C; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * kp + k);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      float s = hsum8(acc[i][j]);
      y[i * ldy + j] = bias ? s + bias[j] : s;
    }
}

#include "tiles_driver.inc"

}  // namespace tiles_avx2

void tiles_gemm_avx2(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1,
               float* buf, int64_t nb) {
  tiles_avx2::gemm_tiles(x, M, w, bias, y, n0, n1, buf, nb);
}

}  // namespace servelm_quant

#pragma GCC pop_options
