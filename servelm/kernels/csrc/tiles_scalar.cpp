// Portable kernel (any CPU, no SIMD assumptions): the same tiles, a plain in-order dot product per output.
#include <algorithm>

#include "quant_common.h"

namespace servelm_quant {
namespace tiles_scalar {

constexpr int MR = 1;
constexpr int NR = 4;

static void dequant_row(const QWeight& w, int64_t n, float* out) {
  const int64_t kb = w.KB;
  for (int64_t b = 0; b < kb; ++b) {
    const float d = half_to_float(w.d[n * kb + b]);
    float* o = out + b * kBlock;
    if (w.fmt == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + (n * kb + b) * 32;
      for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * d;
      continue;
    }
    const uint8_t* q = w.qs + (n * kb + b) * 16;
    const float m = w.fmt == Q4_1 ? half_to_float(w.m[n * kb + b]) : 0.0f;
    for (int j = 0; j < 16; ++j) {
      const int lo = q[j] & 0x0f, hi = q[j] >> 4;
      if (w.fmt == Q4_0) {
        o[j] = static_cast<float>(lo - 8) * d;
        o[j + 16] = static_cast<float>(hi - 8) * d;
      } else {
        o[j] = static_cast<float>(lo) * d + m;
        o[j + 16] = static_cast<float>(hi) * d + m;
      }
    }
  }
}

template <int R, int C>
static inline void micro(const float* x, int64_t kp, const float* w, float* y, int64_t ldy, const float* bias) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      const float* xr = x + i * kp;
      const float* wr = w + j * kp;
      float s = 0.0f;
      for (int64_t k = 0; k < kp; ++k) s += xr[k] * wr[k];
      y[i * ldy + j] = bias ? s + bias[j] : s;
    }
}

#include "tiles_driver.inc"

}  // namespace tiles_scalar

void tiles_gemm_scalar(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1,
                 float* buf, int64_t nb) {
  tiles_scalar::gemm_tiles(x, M, w, bias, y, n0, n1, buf, nb);
}

}  // namespace servelm_quant
