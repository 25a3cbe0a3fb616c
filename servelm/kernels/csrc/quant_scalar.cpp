// Portable kernel (any CPU, no SIMD assumptions): the scheme of quant_common.h with one fp32 accumulator per
// output, blocks in order.
#include "quant_common.h"

namespace servelm_quant {
namespace {

float row_dot(const XQ& x, int64_t i, const QWeight& w, int64_t n) {
  const int64_t kb = w.KB;
  const int16_t* xq = x.q + i * x.KBp * kBlock;
  const float* s = x.s + i * x.ss;
  const int off = w.fmt == Q4_0 ? 8 : 0;
  float acc = 0.0f, msum = 0.0f;
  for (int64_t b = 0; b < kb; ++b) {
    const int16_t* xb = xq + b * kBlock;
    int32_t dot = 0;
    if (w.fmt == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + (n * kb + b) * 32;
      for (int k = 0; k < 32; ++k) dot += static_cast<int32_t>(q[k]) * xb[k];
    } else {
      const uint8_t* q = w.qs + (n * kb + b) * 16;
      for (int j = 0; j < 16; ++j) dot += ((q[j] & 15) - off) * xb[j] + ((q[j] >> 4) - off) * xb[j + 16];
    }
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
