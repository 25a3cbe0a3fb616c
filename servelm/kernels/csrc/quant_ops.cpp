// torch ops `servelm_quant::*`: run-time ISA dispatch, activation quantisation and threading (torch's intra-op
// pool) around the kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <tuple>
#include <vector>

#include "parallel.h"
#include "quant_common.h"

namespace servelm_quant {
namespace {

// kAvx512VnniI8 and kAvx2I8 are not ISAs of their own: AVX-512 VNNI and AVX2 with the int8-activation scheme for
// the nibble formats, the default where the CPU has them (see servelm.kernels.quant.activation_scheme).
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512VnniI8 = 4, kAvx2I8 = 5 };

// The ISA an index runs on (the int8 variants on their own).
inline int64_t base_isa(int64_t isa) { return isa == kAvx512VnniI8 ? kAvx512Vnni : isa == kAvx2I8 ? kAvx2 : isa; }
inline bool int8_scheme(int64_t isa) { return isa == kAvx512VnniI8 || isa == kAvx2I8; }
// Whether a weight in format f takes the int8 scheme on path isa: the nibble formats (servelm.kernels.quant.
// activation_scheme says the same). The lookup formats on AVX2 take it with their signed table values and
// vpsignb (quant_avx2.cpp micro_i8), not the unsigned codes (+128, up to 241) that would saturate vpmaddubsw's
// int16 pair sums; so their x carries no offset correction there (int8_offset).
inline bool int8_for(int64_t isa, Fmt f) { return int8_scheme(isa) && f != Q8_0; }
// The offset x's int8 codes are corrected for (prep_row_i8): the format's, except the lookup formats on AVX2.
inline int int8_offset(int64_t isa, Fmt f) { return isa == kAvx2I8 && fmt_lut(f) ? 0 : fmt_offset(f); }
// Whether many rows take the int8 panel GEMM (linear_tiles): the int8 formats, but not the lookup formats on
// AVX2, which keep the fp32 tiles there: a panel with the micro-kernel's signed path (vpsignb per slice and row
// of x, each slice's pair sums widened on their own) ran at 1.1-1.2x the tiles' time at 128 x 8192 x 2048
// (servelm.kernels.quant.many_rows_scheme says the same).
inline bool panel_for(int64_t isa, Fmt f) { return int8_for(isa, f) && !(isa == kAvx2I8 && fmt_lut(f)); }

// Whether Q8_0's many-rows path is a panel GEMM with the int16 scheme's codes (panels_avx2.cpp, and
// panels_avx512_vnni.cpp's vpdpwssd), not fp32 tiles (servelm.kernels.quant.many_rows_scheme says the same).
// On AVX-512 VNNI from K = 1,024 (32 blocks): at K = 384 and 576 the groups of 16 blocks carry 25-44% padding and
// the fp32 tiles were as fast or faster (servelm.kernels.quant.Q8_VNNI_PANEL_MIN_K says the same).
inline bool q8_panel_avx512(int64_t isa) { return isa == kAvx512Vnni || isa == kAvx512VnniI8; }
inline bool q8_panel(int64_t isa, Fmt f, int64_t KB) {
  return f == Q8_0 && (isa == kAvx2 || isa == kAvx2I8 || (q8_panel_avx512(isa) && KB >= 32));
}
// Whether x is rounded per super-block of 256 (llama.cpp's Q8_K, with power-of-two sub-scales per block: see
// kSubShift) instead of per block of 32: the k-quants
// (Q3_K, Q4_K, Q5_K, Q6_K) on AVX2, whose micro-kernel then sums a super-block's scaled blocks in int32 (each block's
// dot product times its 6-bit or int8 scale, vpmaddwd) and scales once per 256 weights, where one x scale per
// block had cost a convert, a multiply and an fma per pair of blocks and row of x
// (servelm.kernels.quant.activation_block says the same).
inline bool super_x(int64_t isa, Fmt f) { return isa == kAvx2I8 && fmt_kquant(f) && !fmt_lut(f); }

// fn(n0, n1) over the weight rows [0, N) in units of `unit` rows (n0 a multiple of it), shared among the threads by
// work stealing (parallel.h), `per_thread` chunks a thread. over_weight_rows: units of 16 rows (the micro-kernels'
// work, for M rows of x), 8 chunks a thread from 16 rows of x; 2 for M = 1, whose weights stream from memory (a
// chunk's start breaks the stream: 8 chunks cost the 1B shape's decode pass ~9%, 2 nothing measurable); in between
// chunks of at least kChunkBlocks (below).
// Measured (8 layers of the 1B shape, Q4_K, two threads, rounds interleaved in one process, against one static
// half a thread): a quiet machine 0.99-1.00x the time at M = 5 and 64; with one thread of the machine at 100%
// elsewhere, M = 64 0.85x; in a busy minute, M = 5 0.91x and M = 64 0.93x.
template <typename Fn>
void share_rows(int64_t N, int64_t unit, int64_t per_thread, const Fn& fn) {
  servelm_parallel::steal_range((N + unit - 1) / unit, at::get_num_threads() * per_thread,
                                [&](int64_t u0, int64_t u1) { fn(u0 * unit, std::min(N, u1 * unit)); });
}
// From 2 to 15 rows of x (verify steps, small batches), whose time the weights' bytes still set, chunks of no less than
// kChunkBlocks blocks of 16 weight rows (64-128 KB), down to 2 a thread: 8 a thread had cut the default model's
// 576-wide matrices into 16 chunks of 2-3 groups (15-20 KB) a matmul, whose starts each break the stream; verify
// steps of k = 1, 4, 8 drafts took 3-12% longer (docs/measurements/quant-kernels.md, "Twenty-sixth session").
// Prompts and larger batches keep 8 a thread.
constexpr int64_t kChunkBlocks = 256;
template <typename Fn>
void over_weight_rows(int64_t N, int64_t M, int64_t KB, const Fn& fn) {
  const int64_t chunks = (N + 15) / 16 * KB / kChunkBlocks / std::max(at::get_num_threads(), 1);
  share_rows(N, 16, M == 1 ? 2 : M < 16 ? std::clamp<int64_t>(chunks, 2, 8) : 8, fn);
}

// Whether `isa` may run on this CPU (best: best_isa()).
inline bool isa_available(int64_t isa, int64_t best) { return isa >= kScalar && isa <= kAvx2I8 && base_isa(isa) <= best; }

int64_t best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return __builtin_cpu_supports("avx512vnni") ? kAvx512Vnni : kAvx512;
  }
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

GemmFn gemm_for(int64_t isa) {
  TORCH_CHECK(isa_available(isa, best_isa()), "servelm_quant: ISA level ", isa, " is not available here");
  isa = base_isa(isa);
#if defined(__x86_64__) || defined(_M_X64)
  if (isa >= kAvx512Vnni) return gemm_avx512_vnni;
  if (isa == kAvx512) return gemm_avx512;
  if (isa == kAvx2) return gemm_avx2;
#endif
  return gemm_scalar;
}

// max |x| and the fp32 sum of one block of 32: eight partial maxima and sums (k % 8), combined in a fixed tree
// (vectorisable, unlike one running sum). The sum is nan when x has one (the max skips nan).
inline void block_stats(const float* xb, float* amax, float* sum) {
  float pmax[8] = {0}, psum[8] = {0};
  for (int k0 = 0; k0 < kBlock; k0 += 8)
    for (int l = 0; l < 8; ++l) {
      pmax[l] = std::max(pmax[l], std::fabs(xb[k0 + l]));
      psum[l] += xb[k0 + l];
    }
  for (int h = 4; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) {
      pmax[l] = std::max(pmax[l], pmax[l + h]);
      psum[l] += psum[l + h];
    }
  *amax = pmax[0];
  *sum = psum[0];
}

// The rounding of x runs once per row and weight matrix: at a prompt's many rows it had been ~10% of the default
// model's prefill, compiled for the baseline ISA (SSE2) like the rest of this file. These functions are also
// built for AVX-512 and picked at load (GCC's target_clones). The same operations in the same order (no fp
// contraction; the block sums in their fixed 8-lane tree), so the same codes, scales and bits.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SERVELM_PREP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SERVELM_PREP_CLONES
#endif

// One row of x (KB * 32 floats) -> int16 codes in `layout`, block scales, fp32 block sums (blocks KB..KBp-1
// are zero padding).
SERVELM_PREP_CLONES void prep_row(const float* x, int64_t KB, int64_t KBp, Layout layout, int16_t* q, float* s, float* xsum,
              float* spair) {
  for (int64_t b = 0; b < KBp; ++b) {
    int16_t code[kBlock] = {0};
    float scale = 0.0f, sum = 0.0f;
    if (b < KB) {
      const float* xb = x + b * kBlock;
      float amax;
      block_stats(xb, &amax, &sum);
      if (!std::isfinite(amax) || std::isnan(sum)) {
        scale = std::numeric_limits<float>::quiet_NaN();  // inf/nan in x: every output it touches is nan
      } else if (amax > 0.0f) {
        int e;
        std::frexp(amax, &e);  // amax = f * 2^e, f in [0.5, 1): |x| * 2^(15 - e) < 32768
        scale = std::ldexp(1.0f, e - 15);
        if (15 - e <= 127) {  // 2^(15 - e) is a normal float: x * it is exact; rounding to nearest even by the
          // 1.5 * 2^23 trick (|v| < 2^22), which vectorises where nearbyint is a library call per element
          const float inv = std::ldexp(1.0f, 15 - e);
          float v[kBlock];
          for (int k = 0; k < kBlock; ++k) v[k] = (xb[k] * inv + 12582912.0f) - 12582912.0f;
          for (int k = 0; k < kBlock; ++k) code[k] = static_cast<int16_t>(std::clamp(v[k], -32767.0f, 32767.0f));
        } else {  // a block of subnormal-sized values
          for (int k = 0; k < kBlock; ++k) {
            const float v = std::nearbyint(std::ldexp(xb[k], 15 - e));
            code[k] = static_cast<int16_t>(std::clamp(v, -32767.0f, 32767.0f));
          }
        }
      }
    }
    s[b] = scale;
    if (xsum) xsum[b] = sum;
    if (layout == kNatural) {
      std::memcpy(q + b * kBlock, code, sizeof(code));
    } else {
      int16_t* pq = q + (b / 2) * 2 * kBlock + (b % 2) * 16;
      std::memcpy(pq, code, 16 * sizeof(int16_t));
      std::memcpy(pq + kBlock, code + 16, 16 * sizeof(int16_t));
      for (int l = 0; l < 8; ++l) spair[(b / 2) * 16 + (b % 2) * 8 + l] = scale;
    }
  }
}

// One block's codes round(x * inv) (nearest even) in [-127, 127]; returns their sum.
inline int32_t round_block_i8(const float* xb, float inv, int8_t code[kBlock]) {
  float v[kBlock];
  for (int k = 0; k < kBlock; ++k) v[k] = (xb[k] * inv + 12582912.0f) - 12582912.0f;  // nearest even
  int32_t isum = 0;
  for (int k = 0; k < kBlock; ++k) {
    code[k] = static_cast<int8_t>(std::clamp(v[k], -127.0f, 127.0f));
    isum += code[k];
  }
  return isum;
}

// One block of 32 for the int8 scheme: d = amax / 127 and codes round(x * 127 / amax) in [-127, 127]
// (llama.cpp's Q8_0 rounding of activations, d kept in fp32); *sum = d * the sum of the codes (nan where x has
// inf or nan: then the scale is nan too). The decode kernel and the panel GEMM both round x here.
inline void quant_block_i8(const float* xb, int8_t code[kBlock], float* scale, float* sum) {
  float amax;
  *scale = 0.0f;
  block_stats(xb, &amax, sum);
  if (!std::isfinite(amax) || std::isnan(*sum)) {
    *scale = std::numeric_limits<float>::quiet_NaN();
  } else if (amax > 0.0f) {
    *scale = amax / 127.0f;
    const int32_t isum = round_block_i8(xb, 127.0f / amax, code);
    // The minimum term m * sum(x) takes the sum of the rounded x (llama.cpp's q8_1 `s`), not of x: then a
    // row's error is sum((d * q + m) * e), that of the weight itself. The exact sum left sum(d * q * e),
    // with q in 0..15 not centred: an error as large as |w - m| (top-1 agreement 93.3% -> 97.5% on the
    // default model, docs/measurements/quant-kernels.md).
    *sum = *scale * static_cast<float>(isum);
  } else {
    *sum = 0.0f;
  }
}

// One super-block of 256 (8 blocks; super_x): d = amax / 127 over the 256 values, e[j] the block's sub-scale
// exponent (see kSubShift) and its codes round(x * 2^e[j] * 127 / amax) as quant_block_i8's; `sums` the blocks'
// sums of codes. Returns d (nan where the super-block has inf or nan: every output it touches is nan; 0 where it
// is all zeros, codes 0).
inline float quant_super_i8(const float* xs, int8_t code[kSuper * kBlock], int32_t sums[kSuper], int e[kSuper]) {
  float amax = 0.0f, a[kSuper];
  bool bad = false;
  for (int j = 0; j < kSuper; ++j) {
    float sum;
    block_stats(xs + j * kBlock, &a[j], &sum);
    bad = bad || !std::isfinite(a[j]) || std::isnan(sum);
    amax = std::max(amax, a[j]);
  }
  std::memset(code, 0, kSuper * kBlock);
  std::fill(sums, sums + kSuper, 0);
  std::fill(e, e + kSuper, kSubShift);
  if (bad) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.0f) return 0.0f;
  const float inv = 127.0f / amax;
  for (int j = 0; j < kSuper; ++j) {  // products by powers of two: exact (amax is finite)
    int ej = 0;
    while (ej < kSubShift && a[j] * static_cast<float>(2 << ej) <= amax) ++ej;
    e[j] = ej;
    sums[j] = round_block_i8(xs + j * kBlock, inv * static_cast<float>(1 << ej), code + j * kBlock);
  }
  return amax / 127.0f;
}

// Block b's 32 codes into the quad layout (see XQ): [4t .. 4t+3's k 0..15] then [4t .. 4t+3's k 16..31].
inline void put_quad(int8_t* q, int64_t b, const int8_t code[kBlock]) {
  int8_t* pq = q + b / 4 * 4 * kBlock + b % 4 * 16;
  std::memcpy(pq, code, 16);
  std::memcpy(pq + 64, code + 16, 16);
}

// Block b's 32 codes into the panel layout (see XP): k 4i..4i+3 at slice i of its group of gb, bytes 4 (b % gb) on.
inline void put_panel(int8_t* q, int64_t b, int64_t gb, const int8_t code[kBlock]) {
  int8_t* dst = q + (b / gb) * gb * kBlock + (b % gb) * 4;
  for (int i = 0; i < 8; ++i) std::memcpy(dst + i * gb * 4, code + 4 * i, 4);
}

// One row of x for the k-quants on AVX2 (super_x; KB whole super-blocks): quant_super_i8 per super-block, the
// codes in the quad layout, d_fine = d * 2^-kSubShift per super-block in s, and `sub` (see XQ): each block's sums
// of codes k 0..15 and k 16..31 (|sum| <= 16 * 127) and its multiplier 2^(kSubShift - e_j), as int16.
SERVELM_PREP_CLONES void prep_row_i8k(const float* x, int64_t KB, int8_t* q, float* s, int16_t* sub) {
  for (int64_t sb = 0; sb < KB / kSuper; ++sb) {
    int8_t code[kSuper * kBlock];
    int32_t sums[kSuper];
    int e[kSuper];
    s[sb] = quant_super_i8(x + sb * kSuper * kBlock, code, sums, e) * (1.0f / (1 << kSubShift));
    int16_t* w = sub + sb * 32;
    for (int j = 0; j < kSuper; ++j) {
      const int8_t* c = code + j * kBlock;
      put_quad(q, sb * kSuper + j, c);
      int32_t lo = 0;
      for (int k = 0; k < 16; ++k) lo += c[k];
      w[2 * j] = static_cast<int16_t>(lo);
      w[2 * j + 1] = static_cast<int16_t>(sums[j] - lo);
      w[16 + 2 * j] = w[16 + 2 * j + 1] = static_cast<int16_t>(1 << (kSubShift - e[j]));
    }
  }
}

// Block b of one row of x for the int8 scheme (quant_block_i8; zeros from KB on), written in the quad layout (see
// XQ): its codes, scale s[b], d * its sum of codes xsum[b] (formats with a minimum), the lane scales of its quad
// and -offset * each lane's sum of codes (formats with an offset; split formats per half).
inline void prep_block_i8(const float* x, int64_t b, int64_t KB, int offset, bool split, int8_t* q, float* s,
                          float* xsum, float* slane, int32_t* corr) {
  int8_t code[kBlock] = {0};
  float scale = 0.0f, sum = 0.0f;
  if (b < KB) quant_block_i8(x + b * kBlock, code, &scale, &sum);
  s[b] = scale;
  if (xsum) xsum[b] = sum;
  // lane l of the quad is block 4t + l / 4
  const int64_t t = b / 4, e = b % 4;
  put_quad(q, b, code);
  for (int l = 0; l < 4; ++l) slane[t * 16 + e * 4 + l] = scale;
  if (corr)
    for (int l = 0; l < 4; ++l) {
      int32_t lo = 0, hi = 0;
      for (int u = 0; u < 4; ++u) {
        lo += code[4 * l + u];
        hi += code[16 + 4 * l + u];
      }
      int32_t* c = corr + t * 32 + e * 4 + l;  // split: each half its own; else one start for both
      if (split) {
        c[0] = -offset * lo;
        c[16] = -offset * hi;
      } else {
        c[0] = -offset * (lo + hi);
        c[16] = 0;
      }
    }
}

// One row of x for the int8 scheme: prep_block_i8 for blocks 0..KBq-1 (KB..KBq-1 are zero padding).
SERVELM_PREP_CLONES void prep_row_i8(const float* x, int64_t KB, int64_t KBq, int offset, bool split, int8_t* q, float* s,
                 float* xsum, float* slane, int32_t* corr) {
  for (int64_t b = 0; b < KBq; ++b) prep_block_i8(x, b, KB, offset, split, q, s, xsum, slane, corr);
}

#if defined(__x86_64__) || defined(_M_X64)
// One block's int8 rounding in AVX-512, as quant_block_i8's (the panel GEMM's and the decode kernel's): false
// where the block has an inf or a nan, or block_stats' sum of x in its order is nan (then the caller takes the
// scalar code, whose scale and sum are nan or inf there); else its codes (k 0..15, k 16..31), scale and the sum of
// its codes. A subnormal amax makes 127 / amax inf and a zero x nan there: the clamp keeps the nan (max and min
// return their second operand on a nan, as std::clamp returns v), the conversion gives 0x80000000 and the int8
// code 0, as the scalar cast does; the sums are taken over the int8 codes.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline bool round_block_avx512(
    const float* xb, __m128i* q0, __m128i* q1, float* scale, int32_t* isum) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  // block_stats' sum: 8 lanes of 4 values, then halves
  __m256 p8 = _mm256_add_ps(_mm512_castps512_ps256(x0), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x0), 1)));
  p8 = _mm256_add_ps(p8, _mm512_castps512_ps256(x1));
  p8 = _mm256_add_ps(p8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x1), 1)));
  const __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));
  const __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
  const float sum = _mm_cvtss_f32(_mm_add_ss(p2, _mm_shuffle_ps(p2, p2, 1)));
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  // |x| < inf is false for inf and nan
  if ((_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) != 0xFFFF ||
      std::isnan(sum))
    return false;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));  // exact in any order
  if (amax == 0.0f) {
    *q0 = *q1 = _mm_setzero_si128();
    *scale = 0.0f;
    *isum = 0;
    return true;
  }
  *scale = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(127.0f / amax), magic = _mm512_set1_ps(12582912.0f);
  const __m512 lo127 = _mm512_set1_ps(-127.0f), hi127 = _mm512_set1_ps(127.0f);
  const __m512 r0 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x0, inv), magic), magic);
  const __m512 r1 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x1, inv), magic), magic);
  *q0 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_min_ps(hi127, _mm512_max_ps(lo127, r0))));
  *q1 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_min_ps(hi127, _mm512_max_ps(lo127, r1))));
  *isum = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_cvtepi8_epi32(*q0), _mm512_cvtepi8_epi32(*q1)));
  return true;
}

// Block b of a row of x rounded by a vector form (codes k 0..15 in q0, k 16..31 in q1, its scale and sum of
// codes), written as prep_block_i8 writes it: in the quad layout, its scale, sum, lane scales and corrections.
// SSE4.1, so that both the AVX-512 and the AVX2 form inline it.
__attribute__((target("sse4.1"))) inline void put_block_i8(int64_t b, __m128i q0, __m128i q1, float scale,
                                                           int32_t isum, int offset, bool split, int8_t* q,
                                                           float* s, float* xsum, float* slane, int32_t* corr) {
  s[b] = scale;
  if (xsum) xsum[b] = scale * static_cast<float>(isum);
  const int64_t t = b / 4, e = b % 4;
  int8_t* pq = q + b / 4 * 4 * kBlock + b % 4 * 16;  // put_quad's places
  _mm_storeu_si128(reinterpret_cast<__m128i*>(pq), q0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(pq + 64), q1);
  _mm_storeu_ps(slane + t * 16 + e * 4, _mm_set1_ps(scale));
  if (corr) {  // each lane's sum of 4 codes: u8 ones times the s8 codes, pairs, then pairs of pairs
    const __m128i ones8 = _mm_set1_epi8(1), ones16 = _mm_set1_epi16(1), neg = _mm_set1_epi32(-offset);
    const __m128i lo = _mm_madd_epi16(_mm_maddubs_epi16(ones8, q0), ones16);
    const __m128i hi = _mm_madd_epi16(_mm_maddubs_epi16(ones8, q1), ones16);
    int32_t* c = corr + t * 32 + e * 4;
    if (split) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm_mullo_epi32(neg, lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16), _mm_mullo_epi32(neg, hi));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm_mullo_epi32(neg, _mm_add_epi32(lo, hi)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16), _mm_setzero_si128());
    }
  }
}

// prep_row_i8 in AVX-512 (the AVX-512 VNNI decode kernel's x): the same codes, scales, sums and corrections
// (the prep_quad op holds the two to the same bits in the tests), sharing round_block_avx512 with the panel's.
// On the default model's decode it did not move the step's time measurably (docs/measurements/quant-kernels.md).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void prep_row_i8_avx512(
    const float* x, int64_t KB, int64_t KBq, int offset, bool split, int8_t* q, float* s, float* xsum,
    float* slane, int32_t* corr) {
  for (int64_t b = 0; b < KBq; ++b) {
    __m128i q0, q1;
    float scale;
    int32_t isum;
    if (b >= KB || !round_block_avx512(x + b * kBlock, &q0, &q1, &scale, &isum)) {
      prep_block_i8(x, b, KB, offset, split, q, s, xsum, slane, corr);
      continue;
    }
    put_block_i8(b, q0, q1, scale, isum, offset, split, q, s, xsum, slane, corr);
  }
}
#endif

#if defined(__x86_64__) || defined(_M_X64)
// One block's int8 rounding in AVX2, as round_block_avx512's (the same operations on 8 lanes at a time; the
// block sum in block_stats' order). The int8 codes come from the int32 ones by packs and lane permutes: a nan
// lane (a zero x against an inf 127 / amax) is zeroed first, where the saturating packs would make its
// 0x80000000 -128 and the scalar cast makes it 0.
__attribute__((target("avx2,fma"))) inline bool round_block_avx2(const float* xb, __m128i* q0, __m128i* q1,
                                                                 float* scale, int32_t* isum) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 p8 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), v[2]), v[3]);
  const __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));
  const __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
  const float sum = _mm_cvtss_f32(_mm_add_ss(p2, _mm_shuffle_ps(p2, p2, 1)));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 amax8 = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for inf and nan
    amax8 = _mm256_max_ps(amax8, a);
  }
  if (finite != 0xFF || std::isnan(sum)) return false;
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));  // exact in any order
  if (amax == 0.0f) {
    *q0 = *q1 = _mm_setzero_si128();
    *scale = 0.0f;
    *isum = 0;
    return true;
  }
  *scale = amax / 127.0f;
  const __m256 inv = _mm256_set1_ps(127.0f / amax), magic = _mm256_set1_ps(12582912.0f);
  const __m256 lo127 = _mm256_set1_ps(-127.0f), hi127 = _mm256_set1_ps(127.0f);
  __m256i c[4];
  __m256i total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[i], inv), magic), magic);
    r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));  // nan -> 0
    c[i] = _mm256_cvttps_epi32(_mm256_min_ps(hi127, _mm256_max_ps(lo127, r)));
    total = _mm256_add_epi32(total, c[i]);
  }
  // int32 -> int16 -> int8 (the packs interleave 128-bit lanes; the permutes put the codes back in order)
  const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
  const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
  const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xD8);
  *q0 = _mm256_castsi256_si128(b);
  *q1 = _mm256_extracti128_si256(b, 1);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  *isum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
  return true;
}

// prep_row_i8 in AVX2 (the avx2_i8 path's 16-row kernel's x), as prep_row_i8_avx512: the same bits (the
// prep_quad op holds them to the portable ones in the tests). The portable form's clone had cost ~3x the
// AVX-512 one: ~8% of a 1B prompt's time on this path.
__attribute__((target("avx2,fma"))) void prep_row_i8_avx2(const float* x, int64_t KB, int64_t KBq, int offset,
                                                           bool split, int8_t* q, float* s, float* xsum,
                                                           float* slane, int32_t* corr) {
  for (int64_t b = 0; b < KBq; ++b) {
    __m128i q0, q1;
    float scale;
    int32_t isum;
    if (b >= KB || !round_block_avx2(x + b * kBlock, &q0, &q1, &scale, &isum)) {
      prep_block_i8(x, b, KB, offset, split, q, s, xsum, slane, corr);
      continue;
    }
    put_block_i8(b, q0, q1, scale, isum, offset, split, q, s, xsum, slane, corr);
  }
}
#endif

// The int8 scheme's rounding of x on a kernel path: the AVX-512 or AVX2 form where the path runs on one, else the
// portable one; all three give the same bits.
using PrepI8 = void (*)(const float*, int64_t, int64_t, int, bool, int8_t*, float*, float*, float*, int32_t*);
inline PrepI8 prep_i8_for(int64_t isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == kAvx512VnniI8) return prep_row_i8_avx512;
  if (isa == kAvx2I8) return prep_row_i8_avx2;
#endif
  return prep_row_i8;
}

// One row of x for the int8 panel GEMM (see XP): the same codes and scales as prep_row_i8 (`super`: as
// prep_row_i8k, each block's scale its super-block's d * 2^-e), by groups of gb blocks (16 on AVX-512, 8 on AVX2) with
// lane l = block l. `q` [G * gb * 32], `s` [2 * G * gb] (scales | block sums), `corr` [2 * G * gb]: -offset * the
// block's sum of codes (split formats: of each half, corr | corr1), or with `super` (AVX2's k-quants) for a split
// format each block's two half sums as an int16 pair (low: k 0..15) in corr.
SERVELM_PREP_CLONES void prep_row_panel(const float* x, int64_t KB, int64_t G, int64_t gb, int offset, bool split, bool super,
                    int8_t* q, float* s, int32_t* corr) {
  const int64_t kbg = G * gb;
  std::memset(q, 0, G * gb * kBlock);
  std::fill(s, s + 2 * kbg, 0.0f);
  std::fill(corr, corr + 2 * kbg, 0);
  int8_t sup[kSuper * kBlock];
  int32_t sums[kSuper];
  int e[kSuper];
  float d = 0.0f;
  for (int64_t b = 0; b < KB; ++b) {
    int8_t block[kBlock] = {0};
    const int8_t* code = block;
    if (super) {  // the block's scale d * 2^-e (exact)
      if (b % kSuper == 0) d = quant_super_i8(x + b * kBlock, sup, sums, e);
      code = sup + b % kSuper * kBlock;
      s[b] = d / static_cast<float>(1 << e[b % kSuper]);
      s[kbg + b] = s[b] * static_cast<float>(sums[b % kSuper]);
    } else {
      quant_block_i8(x + b * kBlock, block, &s[b], &s[kbg + b]);
    }
    put_panel(q, b, gb, code);
    int32_t lo = 0, hi = 0;
    for (int k = 0; k < 16; ++k) {
      lo += code[k];
      hi += code[16 + k];
    }
    if (split && super) {  // AVX2's split formats (panels_avx2.cpp micro_split): the half sums as an int16 pair
      corr[b] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                                     (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
    } else if (split) {
      corr[b] = -offset * lo;
      corr[kbg + b] = -offset * hi;
    } else {
      corr[b] = -offset * (lo + hi);
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
// prep_row_panel for AVX-512 VNNI's groups of 16 blocks (not `super`): the same codes, scales, sums and
// corrections (round_block_avx512; a block it declines takes prep_row_panel's own code). NOTE: compiled for the
// baseline ISA, prep_row_panel had taken ~10% of the default model's 480-token prefill (docs/measurements/
// quant-kernels.md); the prep_panel op holds the two to the same bits in the tests.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void prep_row_panel_avx512(
    const float* x, int64_t KB, int64_t G, int offset, bool split, int8_t* q, float* s, int32_t* corr) {
  constexpr int64_t gb = 16;
  const int64_t kbg = G * gb;
  std::memset(q, 0, G * gb * kBlock);
  std::fill(s, s + 2 * kbg, 0.0f);
  std::fill(corr, corr + 2 * kbg, 0);
  for (int64_t b = 0; b < KB; ++b) {
    const float* xb = x + b * kBlock;
    __m128i q0, q1;
    float scale;
    int32_t isum;
    if (!round_block_avx512(xb, &q0, &q1, &scale, &isum)) {  // codes 0: no corrections
      int8_t block[kBlock] = {0};
      quant_block_i8(xb, block, &s[b], &s[kbg + b]);
      put_panel(q, b, gb, block);
      continue;
    }
    s[b] = scale;  // (0 for a block of zeros, or one whose amax / 127 underflows, whose codes are not 0)
    s[kbg + b] = scale * static_cast<float>(isum);
    alignas(32) int8_t code[kBlock];
    _mm_store_si128(reinterpret_cast<__m128i*>(code), q0);
    _mm_store_si128(reinterpret_cast<__m128i*>(code + 16), q1);
    put_panel(q, b, gb, code);
    const int32_t lo = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q0));
    if (split) {
      corr[b] = -offset * lo;
      corr[kbg + b] = -offset * (isum - lo);
    } else {
      corr[b] = -offset * isum;
    }
  }
}
#endif

// One row of x for Q8_0's panel GEMM (q8_panel): prep_row's int16 codes and power-of-two scales (the decode
// kernel's), block b's k 2i, 2i + 1 at slice i (gb * 4 bytes), bytes 4l..4l+3 of its group of gb (l = b % gb;
// gb 8 on AVX2, 16 on AVX-512): `q` int16 [G * gb * 32], `s` [G * gb]. Zero past KB.
SERVELM_PREP_CLONES void prep_row_panel_i16(const float* x, int64_t KB, int64_t G, int64_t gb, int16_t* q, float* s) {
  thread_local std::vector<int16_t> natural;
  natural.resize(KB * kBlock);
  std::memset(q, 0, G * gb * kBlock * sizeof(int16_t));
  std::fill(s, s + G * gb, 0.0f);
  prep_row(x, KB, KB, kNatural, natural.data(), s, nullptr, nullptr);
  for (int64_t b = 0; b < KB; ++b) {
    int16_t* dst = q + (b / gb) * gb * kBlock + (b % gb) * 2;
    for (int i = 0; i < 16; ++i) std::memcpy(dst + i * gb * 2, natural.data() + b * kBlock + 2 * i, 4);
  }
}

// The weight view after checking the op's arguments.
QWeight checked(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m,
                const std::optional<at::Tensor>& qh, const std::optional<at::Tensor>& qh2,
                const std::optional<at::Tensor>& sc, int64_t fmt, const std::optional<at::Tensor>& bias,
                const float** bp) {
  TORCH_CHECK(x.device().is_cpu() && qs.device().is_cpu() && d.device().is_cpu(), "servelm_quant: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, KB*32]");
  TORCH_CHECK(fmt >= 0 && fmt < kNumFmts, "unknown format ", fmt);
  const Fmt f = static_cast<Fmt>(fmt);
  TORCH_CHECK(qs.dim() == 3, "qs: [N, KB, payload]");
  const int64_t N = qs.size(0), KB = qs.size(1);
  TORCH_CHECK(x.size(1) == KB * kBlock, "x has ", x.size(1), " columns, the weight ", KB * kBlock);
  TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1 && qs.size(2) == fmt_payload(f), "qs layout");
  const bool kq = fmt_kquant(f);
  TORCH_CHECK(!kq || KB % kSuper == 0, "k-quant weight: KB must be whole super-blocks");
  const int64_t scales = kq ? KB / kSuper : KB;  // d and m entries per row
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.dim() == 2 && d.size(0) == N &&
              d.size(1) == scales, "d layout");
  const auto present = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(present(m) == (fmt_has_min(f) || f == Q2_K), "m is given exactly for the formats with a minimum");
  if (present(m)) TORCH_CHECK(m->is_contiguous() && m->scalar_type() == at::kHalf && m->sizes() == d.sizes(), "m layout");
  const int planes = fmt_planes(f);
  const bool crumbs = fmt_crumbs(f);  // Q6_K: one field of crumbs, four words a quad
  TORCH_CHECK(present(qh) == (planes >= 1) && present(qh2) == (planes >= 2 && !crumbs),
              "qh/qh2 do not match the format");
  for (const auto* t : {&qh, &qh2})
    if (present(*t))
      TORCH_CHECK((*t)->is_contiguous() && (*t)->scalar_type() == at::kLong && (*t)->dim() == 2 &&
                  (*t)->size(0) == N && (*t)->size(1) == (KB + 3) / 4 * (crumbs ? 4 : 2),
                  crumbs ? "qh layout: int64 [N, 4 * ceil(KB / 4)]" : "qh layout: int64 [N, 2 * ceil(KB / 4)]");
  TORCH_CHECK(present(sc) == kq, "sc is given exactly for the k-quants");
  if (kq)
    TORCH_CHECK(sc->is_contiguous() && sc->element_size() == 1 && sc->dim() == 3 && sc->size(0) == N &&
                sc->size(1) == KB && sc->size(2) == fmt_sc_bytes(f), "sc layout");
  *bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
    *bp = bias->data_ptr<float>();
  }
  const auto words = [&](const std::optional<at::Tensor>& t) {
    return present(t) ? reinterpret_cast<const uint64_t*>(t->data_ptr()) : nullptr;
  };
  return QWeight{static_cast<const uint8_t*>(qs.data_ptr()), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                 present(m) ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr, words(qh), words(qh2),
                 kq ? static_cast<const uint8_t*>(sc->data_ptr()) : nullptr, N, KB, f};
}

// Q2_K's minimum term: value = (d * sc) * q - dmin * mn per 16 weights (sc, mn: the low and high nibbles of its
// scale bytes, w.sc); the kernel computed the first part (as Q3_K's arithmetic), this subtracts sum over the halves
// h of dmin * mn_h * (x's sum over h), each output still one fixed sequence of operations on its own rows
// (batch-invariant). x's sums are those of the codes the path rounded x to
// (as quant_block_i8's for the other formats' minimums, and llama.cpp's Q8_K sums): then a row's error is
// sum(w * e) (e: x's rounding), where x's own sums left sum(d * sc * q * e), q in 0..3 not centred: on the
// tiny Q2_K model of tests/models/test_quantized_layers.py the int8 scheme's logits were 4.3% off fp32's with
// x's own sums, 2.6% with the rounded ones (Q3_K_M's 2.8%).
enum class HalfSums { kRaw, kInt16, kInt8, kInt8Super };

// xs [M][2 KB]: x's sums over each 16 weights, of the values as `how` rounds them: kRaw x itself (the fp32 tiles),
// kInt16 prep_row's power-of-two codes, kInt8 quant_block_i8's, kInt8Super quant_super_i8's (super_x).
at::Tensor half_sums(const at::Tensor& x, int64_t KB, HalfSums how) {
  const int64_t M = x.size(0);
  at::Tensor out_t = at::empty({M, 2 * KB}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xs = out_t.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<int16_t> q16(how == HalfSums::kInt16 ? KB * kBlock : 0);
    std::vector<float> s16(how == HalfSums::kInt16 ? KB : 0);
    for (int64_t i = m0; i < m1; ++i) {
      const float* xr = xp + i * KB * kBlock;
      float* out = xs + i * 2 * KB;
      if (how == HalfSums::kRaw) {
        for (int64_t h = 0; h < 2 * KB; ++h) {
          float t = 0.0f;
          for (int j = 0; j < 16; ++j) t += xr[h * 16 + j];
          out[h] = t;
        }
      } else if (how == HalfSums::kInt16) {
        prep_row(xr, KB, KB, kNatural, q16.data(), s16.data(), nullptr, nullptr);
        for (int64_t h = 0; h < 2 * KB; ++h) {
          int32_t t = 0;
          for (int j = 0; j < 16; ++j) t += q16[h * 16 + j];
          out[h] = s16[h / 2] * static_cast<float>(t);
        }
      } else if (how == HalfSums::kInt8) {
        for (int64_t b = 0; b < KB; ++b) {
          int8_t code[kBlock] = {0};
          float scale, sum;
          quant_block_i8(xr + b * kBlock, code, &scale, &sum);
          int32_t lo = 0, hi = 0;
          for (int j = 0; j < 16; ++j) lo += code[j], hi += code[16 + j];
          out[2 * b] = scale * static_cast<float>(lo);
          out[2 * b + 1] = scale * static_cast<float>(hi);
        }
      } else {
        for (int64_t sb = 0; sb < KB / kSuper; ++sb) {
          int8_t code[kSuper * kBlock];
          int32_t sums[kSuper];
          int e[kSuper];
          const float d = quant_super_i8(xr + sb * kSuper * kBlock, code, sums, e);
          for (int j = 0; j < kSuper; ++j) {
            int32_t lo = 0, hi = 0;
            for (int k = 0; k < 16; ++k) lo += code[j * kBlock + k], hi += code[j * kBlock + 16 + k];
            const float step = d / static_cast<float>(1 << e[j]);  // a power of two: exact
            out[(sb * kSuper + j) * 2] = step * static_cast<float>(lo);
            out[(sb * kSuper + j) * 2 + 1] = step * static_cast<float>(hi);
          }
        }
      }
    }
  });
  return out_t;
}

// y[i, n] -= sum over super-blocks of (dmin * mn_h) . xs[i, h] for rows [n0, n1): 16 lanes (a super-block's
// halves), one fixed lane tree at the end. Tiles of NR weight rows x R rows of x: each (dmin * mn) vector serves
// R rows of x, and NR x R independent chains of fmas (one row and one chain had been bound by the fma latency,
// 70 cycles a weight row at K = 2,048). AVX-512 or AVX2 (two 8-lane halves) or portable, by the path's ISA.
#if defined(__x86_64__) || defined(_M_X64)
// (dmin * mn) of row n + j, super-block sb: from the weights, or (vt) from a table of them made once for many
// rows of x (then one load where it took four ops)
template <bool kTable>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 split_min_v(
    const uint8_t* sc, const float* dmin, const float* vt, int64_t KB, int64_t n, int j, int64_t sb) {
  const int64_t nsb = KB / kSuper;
  if constexpr (kTable) return _mm512_loadu_ps(vt + (j * nsb + sb) * 16);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                           reinterpret_cast<const __m128i*>(sc + ((n + j) * KB + sb * kSuper) * 2))), 4)),
                       _mm512_set1_ps(dmin[j * nsb + sb]));
}

template <int NR, int R, bool kTable>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void split_min_tile_avx512(
    const float* xs, const QWeight& w, const float* dmin, const float* vt, float* y, int64_t n,
    int64_t i0) {
  const int64_t KB = w.KB, nsb = KB / kSuper;
  __m512 acc[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb)
    for (int j = 0; j < NR; ++j) {
      const __m512 v = split_min_v<kTable>(w.sc, dmin, vt, KB, n, j, sb);
      for (int r = 0; r < R; ++r)
        acc[j][r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xs + (i0 + r) * 2 * KB + sb * 16), acc[j][r]);
    }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) y[(i0 + r) * w.N + n + j] -= _mm512_reduce_add_ps(acc[j][r]);
}

template <int NR, bool kTable>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void split_min_rows_avx512(
    const float* xs, int64_t M, const QWeight& w, float* y, int64_t n, float* dmin, float* vt) {
  const int64_t nsb = w.KB / kSuper;
  for (int j = 0; j < NR; ++j)
    for (int64_t sb = 0; sb < nsb; sb += 16) {  // the rows' dmin as fp32, 16 at a time (exact conversion)
      const __mmask16 k = static_cast<__mmask16>((1u << std::min<int64_t>(16, nsb - sb)) - 1u);
      _mm512_storeu_ps(dmin + j * nsb + sb, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, w.m + (n + j) * nsb + sb)));
    }
  if constexpr (kTable)
    for (int j = 0; j < NR; ++j)
      for (int64_t sb = 0; sb < nsb; ++sb)
        _mm512_storeu_ps(vt + (j * nsb + sb) * 16, split_min_v<false>(w.sc, dmin, vt, w.KB, n, j, sb));
  for (int64_t i = 0; i < M; i += 4) {
    switch (std::min<int64_t>(4, M - i)) {
      case 4: split_min_tile_avx512<NR, 4, kTable>(xs, w, dmin, vt, y, n, i); break;
      case 3: split_min_tile_avx512<NR, 3, kTable>(xs, w, dmin, vt, y, n, i); break;
      case 2: split_min_tile_avx512<NR, 2, kTable>(xs, w, dmin, vt, y, n, i); break;
      default: split_min_tile_avx512<NR, 1, kTable>(xs, w, dmin, vt, y, n, i); break;
    }
  }
}

void split_min_avx512(const float* xs, int64_t M, const QWeight& w, float* y, int64_t n0,
                      int64_t n1) {
  const int64_t nsb = w.KB / kSuper;
  thread_local std::vector<float> dmin, vt;
  dmin.resize(4 * nsb + 16);
  const bool table = M > 4;  // the (dmin * mn) vectors made once a weight row for more than one tile of x's rows
  if (table) vt.resize(4 * nsb * 16);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    table ? split_min_rows_avx512<4, true>(xs, M, w, y, n, dmin.data(), vt.data())
          : split_min_rows_avx512<4, false>(xs, M, w, y, n, dmin.data(), nullptr);
  for (; n < n1; ++n)
    table ? split_min_rows_avx512<1, true>(xs, M, w, y, n, dmin.data(), vt.data())
          : split_min_rows_avx512<1, false>(xs, M, w, y, n, dmin.data(), nullptr);
}

template <int NR, int R>
__attribute__((target("avx2,fma"))) inline void split_min_tile_avx2(const float* xs, const QWeight& w,
                                                                    const float* dmin,
                                                                    float* y, int64_t n, int64_t i0) {
  const int64_t KB = w.KB, nsb = KB / kSuper;
  __m256 a0[NR][R], a1[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) a0[j][r] = a1[j][r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb)
    for (int j = 0; j < NR; ++j) {
      const __m128i raw =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + ((n + j) * KB + sb * kSuper) * 2));
      const __m256 dm = _mm256_set1_ps(dmin[j * nsb + sb]);
      const __m256 v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(raw), 4)), dm);
      const __m256 v1 =
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8)), 4)), dm);
      for (int r = 0; r < R; ++r) {
        const float* xp = xs + (i0 + r) * 2 * KB + sb * 16;
        a0[j][r] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(xp), a0[j][r]);
        a1[j][r] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xp + 8), a1[j][r]);
      }
    }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) {
      const __m256 s8 = _mm256_add_ps(a0[j][r], a1[j][r]);
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      y[(i0 + r) * w.N + n + j] -= _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
}

template <int NR>
__attribute__((target("avx2,fma,f16c"))) void split_min_rows_avx2(const float* xs, int64_t M, const QWeight& w,
                                                                  float* y, int64_t n,
                                                                  float* dmin) {
  const int64_t nsb = w.KB / kSuper;
  for (int j = 0; j < NR; ++j) {
    int64_t sb = 0;
    for (; sb + 8 <= nsb; sb += 8)  // the rows' dmin as fp32 (F16C's exact conversion)
      _mm256_storeu_ps(dmin + j * nsb + sb, _mm256_cvtph_ps(_mm_loadu_si128(
                                                reinterpret_cast<const __m128i*>(w.m + (n + j) * nsb + sb))));
    for (; sb < nsb; ++sb) dmin[j * nsb + sb] = half_to_float(w.m[(n + j) * nsb + sb]);
  }
  for (int64_t i = 0; i < M; i += 2) {
    if (M - i >= 2) split_min_tile_avx2<NR, 2>(xs, w, dmin, y, n, i);
    else split_min_tile_avx2<NR, 1>(xs, w, dmin, y, n, i);
  }
}

void split_min_avx2(const float* xs, int64_t M, const QWeight& w, float* y, int64_t n0,
                    int64_t n1) {
  thread_local std::vector<float> dmin;
  dmin.resize(2 * (w.KB / kSuper) + 8);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) split_min_rows_avx2<2>(xs, M, w, y, n, dmin.data());
  for (; n < n1; ++n) split_min_rows_avx2<1>(xs, M, w, y, n, dmin.data());
}
#endif

void split_min_scalar(const float* xs, int64_t M, const QWeight& w, float* y, int64_t n0,
                      int64_t n1) {
  const int64_t KB = w.KB, nsb = KB / kSuper;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t i = 0; i < M; ++i) {
      float acc = 0.0f;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const float dm = half_to_float(w.m[n * nsb + sb]);
        float t = 0.0f;
        for (int h = 0; h < 16; ++h)
          t += (dm * static_cast<float>(w.sc[(n * KB + sb * kSuper) * 2 + h] >> 4)) * xs[i * 2 * KB + sb * 16 + h];
        acc += t;
      }
      y[i * w.N + n] -= acc;
    }
}

using SplitMinFn = void (*)(const float*, int64_t, const QWeight&, float*, int64_t, int64_t);
SplitMinFn split_min_for(int64_t isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (base_isa(isa) >= kAvx512) return split_min_avx512;
  if (base_isa(isa) == kAvx2) return split_min_avx2;
#endif
  return split_min_scalar;
}

// Scratch of the calling thread for x's prepared codes and scales (slot 0-2), reused call after call: `linear` had
// made three tensors a call (at::empty / at::zeros), ~360 a decode step of the default model; callgrind counted
// 10.6k instructions a call fewer without them (576 x 576 Q4_1 at M = 1: 253k -> 243k, one thread). 64-byte
// aligned, as at::empty's. Only `linear`'s own body uses a slot, and it returns before the next call on this
// thread.
template <typename T>
T* scratch(int slot, int64_t count) {
  thread_local std::vector<uint8_t> bufs[5];
  std::vector<uint8_t>& b = bufs[slot];
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T) + 64;
  if (b.size() < bytes) b.resize(bytes);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(b.data()) + 63) & ~uintptr_t{63});
}

// Whether the 16-row layout's matmuls of kAmxMinRows+ rows of x take AMX tiles (rows16_amx.cpp, the same bits as
// the AVX-512 VNNI kernel): by default where the CPU has them (-1: not decided yet); set_amx (quant.set_amx,
// SERVELM_QUANT_AMX) turns them off or on.
std::atomic<int> g_amx{-1};
constexpr int64_t kAmxMinRows = 12;

bool amx_on() {
  int v = g_amx.load(std::memory_order_relaxed);
  if (v < 0) {
    v = amx_usable();
    g_amx.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// mode 1: on (an error where the CPU has no AMX), 0: off, -1: the default again. Returns whether it is on.
bool set_amx(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "servelm_quant.set_amx: mode is -1, 0 or 1");
  TORCH_CHECK(mode != 1 || amx_usable(), "no AMX tiles here (they take a CPU with AMX-TILE and AMX-INT8, Linux 5.16+ and GCC 11+)");
  g_amx.store(static_cast<int>(mode), std::memory_order_relaxed);
  return amx_on();
}

// x @ W.T over weights interleaved by 16 rows (R16W; qs [G, KB, ...] 5-D): rows16_avx512_vnni.cpp (avx2_i8:
// rows16_avx2.cpp, the same bits) at every M, x rounded as the avx512_vnni_i8 path's `linear` rounds it (per
// block of 32, on avx2_i8 too, where the row kernel rounds the k-quants' x per 256; Q8_0: the int16 scheme).
// Q6_K's high bits come in qh.
at::Tensor linear_rows16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                         const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& qh,
                         const std::optional<at::Tensor>& qh2, const std::optional<at::Tensor>& sc, int64_t fmt,
                         const std::optional<at::Tensor>& bias, int64_t isa) {
  // the layout belongs to the int8 paths' kernels (Q8_0: their int16 scheme, as those paths' row kernels):
  // another path's scheme (the int16 one's codes of x for the nibble formats) is never computed silently on it
  TORCH_CHECK((isa == kAvx512VnniI8 || isa == kAvx2I8) && isa_available(isa, best_isa()),
              "servelm_quant: weights interleaved by 16 rows need the avx512_vnni_i8 or avx2_i8 path (isa ", isa, ")");
  const bool avx512 = isa == kAvx512VnniI8;
  TORCH_CHECK(fmt >= 0 && fmt < kNumFmts && rows16_format(static_cast<Fmt>(fmt)),
              "servelm_quant: format ", fmt, " has no 16-row layout");
  const Fmt f = static_cast<Fmt>(fmt);
  TORCH_CHECK(x.device().is_cpu() && qs.device().is_cpu() && d.device().is_cpu(), "servelm_quant: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, KB*32]");
  TORCH_CHECK(qs.dim() == 5 && qs.is_contiguous() && qs.element_size() == 1 && qs.size(3) == 16 &&
                  qs.size(2) * qs.size(4) == (f == Q8_0 ? 32 : 16),
              "qs layout: [G, KB, chunks, 16, bytes] (16-row groups)");
  const int64_t G = qs.size(0), KB = qs.size(1), N = G * 16, M = x.size(0), kp = KB * kBlock;
  TORCH_CHECK(x.size(1) == kp, "x has ", x.size(1), " columns, the weight ", kp);
  const bool kq = fmt_kquant(f);
  TORCH_CHECK(!kq || KB % kSuper == 0, "k-quant weight: KB must be whole super-blocks");
  const int64_t scales = G * (kq ? KB / kSuper : KB) * 16;
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.numel() == scales, "d layout");
  const auto present = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(present(m) == fmt_has_min(f), "m is given exactly for the formats with a minimum");
  if (present(m)) TORCH_CHECK(m->is_contiguous() && m->scalar_type() == at::kHalf && m->numel() == scales, "m layout");
  TORCH_CHECK(present(qh) == (fmt_planes(f) > 0) && !present(qh2), "qh is given exactly for Q5_0, Q5_1, Q5_K, Q6_K");
  if (present(qh))
    TORCH_CHECK(qh->is_contiguous() && qh->element_size() == 1 && qh->numel() == G * KB * (f == Q6_K ? 128 : 64),
                "qh layout: uint8 [G, KB, (2,) 16, 4]");
  TORCH_CHECK(present(sc) == kq, "sc is given exactly for the k-quants");
  if (present(sc)) TORCH_CHECK(sc->is_contiguous() && sc->element_size() == 1 && sc->numel() == G * KB * 32, "sc layout");
  const float* bp = nullptr;
  if (present(bias)) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N, "bias: fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if defined(__x86_64__) || defined(_M_X64)
  const float* xp = x.data_ptr<float>();
  R16X xv{};
  xv.M = M;
  if (f == Q8_0) {
    int16_t* qp = scratch<int16_t>(0, M * kp);
    float* sp = scratch<float>(1, M * KB);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i) prep_row(xp + i * kp, KB, KB, kNatural, qp + i * kp, sp + i * KB, nullptr, nullptr);
    });
    xv.q16 = qp;
    xv.qstride = kp;
    xv.s = sp;
    xv.ss = KB;
  } else {
    const int64_t KBq = (KB + 3) / 4 * 4, quads = KBq / 4;
    const int off = fmt_offset(f);
    const bool split = fmt_split(f);
    const int64_t sstride = KBq * 2 + quads * 16;  // s [KBq] | xsum [KBq] | lane scales (unused here)
    int8_t* qp = scratch<int8_t>(0, M * KBq * kBlock);
    float* sp = scratch<float>(1, M * sstride);
    int32_t* cp = off ? scratch<int32_t>(2, M * quads * 32) : nullptr;
    int32_t* ip = off ? scratch<int32_t>(3, M * KB * 2) : nullptr;
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i) {
        float* row = sp + i * sstride;
        int32_t* c = cp ? cp + i * quads * 32 : nullptr;
        prep_i8_for(isa)(xp + i * kp, KB, KBq, off, split, qp + i * KBq * kBlock, row, row + KBq, row + 2 * KBq, c);
        if (!c) continue;
        for (int64_t b = 0; b < KB; ++b) {  // the block's lanes of the corrections (prep_block_i8): its start
          const int32_t* cb = c + b / 4 * 32 + b % 4 * 4;
          ip[(i * KB + b) * 2] = cb[0] + cb[1] + cb[2] + cb[3];
          ip[(i * KB + b) * 2 + 1] = cb[16] + cb[17] + cb[18] + cb[19];
        }
      }
    });
    xv.q8 = qp;
    xv.qstride = KBq * kBlock;
    xv.s = sp;
    xv.xsum = sp + KBq;
    xv.ss = sstride;
    xv.init = ip;
  }
  R16W wv{static_cast<const uint8_t*>(qs.data_ptr()),
          reinterpret_cast<const uint16_t*>(d.data_ptr()),
          present(m) ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr,
          present(qh) ? static_cast<const uint8_t*>(qh->data_ptr()) : nullptr,
          present(sc) ? static_cast<const uint8_t*>(sc->data_ptr()) : nullptr, G, KB, f};
  float* yp = y.data_ptr<float>();
  if (avx512 && M >= kAmxMinRows && amx_format(f) && amx_on()) {
    // the AMX kernel's x: each block's 32 codes in natural order (the quad layout holds a block's elements 0..15
    // and 16..31 64 bytes apart), rows a cache line longer than their codes (rows16_amx.cpp)
    const int64_t xas = KB * kBlock + 64;
    int8_t* xa = scratch<int8_t>(4, M * xas);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i)
        for (int64_t b = 0; b < KB; ++b) {
          const int8_t* q = xv.q8 + i * xv.qstride + (b >> 2) * 128 + (b & 3) * 16;
          int8_t* o = xa + i * xas + b * kBlock;
          std::memcpy(o, q, 16);
          std::memcpy(o + 16, q + 64, 16);
        }
    });
    over_weight_rows(N, M, KB, [&](int64_t n0, int64_t n1) { rows16_gemm_amx(xv, xa, xas, wv, bp, yp, n0 / 16, n1 / 16); });
    return y;
  }
  const auto gemm = avx512 ? rows16_gemm : rows16_gemm_avx2;
  over_weight_rows(N, M, KB, [&](int64_t n0, int64_t n1) { gemm(xv, wv, bp, yp, n0 / 16, n1 / 16); });
#endif
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m,
                  const std::optional<at::Tensor>& qh, const std::optional<at::Tensor>& qh2,
                  const std::optional<at::Tensor>& sc, int64_t fmt, const std::optional<at::Tensor>& bias,
                  int64_t isa) {
  if (qs.dim() == 5) return linear_rows16(x, qs, d, m, qh, qh2, sc, fmt, bias, isa);
  const float* bp;
  const QWeight w = checked(x, qs, d, m, qh, qh2, sc, fmt, bias, &bp);
  const int64_t N = w.N, KB = w.KB, M = x.size(0), kp = KB * kBlock;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const GemmFn fn = gemm_for(isa);
  // Q2_K: the minimum term right after the kernel, on the same thread's rows (x's half sums: its own scratch)
  const bool split_min = w.fmt == Q2_K;
  const at::Tensor xs_t = split_min ? half_sums(x, KB, super_x(isa, w.fmt)    ? HalfSums::kInt8Super
                                                       : int8_for(isa, w.fmt) ? HalfSums::kInt8
                                                                              : HalfSums::kInt16)
                                    : at::Tensor();
  const float* xs = split_min ? xs_t.data_ptr<float>() : nullptr;
  const SplitMinFn minfn = split_min_for(isa);
  const auto over_rows = [&](auto&& gemm) {
    over_weight_rows(N, M, KB, [&](int64_t n0, int64_t n1) {
      if (split_min)  // the dmin of these rows into L2 while the kernel runs (the kernel does not read them)
        for (int64_t at = n0 * (KB / kSuper) * 2; at < n1 * (KB / kSuper) * 2; at += 64)
          prefetch_read<2>(reinterpret_cast<const uint8_t*>(w.m) + at);
      gemm(n0, n1);
      if (split_min) minfn(xs, M, w, y.data_ptr<float>(), n0, n1);
    });
  };
  const bool wide = base_isa(isa) >= kAvx512, has_m = fmt_has_min(w.fmt);
#if defined(__x86_64__) || defined(_M_X64)
  if (super_x(isa, w.fmt)) {  // the k-quants on AVX2: x rounded per super-block (see super_x)
    const int64_t ss = KB / kSuper;
    const float* xp = x.data_ptr<float>();
    int8_t* qp = scratch<int8_t>(0, M * KB * kBlock);
    float* sp = scratch<float>(1, M * ss);
    int16_t* bp16 = scratch<int16_t>(2, M * KB * 4);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i) prep_row_i8k(xp + i * kp, KB, qp + i * KB * kBlock, sp + i * ss, bp16 + i * KB * 4);
    });
    XQ xv{nullptr, sp, nullptr, nullptr, M, KB, ss};
    xv.q8 = qp;
    xv.sub = bp16;
    float* yp = y.data_ptr<float>();
    over_rows([&](int64_t n0, int64_t n1) { gemm_avx2_i8(xv, w, bp, yp, n0, n1); });
    return y;
  }
  if (int8_for(isa, w.fmt)) {  // the int8 scheme (q8_0 keeps int16: bandwidth-bound there)
    const int64_t KBq = (KB + 3) / 4 * 4, quads = KBq / 4;
    const int off = int8_offset(isa, w.fmt);
    // per row: s [KBq] | xsum [KBq] | lane scales [quads * 16] | padding read by the minimum term up to
    // 16-rounded KB
    const int64_t sstride = KBq * 2 + quads * 16 + 16;
    const float* xp = x.data_ptr<float>();
    int8_t* qp = scratch<int8_t>(0, M * KBq * kBlock);
    float* sp = scratch<float>(1, M * sstride);
    std::fill(sp, sp + M * sstride, 0.0f);  // the padding past KB reads as zeros
    int32_t* cp = off ? scratch<int32_t>(2, M * quads * 32) : nullptr;
    const bool split = fmt_split(w.fmt);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i) {
        float* row = sp + i * sstride;
        prep_i8_for(isa)(xp + i * kp, KB, KBq, off, split, qp + i * KBq * kBlock, row, row + KBq, row + 2 * KBq,
                         cp ? cp + i * quads * 32 : nullptr);
      }
    });
    XQ xv{nullptr, sp, sp + KBq, sp + 2 * KBq, M, KBq, sstride};
    xv.q8 = qp;
    xv.corr = cp;
    float* yp = y.data_ptr<float>();
    const GemmFn gi8 = isa == kAvx2I8 ? gemm_avx2_i8 : gemm_avx512_vnni_i8;
    over_rows([&](int64_t n0, int64_t n1) { gi8(xv, w, bp, yp, n0, n1); });
    return y;
  }
#endif
  const int64_t KBp = wide ? (KB + 1) / 2 * 2 : KB;
  const Layout layout = wide && fmt != Q8_0 ? kPairs : kNatural;
  const int64_t sstride = KBp * (has_m ? 2 : 1) + (layout == kPairs ? KBp * 8 : 0);
  const float* xp = x.data_ptr<float>();
  int16_t* qp = scratch<int16_t>(0, M * KBp * kBlock);
  float* sp = scratch<float>(1, M * sstride);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0; i < m1; ++i) {
      float* row = sp + i * sstride;
      prep_row(xp + i * kp, KB, KBp, layout, qp + i * KBp * kBlock, row, has_m ? row + KBp : nullptr,
               layout == kPairs ? row + KBp * (has_m ? 2 : 1) : nullptr);
    }
  });
  const XQ xv{qp, sp, has_m ? sp + KBp : nullptr, layout == kPairs ? sp + KBp * (has_m ? 2 : 1) : nullptr, M, KBp,
              sstride};
  float* yp = y.data_ptr<float>();
  over_rows([&](int64_t n0, int64_t n1) { fn(xv, w, bp, yp, n0, n1); });
  return y;
}

// Weight rows dequantised per tile of the fp32 tile kernels: L2-sized (the AVX-512 one has fixed 64-row tiles);
// never fewer tiles than ~4 per thread so the pool stays balanced. Numerics do not depend on it.
int64_t rows_per_tile(int64_t N, int64_t kp, int64_t isa) {
  if (base_isa(isa) >= kAvx512) return 64;
  int64_t nb = std::clamp<int64_t>((256 << 10) / (kp * 4), 12, 96) / 12 * 12;
  const int64_t per_thread = (N + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  return std::min(nb, std::max<int64_t>(12, (per_thread + 11) / 12 * 12));
}

at::Tensor linear_tiles_body(const at::Tensor& x, const QWeight& w, const float* bp, int64_t isa);

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& qh,
                        const std::optional<at::Tensor>& qh2, const std::optional<at::Tensor>& sc, int64_t fmt,
                        const std::optional<at::Tensor>& bias, int64_t isa) {
  if (qs.dim() == 5) return linear_rows16(x, qs, d, m, qh, qh2, sc, fmt, bias, isa);  // one kernel at every M
  const float* bp;
  const QWeight w = checked(x, qs, d, m, qh, qh2, sc, fmt, bias, &bp);
  at::Tensor y = linear_tiles_body(x, w, bp, isa);
  if (w.fmt == Q2_K && y.numel()) {  // the panel GEMM rounds x as the micro-kernel does; the fp32 tiles do not round it
    const HalfSums how = !panel_for(isa, w.fmt) ? HalfSums::kRaw
                         : super_x(isa, w.fmt) ? HalfSums::kInt8Super : HalfSums::kInt8;
    // The same tiles as the micro-kernel's minimum term (with the (dmin * mn) vectors made once a weight row
    // for all of x's rows): the panel's time 1.23-1.28x that of a Q3_K weight of the same shape at 128 x 8192 x
    // 2048 and 128 x 2048 x 8192, where an fp32 GEMM (addmm) over a (dmin * mn) matrix made per call took 1.35-1.37x.
    const int64_t M = x.size(0);
    const at::Tensor xs = half_sums(x, w.KB, how);
    const SplitMinFn minfn = split_min_for(isa);
    float* yp = y.data_ptr<float>();
    const float* xp = xs.data_ptr<float>();
    over_weight_rows(w.N, M, w.KB, [&](int64_t n0, int64_t n1) { minfn(xp, M, w, yp, n0, n1); });
  }
  return y;
}

at::Tensor linear_tiles_body(const at::Tensor& x, const QWeight& w, const float* bp, int64_t isa) {
  TORCH_CHECK(isa_available(isa, best_isa()), "servelm_quant: ISA level ", isa, " is not available here");
  const int64_t N = w.N, M = x.size(0), kp = w.KB * kBlock;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  TileGemmFn fn = tiles_gemm_scalar;
#if defined(__x86_64__) || defined(_M_X64)
  if (base_isa(isa) >= kAvx512) fn = tiles_gemm_avx512;
  else if (base_isa(isa) == kAvx2) fn = tiles_gemm_avx2;
#endif
#if defined(__x86_64__) || defined(_M_X64)
  if (q8_panel(isa, w.fmt, w.KB)) {  // Q8_0: the panel GEMM with int16 codes instead of fp32 tiles
    const bool wide = q8_panel_avx512(isa);
    const int64_t gb = wide ? 16 : 8;  // blocks per group: the int32 lanes of a vector
    const int64_t G = (w.KB + gb - 1) / gb, ss = G * gb;
    at::Tensor xq = at::empty({M, G * gb * kBlock}, x.options().dtype(at::kShort));
    at::Tensor xs = at::empty({M, ss}, x.options());
    const float* xp = x.data_ptr<float>();
    int16_t* qp = xq.data_ptr<int16_t>();
    float* sp = xs.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i)
        prep_row_panel_i16(xp + i * kp, w.KB, G, gb, qp + i * G * gb * kBlock, sp + i * ss);
    });
    const XP xv{reinterpret_cast<const int8_t*>(qp), sp, nullptr, M, G, ss};
    float* yp = y.data_ptr<float>();
    const auto fn = wide ? panels_avx512_vnni_i8 : panels_avx2_i8;
    share_rows(N, kPanelRows, 8, [&](int64_t n0, int64_t n1) { fn(xv, w, bp, yp, n0, n1); });
    return y;
  }
  if (panel_for(isa, w.fmt)) {  // the int8 scheme's panel GEMM instead of fp32 tiles
    const int64_t gb = isa == kAvx2I8 ? 8 : 16;  // blocks per group: the int32 lanes of a vector
    const int64_t G = (w.KB + gb - 1) / gb, ss = 2 * G * gb;
    at::Tensor xq = at::empty({M, G * gb * kBlock}, x.options().dtype(at::kChar));
    at::Tensor xs = at::empty({M, ss}, x.options());
    at::Tensor xc = at::empty({M, ss}, x.options().dtype(at::kInt));
    const float* xp = x.data_ptr<float>();
    int8_t* qp = xq.data_ptr<int8_t>();
    float* sp = xs.data_ptr<float>();
    int32_t* cp = xc.data_ptr<int32_t>();
    const int off = fmt_offset(w.fmt);
    const bool split = fmt_split(w.fmt), sup = super_x(isa, w.fmt);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i) {
        if (gb == 16 && !sup) {
          prep_row_panel_avx512(xp + i * kp, w.KB, G, off, split, qp + i * G * gb * kBlock, sp + i * ss,
                                cp + i * ss);
        } else {
          prep_row_panel(xp + i * kp, w.KB, G, gb, off, split, sup, qp + i * G * gb * kBlock, sp + i * ss,
                         cp + i * ss);
        }
      }
    });
    const XP xv{qp, sp, cp, M, G, ss};
    float* yp = y.data_ptr<float>();
    const auto fn = isa == kAvx2I8 ? panels_avx2_i8 : panels_avx512_vnni_i8;
    share_rows(N, kPanelRows, 8, [&](int64_t n0, int64_t n1) { fn(xv, w, bp, yp, n0, n1); });
    return y;
  }
#endif
  const int64_t nb = rows_per_tile(N, kp, isa);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  share_rows(N, nb, 8, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < nb * kp) buf.resize(nb * kp);
    fn(xp, M, w, bp, yp, n0, n1, buf.data(), nb);
  });
  return y;
}

}  // namespace

// For the fused decoder-layer op (fused_ops.cpp): the two entry points without the dispatcher.
at::Tensor linear_call(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& qh,
                       const std::optional<at::Tensor>& qh2, const std::optional<at::Tensor>& sc, int64_t fmt,
                       const std::optional<at::Tensor>& bias, int64_t isa, bool tiles) {
  return tiles ? linear_tiles(x, qs, d, m, qh, qh2, sc, fmt, bias, isa) : linear(x, qs, d, m, qh, qh2, sc, fmt, bias, isa);
}

void check_prep_args(const at::Tensor& x, bool vector, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % kBlock == 0,
              "servelm_quant: ", op, " takes a contiguous fp32 [M, KB * 32]");
  TORCH_CHECK(!vector || (best_isa() >= kAvx512 && __builtin_cpu_supports("avx512dq")),
              "servelm_quant: ", op, "'s vector form needs AVX-512 (F, BW, VL, DQ)");
}

// The panel GEMM's rounding of x, [M, KB * 32] fp32 -> (codes [M, G * 512] int8, scales and sums [M, 2 * G * 16],
// corrections [M, 2 * G * 16] int32), by prep_row_panel (`vector` false) or prep_row_panel_avx512 (true, on a
// CPU with AVX-512): for the tests, which hold the two to the same bits.
std::tuple<at::Tensor, at::Tensor, at::Tensor> prep_panel(const at::Tensor& x, int64_t offset, bool split,
                                                          bool vector) {
  check_prep_args(x, vector, "prep_panel");
  const int64_t M = x.size(0), KB = x.size(1) / kBlock, gb = 16, G = (KB + gb - 1) / gb;
  at::Tensor q = at::empty({M, G * gb * kBlock}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M, 2 * G * gb}, x.options());
  at::Tensor c = at::empty({M, 2 * G * gb}, x.options().dtype(at::kInt));
  for (int64_t i = 0; i < M; ++i) {
    const float* xi = x.data_ptr<float>() + i * KB * kBlock;
    int8_t* qi = q.data_ptr<int8_t>() + i * G * gb * kBlock;
    float* si = s.data_ptr<float>() + i * 2 * G * gb;
    int32_t* ci = c.data_ptr<int32_t>() + i * 2 * G * gb;
#if defined(__x86_64__) || defined(_M_X64)
    if (vector) {
      prep_row_panel_avx512(xi, KB, G, static_cast<int>(offset), split, qi, si, ci);
      continue;
    }
#endif
    prep_row_panel(xi, KB, G, gb, static_cast<int>(offset), split, false, qi, si, ci);
  }
  return {q, s, c};
}

// The decode kernel's rounding of x (the int8 scheme), [M, KB * 32] fp32 -> (codes [M, KBq * 32] int8, [M, 2 * KBq
// + KBq * 4] fp32: scales | sums | lane scales, corrections [M, KBq * 8] int32), by the form of kernel path `isa`
// (prep_i8_for: the AVX-512 form on avx512_vnni_i8, the AVX2 one on avx2_i8, else the portable one): for the
// tests, which hold them to the same bits.
std::tuple<at::Tensor, at::Tensor, at::Tensor> prep_quad(const at::Tensor& x, int64_t offset, bool split,
                                                         int64_t isa) {
  check_prep_args(x, false, "prep_quad");
  TORCH_CHECK(isa_available(isa, best_isa()), "servelm_quant: ISA level ", isa, " is not available here");
  const int64_t M = x.size(0), KB = x.size(1) / kBlock, KBq = (KB + 3) / 4 * 4;
  at::Tensor q = at::zeros({M, KBq * kBlock}, x.options().dtype(at::kChar));
  at::Tensor s = at::zeros({M, 2 * KBq + KBq * 4}, x.options());
  at::Tensor c = at::zeros({M, KBq * 8}, x.options().dtype(at::kInt));
  for (int64_t i = 0; i < M; ++i) {
    float* si = s.data_ptr<float>() + i * s.size(1);
    prep_i8_for(isa)(x.data_ptr<float>() + i * KB * kBlock, KB, KBq, static_cast<int>(offset), split,
         q.data_ptr<int8_t>() + i * KBq * kBlock, si, si + KBq, si + 2 * KBq, c.data_ptr<int32_t>() + i * KBq * 8);
  }
  return {q, s, c};
}

}  // namespace servelm_quant

TORCH_LIBRARY(servelm_quant, lib) {
  lib.def("prep_quad(Tensor x, int offset, bool split, int isa) -> (Tensor, Tensor, Tensor)",
          &servelm_quant::prep_quad);
  lib.def("prep_panel(Tensor x, int offset, bool split, bool vector) -> (Tensor, Tensor, Tensor)",
          &servelm_quant::prep_panel);
  lib.def("best_isa() -> int", &servelm_quant::best_isa);
  lib.def("set_amx(int mode) -> bool", &servelm_quant::set_amx);
  lib.def("amx_on() -> bool", &servelm_quant::amx_on);
  lib.def("linear(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? qh, Tensor? qh2, Tensor? sc, int fmt, Tensor? bias, "
          "int isa) -> Tensor",
          &servelm_quant::linear);
  lib.def("linear_tiles(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? qh, Tensor? qh2, Tensor? sc, int fmt, Tensor? bias, "
          "int isa) -> Tensor",
          &servelm_quant::linear_tiles);
}
