// Shared by the per-ISA kernel files: the weight view, the prepared activations, fp16 scales, the entry points.
//
// The scheme (llama.cpp's, with 16-bit activations): each row of x is quantised per block of 32 to int16 with
// a power-of-two scale s (|x| / s <= 32767, rounded to nearest even); a block's dot product with the weight's
// integer codes is exact int32 arithmetic (vpdpwssd / vpmaddwd; the SIMD paths' lanes stay below 2^24, so their
// conversion to fp32 is exact too, the scalar path's whole-block sum may round); it is scaled by s (a power of two)
// and the weight's fp16 scale d, and added to fp32 lane accumulators in block order; the lanes are summed in
// one fixed tree, then q4_1's minimum term (sum over blocks of m * the fp32 sum of x's block) and the bias.
// Every output element is therefore one fixed sequence of operations on its own row of x and of W, whatever
// M is, however rows are grouped into micro-tiles and however threads split N: batch-invariant.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace servelm_quant {

// The block formats (servelm.kernels.quant.FORMATS is the Python side of this table; the codes must agree).
enum Fmt : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4 };
constexpr int64_t kNumFmts = 5;
constexpr int64_t kBlock = 32;

// One row of the format table: how a block's integer codes become values, value = d * (code - offset) (+ m).
// q8_0's codes are the signed bytes; the others' are the nibbles of qs, plus (q5_*) a fifth bit from qh.
template <Fmt F>
struct Traits {
  static constexpr bool nibbles = F != Q8_0;        // qs holds 16 bytes of nibble pairs, not 32 int8
  static constexpr bool has_min = F == Q4_1 || F == Q5_1;
  static constexpr bool has_qh = F == Q5_0 || F == Q5_1;
  static constexpr int offset = F == Q4_0 ? 8 : F == Q5_0 ? 16 : 0;
  static constexpr int payload = nibbles ? 16 : 32;  // bytes of qs per block
};

// Run-time view of the same table (the scalar paths and argument checks).
inline bool fmt_has_min(Fmt f) { return f == Q4_1 || f == Q5_1; }
inline bool fmt_has_qh(Fmt f) { return f == Q5_0 || f == Q5_1; }
inline int fmt_offset(Fmt f) { return f == Q4_0 ? 8 : f == Q5_0 ? 16 : 0; }
inline int fmt_payload(Fmt f) { return f == Q8_0 ? 32 : 16; }

// Calls fn(std::integral_constant<Fmt, F>{}) for the run-time format f: the drivers are written once over it.
template <typename Fn>
inline void dispatch_fmt(Fmt f, Fn&& fn) {
  switch (f) {
    case Q8_0: fn(std::integral_constant<Fmt, Q8_0>{}); break;
    case Q4_0: fn(std::integral_constant<Fmt, Q4_0>{}); break;
    case Q4_1: fn(std::integral_constant<Fmt, Q4_1>{}); break;
    case Q5_0: fn(std::integral_constant<Fmt, Q5_0>{}); break;
    default: fn(std::integral_constant<Fmt, Q5_1>{}); break;
  }
}

// One [N, KB * 32] quantised weight: qs (q8_0: int8 [N, KB, 32]; q4_*, q5_*: uint8 [N, KB, 16], element j in
// the low nibble of byte j, element j + 16 in the high one), d and m (fp16 bits [N, KB]; m only for q4_1 and
// q5_1), qh (uint32 [N, KB], q5_* only: bit j is the fifth bit of element j's code).
struct QWeight {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;
  const uint32_t* qh;
  int64_t N;
  int64_t KB;
  Fmt fmt;
};

// The integer code of element k (0..31) of block b of row n (the scalar reference of every path).
inline int code_at(const QWeight& w, int64_t n, int64_t b, int k) {
  if (w.fmt == Q8_0) return reinterpret_cast<const int8_t*>(w.qs)[(n * w.KB + b) * 32 + k];
  const uint8_t byte = w.qs[(n * w.KB + b) * 16 + (k & 15)];
  int q = k < 16 ? (byte & 15) : (byte >> 4);
  if (w.qh) q |= static_cast<int>((w.qh[n * w.KB + b] >> k) & 1u) << 4;
  return q - fmt_offset(w.fmt);
}

// x prepared for one ISA: int16 codes [M][KBp * 32] in that ISA's layout, block scales s [M][KBp] (padding
// blocks: 0), fp32 block sums [M][KBp] (formats with a minimum only), and for the AVX-512 q4 layout the scales of each pair of
// blocks spread over 16 lanes, [M][KBp / 2][16] (all three with the row stride `ss`).
struct XQ {
  const int16_t* q;
  const float* s;
  const float* xsum;
  const float* spair;
  int64_t M;
  int64_t KBp;
  int64_t ss;  // row stride (floats) of s, xsum and spair: row i's scales are at s + i * ss
};

// Code layouts of one row of x: natural order, or (AVX-512, q4) per pair of blocks (b, b + 1):
// [b's k 0..15, b+1's k 0..15, b's k 16..31, b+1's k 16..31], matching nibbles widened to 16-bit words.
enum Layout : int { kNatural = 0, kPairs = 1 };

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

// y[:, n0:n1] = x @ W[n0:n1].T (+ bias[n0:n1]) with y fp32 [M, N] (row stride N).
using GemmFn = void (*)(const XQ& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1);

void gemm_scalar(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
void gemm_avx2(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
void gemm_avx512(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
void gemm_avx512_vnni(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);

// The fp32 tile kernels (tiles_*.cpp), for many rows of x outside deterministic mode: rows of W dequantised `nb`
// at a time into `buf` (exactly gguf's values, nb * KB * 32 floats), then y[:, n0:n1] = x @ W[n0:n1].T with x
// fp32 [M, KB * 32], each output one sequential fp32 sum over k (plus the bias, last). Numerically fp32 on the
// dequantised weights, so not bitwise the int16 scheme: the two are never mixed where rows must be invariant.
using TileGemmFn = void (*)(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t n0,
                            int64_t n1, float* buf, int64_t nb);
void tiles_gemm_scalar(const float*, int64_t, const QWeight&, const float*, float*, int64_t, int64_t, float*, int64_t);
void tiles_gemm_avx2(const float*, int64_t, const QWeight&, const float*, float*, int64_t, int64_t, float*, int64_t);
void tiles_gemm_avx512(const float*, int64_t, const QWeight&, const float*, float*, int64_t, int64_t, float*, int64_t);

}  // namespace servelm_quant
