// Portable kernel (any CPU, no SIMD assumptions): the scheme of quant_common.h with one fp32 accumulator per
// output, blocks in order.
#include <vector>

#include "quant_common.h"

namespace servelm_quant {
namespace {

float row_dot(const XQ& x, int64_t i, const QWeight& w, int64_t n, const float* s0, const float* s1) {
  const int64_t kb = w.KB;
  const int16_t* xq = x.q + i * x.KBp * kBlock;
  const float* s = x.s + i * x.ss;
  const bool split = fmt_split(w.fmt), has_min = fmt_has_min(w.fmt);
  float acc = 0.0f, msum = 0.0f;
  for (int64_t b = 0; b < kb; ++b) {
    const int16_t* xb = xq + b * kBlock;
    int32_t dot[2] = {0, 0};
    for (int k = 0; k < 32; ++k) dot[split && k >= 16] += code_at(w, n, b, k) * xb[k];
    acc += static_cast<float>(dot[0]) * s[b] * s0[b];
    if (split) acc += static_cast<float>(dot[1]) * s[b] * s1[b];
    if (has_min) msum += s1[b] * x.xsum[i * x.ss + b];
  }
  return acc + msum;
}

}  // namespace

void gemm_scalar(const XQ& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1) {
  std::vector<float> s0(w.KB), s1(w.KB);
  for (int64_t n = n0; n < n1; ++n) {
    row_scales_ref(w, n, s0.data(), s1.data(), w.KB);
    for (int64_t i = 0; i < x.M; ++i) {
      const float v = row_dot(x, i, w, n, s0.data(), s1.data());
      y[i * w.N + n] = bias ? v + bias[n] : v;
    }
  }
}

}  // namespace servelm_quant
