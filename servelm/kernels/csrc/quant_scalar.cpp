// Portable kernel (any CPU, no SIMD assumptions): the scheme of quant_common.h with one fp32 accumulator per
// output, blocks in order.
#include "quant_common.h"

namespace servelm_quant {
namespace {

float row_dot(const XQ& x, int64_t i, const QWeight& w, int64_t n) {
  const int64_t kb = w.KB;
  const int16_t* xq = x.q + i * x.KBp * kBlock;
  const float* s = x.s + i * x.ss;
  float acc = 0.0f, msum = 0.0f;
  for (int64_t b = 0; b < kb; ++b) {
    const int16_t* xb = xq + b * kBlock;
    int32_t dot = 0;
    for (int k = 0; k < 32; ++k) dot += code_at(w, n, b, k) * xb[k];
    acc += static_cast<float>(dot) * s[b] * half_to_float(w.d[n * kb + b]);
    if (w.m) msum += half_to_float(w.m[n * kb + b]) * x.xsum[i * x.ss + b];
  }
  return acc + msum;
}

}  // namespace

void gemm_scalar(const XQ& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t i = 0; i < x.M; ++i) {
      const float v = row_dot(x, i, w, n);
      y[i * w.N + n] = bias ? v + bias[n] : v;
    }
}

}  // namespace servelm_quant
