// Portable kernel (any CPU, no SIMD assumptions): the same tiles, a plain in-order dot product per output.
#include <algorithm>
#include <vector>

#include "quant_common.h"

namespace servelm_quant {
namespace tiles_scalar {

constexpr int MR = 1;
constexpr int NR = 4;

static void dequant_row(const QWeight& w, int64_t n, float* out) {
  const int64_t kb = w.KB;
  thread_local std::vector<float> s0, s1;
  s0.resize(kb);
  s1.resize(kb);
  row_scales_ref(w, n, s0.data(), s1.data(), kb);
  const bool split = fmt_split(w.fmt), has_min = fmt_has_min(w.fmt);
  for (int64_t b = 0; b < kb; ++b) {
    float* o = out + b * kBlock;
    for (int k = 0; k < 32; ++k) {
      const float v = static_cast<float>(code_at(w, n, b, k)) * (split && k >= 16 ? s1[b] : s0[b]);
      o[k] = has_min ? v + s1[b] : v;
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
