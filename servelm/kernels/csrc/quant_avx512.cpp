// AVX-512F kernel: rows dequantised into an fp32 tile (exactly gguf's values), then a 4 x 6 register-blocked
// dot-product micro-kernel, 16 lanes per accumulator, one `_mm512_reduce_add_ps` per output element.
#include <immintrin.h>

#include <algorithm>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

namespace servelm_quant {
namespace avx512 {

constexpr int MR = 4;
constexpr int NR = 6;

// fp32 scales of blocks [b0, b0 + 16) of one row (fewer at the row's end).
static inline void scales16(const uint16_t* h, int64_t count, float* out) {
  alignas(32) uint16_t tmp[16] = {0};
  std::memcpy(tmp, h, static_cast<size_t>(count) * 2);
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tmp))));
}

static inline __m512 nibbles_to_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }

static void dequant_row(const QWeight& w, int64_t n, float* out) {
  const int64_t kb = w.KB;
  const uint16_t* d = w.d + n * kb;
  const uint16_t* m = w.m ? w.m + n * kb : nullptr;
  const __m128i low4 = _mm_set1_epi8(0x0f);
  alignas(64) float ds[16], ms[16];
  for (int64_t c = 0; c < kb; c += 16) {
    const int64_t cnt = std::min<int64_t>(16, kb - c);
    scales16(d + c, cnt, ds);
    if (m) scales16(m + c, cnt, ms);
    for (int64_t i = 0; i < cnt; ++i) {
      const int64_t b = c + i;
      const __m512 dv = _mm512_set1_ps(ds[i]);
      float* o = out + b * kBlock;
      if (w.fmt == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + b * 32 + n * kb * 32;
        const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), dv));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), dv));
        continue;
      }
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + (n * kb + b) * 16));
      __m128i lo = _mm_and_si128(raw, low4);
      __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
      if (w.fmt == Q4_0) {
        const __m128i eight = _mm_set1_epi8(8);
        lo = _mm_sub_epi8(lo, eight);
        hi = _mm_sub_epi8(hi, eight);
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), dv));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), dv));
      } else {
        const __m512 mv = _mm512_set1_ps(ms[i]);
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(nibbles_to_ps(lo), dv), mv));
        _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(nibbles_to_ps(hi), dv), mv));
      }
    }
  }
}

template <int R, int C>
static inline void micro(const float* x, int64_t kp, const float* w, float* y, int64_t ldy, const float* bias) {
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; k += 16) {
    __m512 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(x + i * kp + k);
    for (int j = 0; j < C; ++j) {
      const __m512 wv = _mm512_loadu_ps(w + j * kp + k);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      y[i * ldy + j] = bias ? s + bias[j] : s;
    }
}

#include "quant_driver.inc"

}  // namespace avx512

void gemm_avx512(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1,
                 float* buf, int64_t nb) {
  avx512::gemm_tiles(x, M, w, bias, y, n0, n1, buf, nb);
}

}  // namespace servelm_quant

#pragma GCC pop_options
