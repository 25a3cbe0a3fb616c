// Shared by the per-ISA kernel files: the weight view, fp16 scales, the entry point each ISA provides.
#pragma once
#include <cstdint>
#include <cstring>

namespace servelm_quant {

enum Fmt : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
constexpr int64_t kBlock = 32;

// One [N, KB * 32] quantised weight: qs (q8_0: int8 [N, KB, 32]; q4_*: uint8 [N, KB, 16], element j in the low
// nibble of byte j, element j + 16 in the high one), d and m (fp16 bits [N, KB]; m only for q4_1).
struct QWeight {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;
  int64_t N;
  int64_t KB;
  Fmt fmt;
};

// Exact fp16 -> fp32 (normals, subnormals, inf/nan), the scalar path's conversion.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    float f = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// y[:, n0:n1] = x @ W[n0:n1].T (+ bias[n0:n1]); x fp32 [M, KB * 32], y fp32 [M, N] (row stride N).
// Rows of W are dequantised `nb` at a time into `buf` (nb * KB * 32 floats). Every output element is one
// dot product in a fixed order that depends on neither M, n0/n1 nor nb: the kernel is batch-invariant.
using GemmFn = void (*)(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t n0,
                        int64_t n1, float* buf, int64_t nb);

void gemm_scalar(const float*, int64_t, const QWeight&, const float*, float*, int64_t, int64_t, float*, int64_t);
void gemm_avx2(const float*, int64_t, const QWeight&, const float*, float*, int64_t, int64_t, float*, int64_t);
void gemm_avx512(const float*, int64_t, const QWeight&, const float*, float*, int64_t, int64_t, float*, int64_t);

}  // namespace servelm_quant
