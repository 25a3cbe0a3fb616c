// AVX2 + FMA + F16C kernel of the scheme in quant_common.h: 8 lanes, one block at a time (vpmaddwd +
// vpaddd on the block's 32 int16 codes of x), NR x R micro-tiles as in the AVX-512 kernel; and the int8
// scheme (`micro_i8`, vpmaddubsw, a pair of blocks at a time).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace servelm_quant {
namespace avx2 {

constexpr int kNr = 2;
constexpr int kR = 3;

// Weights are streamed from memory once per decode step: prefetch the rows kAhead on (see quant_avx512.inc).
constexpr int64_t kAhead = 4 * kNr;
static inline void prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline void row_scales(const uint16_t* h, int64_t kb, int64_t padded, float* out) {
  int64_t c = 0;
  for (; c + 8 <= kb; c += 8)
    _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + c))));
  if (c < kb) {
    alignas(16) uint16_t tmp[8] = {0};
    std::memcpy(tmp, h + c, static_cast<size_t>(kb - c) * 2);
    _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp))));
    c += 8;
  }
  for (; c < padded; ++c) out[c] = 0.0f;
}

// One fp16 number over 8 lanes, converted by F16C: the same exact value as half_to_float, whose bit arithmetic,
// twice per super-block here, had taken a quarter of the Q4_K kernel's time at batch 1.
static inline __m256 splat_half(uint16_t h) {
  return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// fp32 block scales of one k-quant row (row_scales_ref's exact products), one super-block (8 blocks) a time.
template <Fmt F>
static inline void row_scales_k(const QWeight& w, int64_t n, float* s0, float* s1, int64_t padded) {
  const int64_t kb = w.KB, nsb = kb / kSuper;
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(w.sc + n * kb * Traits<F>::sc_bytes);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const __m256 dv = splat_half(w.d[n * nsb + sb]);
    if constexpr (Traits<F>::lut) {  // IQ4_XS: one int8 scale a block (s1 unused)
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + (n * kb + sb * kSuper)));
      _mm256_storeu_ps(s0 + sb * kSuper, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw))));
      continue;
    }
    const __m128i raw = scale_bytes<F>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + sb * kSuper)));
    float* a = s0 + sb * kSuper;
    float* b = s1 + sb * kSuper;
    if constexpr (Traits<F>::split) {
      const __m256i v = _mm256_cvtepi8_epi16(raw);
      _mm256_storeu_ps(a, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16))));
      _mm256_storeu_ps(b, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16))));
    } else {
      const __m256i v = _mm256_cvtepu8_epi16(raw);
      const __m256 mv = splat_half(w.m[n * nsb + sb]);
      _mm256_storeu_ps(a, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)))));
      _mm256_storeu_ps(b, _mm256_sub_ps(_mm256_setzero_ps(),
                                        _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 16)))));
    }
  }
  for (int64_t c = kb; c < padded; ++c) s0[c] = s1[c] = 0.0f;
}

// row_scales_ref's numbers for any format: the k-quants' derived scales, else the fp16 scales (and minimums).
template <Fmt F>
static inline void row_scales_of(const QWeight& w, int64_t n, float* s0, float* s1, int64_t padded) {
  if constexpr (Traits<F>::kquant) {
    row_scales_k<F>(w, n, s0, s1, padded);
  } else {
    row_scales(w.d + n * w.KB, w.KB, padded, s0);
    if constexpr (Traits<F>::has_min) row_scales(w.m + n * w.KB, w.KB, padded, s1);
  }
}

// The row's dot product from its lanes `acc` plus the minimum term, sum over blocks of m * x's block sum: whole
// groups of eight blocks folded into the lanes, one horizontal sum, then the last kb % 8 one by one (a copy of
// them into a zeroed buffer, two memcpy calls a row, had taken ~15% of the decode kernel at K = 576).
static inline float with_min_term(__m256 acc, const float* mrow, const float* xsum, int64_t kb) {
  int64_t c = 0;
  for (; c + 8 <= kb; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mrow + c), _mm256_loadu_ps(xsum + c), acc);
  float v = hsum8(acc);
  for (; c < kb; ++c) v = std::fma(mrow[c], xsum[c], v);
  return v;
}

// with_min_term with the minimums read in place as fp16 (F16C: the same values, the same sequence of fmas).
static inline float with_min_term_h(__m256 acc, const uint16_t* m, const float* xsum, int64_t kb) {
  int64_t c = 0;
  for (; c + 8 <= kb; c += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + c))),
                          _mm256_loadu_ps(xsum + c), acc);
  float v = hsum8(acc);
  for (; c < kb; ++c) v = std::fma(_cvtsh_ss(m[c]), xsum[c], v);
  return v;
}

// 16 bits -> 16 words: `value` where the bit is set, else 0.
static inline __m256i plane_bits(uint32_t bits16, __m256i value) {
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        static_cast<int16_t>(0x8000));
  const __m256i v = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits16)), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi16(v, bit), value);
}

template <Fmt F, int NR, int R>
static void micro(const XQ& x, const QWeight& w, int64_t n, int64_t i0, const float* dn, const float* mn, int64_t ld,
                  const float* bias, float* y) {
  const int64_t kb = w.KB;
  __m256 acc[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi16(0x0f);
  const __m256i offset = _mm256_set1_epi16(Traits<F>::offset);
  for (int64_t b = 0; b < kb; ++b) {
    __m256i wa[NR], wb[NR];  // k 0..15 and 16..31 of block b as words
    for (int j = 0; j < NR; ++j) {
      if (n + j + kAhead < w.N) prefetch(w.qs + ((n + j + kAhead) * kb + b) * Traits<F>::payload);
      if constexpr (F == Q8_0) {
        const uint8_t* p = w.qs + ((n + j) * kb + b) * 32;
        wa[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        wb[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      } else {
        const __m128i raw =
            Traits<F>::crumb_codes ? crumb_nibbles(code_crumbs(w, n + j), b, Traits<F>::crumb_base)
                                   : _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + ((n + j) * kb + b) * 16));
        if constexpr (Traits<F>::lut) {  // IQ4_NL, IQ4_XS: the nibbles' signed values (kIq4Values), no offset
          const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)), m = _mm_set1_epi8(0x0f);
          wa[j] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(raw, m)));
          wb[j] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(raw, 4), m)));
          continue;
        }
        const __m256i v = _mm256_cvtepu8_epi16(raw);
        wa[j] = _mm256_and_si256(v, low4);
        wb[j] = _mm256_srli_epi16(v, 4);
        for (int p = 0; p < Traits<F>::planes; ++p) {  // plane bits 0..15 go to wa's words, 16..31 to wb's
          const uint32_t h = block_plane(w, p, n + j, b);
          const __m256i v = _mm256_set1_epi16(p ? 32 : Traits<F>::plane_value);
          wa[j] = _mm256_or_si256(wa[j], plane_bits(h & 0xFFFFu, v));
          wb[j] = _mm256_or_si256(wb[j], plane_bits(h >> 16, v));
        }
        if constexpr (Traits<F>::offset != 0) {
          wa[j] = _mm256_sub_epi16(wa[j], offset);
          wb[j] = _mm256_sub_epi16(wb[j], offset);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int16_t* xr = x.q + ((i0 + r) * x.KBp + b) * kBlock;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16));
      const __m256 sv = _mm256_set1_ps(x.s[(i0 + r) * x.ss + b]);
      for (int j = 0; j < NR; ++j) {
        if constexpr (Traits<F>::split) {  // k 0..15 and 16..31 have their own scales (dn, mn)
          const __m256 ia = _mm256_cvtepi32_ps(_mm256_madd_epi16(wa[j], xa));
          const __m256 ib = _mm256_cvtepi32_ps(_mm256_madd_epi16(wb[j], xb));
          acc[j][r] = _mm256_fmadd_ps(_mm256_mul_ps(ia, sv), _mm256_set1_ps(dn[j * ld + b]), acc[j][r]);
          acc[j][r] = _mm256_fmadd_ps(_mm256_mul_ps(ib, sv), _mm256_set1_ps(mn[j * ld + b]), acc[j][r]);
        } else {
          const __m256i iv = _mm256_add_epi32(_mm256_madd_epi16(wa[j], xa), _mm256_madd_epi16(wb[j], xb));
          acc[j][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(iv), sv), _mm256_set1_ps(dn[j * ld + b]),
                                      acc[j][r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) {
      float v;
      if constexpr (Traits<F>::has_min) v = with_min_term(acc[j][r], mn + j * ld, x.xsum + (i0 + r) * x.ss, kb);
      else v = hsum8(acc[j][r]);
      y[(i0 + r) * w.N + n + j] = bias ? v + bias[n + j] : v;
    }
}

// The int8 scheme on AVX2 (the nibble formats): x's quad layout (quant_ops' prep_row_i8) read a pair of blocks
// (b, b + 1) at a time, 32 bytes of nibbles per weight row: the low nibbles are [b k 0..15, b+1 k 0..15], the
// high ones the same blocks' k 16..31, as the first (b % 4 == 0) or second half of the quad's x. vpmaddubsw
// multiplies the unsigned codes with x's int8 codes into int16 pairs (|sum| <= 2 * 63 * 127: no saturation),
// the low and high halves are added (one scale per block; the split Q6_K keeps them apart) and vpmaddwd with
// ones gives 8 exact int32 lanes of 8 products, lane l in block b + l / 4, started from x's offset correction;
// then each lane is scaled by (weight scale * x scale) of its block, as the AVX-512 int8 kernel does.
// The lookup formats (IQ4_NL, IQ4_XS) take their table's signed values (one vpshufb), as llama.cpp's iq4_nl dot
// product does: vpmaddubsw of |value| with x's codes signed by the value (vpsignb), each half widened on its own
// (a pair sum reaches 2 x 127 x 127), no offset correction; the unsigned codes + 128 (up to 241) would have
// saturated the pair sums, which had kept them on the int16 scheme at ~1.7x the int8 kernel's time.
// 32 bits of a plane -> 32 bytes: `value` where the bit is set, else 0.
static inline __m256i plane_bytes(uint32_t bits, __m256i value) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                          3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), value);
}

template <Fmt F, int NR, int R>
static void micro_i8(const XQ& x, const QWeight& w, int64_t n, int64_t i0, const float* dn, const float* mn,
                     int64_t ld, const float* bias, float* y) {
  static_assert(Traits<F>::nibbles, "the int8 scheme reads nibble formats");
  const int64_t kb = w.KB, kp = plane_stride(w);
  __m256 acc[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i iq4 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
  const int8_t* xq[R];
  const float* xs[R];
  const int32_t* xc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q8 + (i0 + r) * x.KBp * kBlock;
    xs[r] = x.spair + (i0 + r) * x.ss;
    xc[r] = x.corr ? x.corr + (i0 + r) * (x.KBp / 4) * 32 : nullptr;
  }
  const bool ahead = n + NR - 1 + kAhead < w.N;
  // The 32-weight formats read their fp16 scales (and minimums) in place, a pair of blocks at a time, as the
  // AVX-512 kernel does: the driver's fp32 copy of them, made per micro-tile, had taken a third of the kernel's
  // time at the default model's K = 576. The same exact conversion (F16C), so the same bits.
  constexpr bool direct = !Traits<F>::kquant;
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const auto half_pair = [&](const uint16_t* p, bool both) {  // [p[0] x4, p[1] x4] (p[1] = 0 unless both)
    const int32_t bits = both ? static_cast<int32_t>(p[0] | static_cast<uint32_t>(p[1]) << 16) : p[0];
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(bits))), spread);
  };
  // The tile's rows are consecutive: base pointers per row and constant strides, the row's last block peeled
  // when KB is odd (per-row index arithmetic in the loop spilled the general registers, as on AVX-512).
  const int64_t qstride = kb * Traits<F>::payload;
  const uint8_t* qj[NR];
  const uint64_t* hj[2][NR];
  for (int j = 0; j < NR; ++j) {
    qj[j] = w.qs + (n + j) * qstride;
    hj[0][j] = Traits<F>::planes >= 1 ? w.qh + (n + j) * kp : nullptr;
    hj[1][j] = Traits<F>::planes >= 2 && !Traits<F>::crumbs ? w.qh2 + (n + j) * kp : nullptr;
  }
  // Pair (b, b + 1) in half `half_c` of quad b / 4 of x's layout: the half a compile-time constant and the quad
  // loop below unrolled by it, so that the x offsets are constants off one base per quad (computing the pair's
  // place in the quad from b had been half of the loop's instructions, all scalar).
  const auto pair = [&](int64_t b, auto whole_c, auto half_c) {
    constexpr bool whole = decltype(whole_c)::value;
    constexpr int64_t half = decltype(half_c)::value;
    const int64_t quad = b / 4;
    const int64_t qo = quad * 4 * kBlock + half * 32, so = quad * 16 + half * 8, co = quad * 32 + half * 8;
#pragma GCC unroll 2
    for (int j = 0; j < NR; ++j) {
      const uint8_t* p = qj[j] + b * Traits<F>::payload;
      if (ahead) prefetch(p + kAhead * qstride);
      __m256i lo, hi;
      if constexpr (Traits<F>::crumb_codes) {  // Q2_K, Q3_K (whole quads): the quad's 32 crumb bytes
        crumb_codes_pair<half>(qj[j] + quad * 32, Traits<F>::crumb_base, lo, hi);
      } else {
        const __m256i raw = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        lo = _mm256_and_si256(raw, low4);
        hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
      if constexpr (Traits<F>::lut) {  // the table's signed values (kIq4Values), as |value| with its sign apart
        lo = _mm256_shuffle_epi8(iq4, lo);
        hi = _mm256_shuffle_epi8(iq4, hi);
      } else if constexpr (Traits<F>::crumbs) {  // the quad's 32 crumb bytes at word 4 * quad
        add_crumbs_pair<half>(reinterpret_cast<const uint8_t*>(hj[0][j] + quad * 4), lo, hi);
      } else for (int pl = 0; pl < Traits<F>::planes; ++pl) {
        const uint64_t* q = hj[pl][j] + quad * 2;
        const __m256i v = _mm256_set1_epi8(pl ? 32 : Traits<F>::plane_value);
        lo = _mm256_or_si256(lo, plane_bytes(static_cast<uint32_t>(q[0] >> (32 * half)), v));
        hi = _mm256_or_si256(hi, plane_bytes(static_cast<uint32_t>(q[1] >> (32 * half)), v));
      }
      __m256 ws;
      if constexpr (direct) {
        ws = half_pair(w.d + (n + j) * kb + b, whole);
      } else {
        const float* d = dn + j * ld + b;
        ws = _mm256_blend_ps(_mm256_set1_ps(d[0]), _mm256_set1_ps(d[1]), 0xF0);
      }
      __m256 ws1 = ws;
      if constexpr (Traits<F>::split) {
        const float* d1 = mn + j * ld + b;
        ws1 = _mm256_blend_ps(_mm256_set1_ps(d1[0]), _mm256_set1_ps(d1[1]), 0xF0);
      }
      const __m256i alo = Traits<F>::lut ? _mm256_abs_epi8(lo) : lo, ahi = Traits<F>::lut ? _mm256_abs_epi8(hi) : hi;
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq[r] + qo;
        const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
        const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 64));
        const __m256 sv = _mm256_loadu_ps(xs[r] + so);
        if constexpr (Traits<F>::lut) {  // |w| x (x signed by w); each pair sum <= 2 x 127 x 127, widened apart
          const __m256i pa = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(xlo, lo));
          const __m256i pb = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(xhi, hi));
          const __m256i iv = _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones));
          acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(ws, sv), acc[j][r]);
          continue;
        }
        const int32_t* c = Traits<F>::offset ? xc[r] + co : nullptr;
        const __m256i pa = _mm256_maddubs_epi16(lo, xlo), pb = _mm256_maddubs_epi16(hi, xhi);
        if constexpr (Traits<F>::split) {
          __m256i ia = _mm256_madd_epi16(pa, ones), ib = _mm256_madd_epi16(pb, ones);
          ia = _mm256_add_epi32(ia, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
          ib = _mm256_add_epi32(ib, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 16)));
          const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), ws1, _mm256_mul_ps(_mm256_cvtepi32_ps(ia), ws));
          acc[j][r] = _mm256_fmadd_ps(t, sv, acc[j][r]);  // (ia * ws + ib * ws1) * x's scale
        } else {
          __m256i iv = _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones);
          if constexpr (Traits<F>::offset != 0)
            iv = _mm256_add_epi32(iv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
          acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(ws, sv), acc[j][r]);
        }
      }
    }
  };
  using H0 = std::integral_constant<int64_t, 0>;
  using H1 = std::integral_constant<int64_t, 1>;
  const int64_t k4 = kb / 4 * 4;
  for (int64_t b = 0; b < k4; b += 4) {
    pair(b, std::true_type{}, H0{});
    pair(b + 2, std::true_type{}, H1{});
  }
  if (k4 + 2 <= kb) pair(k4, std::true_type{}, H0{});  // the row's last 1-3 blocks
  if (k4 + 2 < kb) pair(k4 + 2, std::false_type{}, H1{});
  else if (k4 + 1 == kb) pair(k4, std::false_type{}, H0{});
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) {
      float v;
      if constexpr (Traits<F>::has_min) {
        const float* xsum = x.xsum + (i0 + r) * x.ss;
        v = direct ? with_min_term_h(acc[j][r], w.m + (n + j) * kb, xsum, kb)
                   : with_min_term(acc[j][r], mn + j * ld, xsum, kb);
      } else {
        v = hsum8(acc[j][r]);
      }
      y[(i0 + r) * w.N + n + j] = bias ? v + bias[n + j] : v;
    }
}

// The k-quants (Q3_K, Q4_K, Q5_K, Q6_K) with x rounded per super-block of 256 and power-of-two sub-scales per block
// (quant_ops' prep_row_i8k, kSubShift), one weight row and R rows of x. A pair of blocks is decoded as in
// micro_i8 and multiplied by vpmaddubsw; its int16 pair sums are multiplied by vpmaddwd with the blocks' integer
// scales times x's multipliers 2^(kSubShift - e_j) (vpmullw once per super-block and row of x; Q4_K, Q5_K: the
// 6-bit scale, the two halves added first; Q3_K, Q6_K: each half's int8 scale) into int32 lanes, over the
// super-block's four pairs. Per super-block and row of x, also in integers: the offset (Q6_K: -32 * the sum of
// scaled scale * x's half-block sums of codes) and the minimum term's sum of scaled min * x's block sums (one
// vpmaddwd each); then one conversion and one fma by d * x's d_fine (and one by dmin * x's d_fine), where one x
// scale per block had cost a convert, a multiply and an fma per pair of blocks. llama.cpp's q4_K / q6_K x q8_K
// dot products sum the same way. Bounds (the weights' codes < 64, x's |codes| <= 127, multipliers <= 64): the
// scaled scales fit int16 (63 * 64, 128 * 64); a lane takes 8 products of a pair sum and a scaled scale per
// super-block: Q4_K / Q5_K < 8 * 4 * 31 * 127 * 4,032 < 2^29; Q6_K < 8 * 2 * 63 * 127 * 8,192 < 2^30, and its
// offset < 32 * 2 * 8,192 * 16 * 127 < 2^31 - 2^30 (Q3_K: codes < 8, |scales| <= 32, far below both): int32
// holds them. Above 2^24 a lane's conversion rounds, once per 256 weights.
template <Fmt F, int R>
static void micro_i8k(const XQ& x, const QWeight& w, int64_t n, int64_t i0, const float* bias, float* y) {
  static_assert(Traits<F>::kquant && !Traits<F>::lut, "the k-quants with 6-bit or int8 scales");
  constexpr int kOffsetShift = Traits<F>::offset == 32 ? 5 : 2;  // the split formats' offsets, powers of two
  static_assert(!Traits<F>::split || Traits<F>::offset == 1 << kOffsetShift, "split formats: offset 32 or 4");
  const int64_t kb = w.KB, nsb = kb / kSuper, qstride = kb * Traits<F>::payload;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), lo16 = _mm256_set1_epi32(0xFFFF);
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int8_t* xq[R];
  const float* xd[R];
  const int16_t* xsub[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q8 + (i0 + r) * kb * kBlock;
    xd[r] = x.s + (i0 + r) * x.ss;
    xsub[r] = x.sub + (i0 + r) * kb * 4;
  }
  const uint8_t* q = w.qs + n * qstride;
  const uint64_t* h = Traits<F>::planes ? w.qh + n * plane_stride(w) : nullptr;
  const uint8_t* sc = w.sc + n * kb * 2;
  const bool ahead = n + kAhead < w.N;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    // the super-block's 8 scale-byte pairs as int16 pairs per int32 lane j (block j): (s, s) for vpmaddwd
    const __m128i raw = scale_bytes<F>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + sb * 16)));
    const __m256i v = Traits<F>::split ? _mm256_cvtepi8_epi16(raw) : _mm256_cvtepu8_epi16(raw);  // (s0, min | s1)
    const __m256i s0 = _mm256_or_si256(_mm256_and_si256(v, lo16), _mm256_slli_epi32(v, 16));
    const __m256i s1 = _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_and_si256(v, hi16));  // (min | s1) x2
    __m256i isum[R], xs0[R], xs1[R], bs[R];
    for (int r = 0; r < R; ++r) {
      const int16_t* u = xsub[r] + sb * 32;
      bs[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u));
      const __m256i mul = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 16));
      xs0[r] = _mm256_mullo_epi16(s0, mul);
      xs1[r] = _mm256_mullo_epi16(s1, mul);
      // the offset (Q6_K 32, Q3_K 4): -offset * (s0 * x's sum of k 0..15 + s1 * that of k 16..31)
      isum[r] = Traits<F>::split
                    ? _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(
                                                                   _mm256_mullo_epi16(v, mul), bs[r]), kOffsetShift))
                    : _mm256_setzero_si256();
    }
    const auto pair = [&](auto p_c) {
      constexpr int p = decltype(p_c)::value, half = p % 2;
      const int64_t b = sb * kSuper + 2 * p, quad = b / 4;
      const uint8_t* pq = q + b * Traits<F>::payload;
      if (ahead) prefetch(pq + kAhead * qstride);
      __m256i lo, hi;
      if constexpr (Traits<F>::crumb_codes) {  // Q2_K, Q3_K: the quad's 32 crumb bytes
        crumb_codes_pair<half>(q + quad * 32, Traits<F>::crumb_base, lo, hi);
      } else {
        const __m256i rawq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pq));
        lo = _mm256_and_si256(rawq, low4);
        hi = _mm256_and_si256(_mm256_srli_epi16(rawq, 4), low4);
      }
      if constexpr (Traits<F>::crumbs) {
        add_crumbs_pair<half>(reinterpret_cast<const uint8_t*>(h + quad * 4), lo, hi);
      } else if constexpr (Traits<F>::planes == 1) {
        const __m256i sixteen = _mm256_set1_epi8(Traits<F>::plane_value);
        lo = _mm256_or_si256(lo, plane_bytes(static_cast<uint32_t>(h[quad * 2] >> (32 * half)), sixteen));
        hi = _mm256_or_si256(hi, plane_bytes(static_cast<uint32_t>(h[quad * 2 + 1] >> (32 * half)), sixteen));
      }
      const __m256i idx = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq[r] + quad * 4 * kBlock + half * 32;
        const __m256i pa = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)));
        const __m256i pb = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 64)));
        const __m256i ps0 = _mm256_permutevar8x32_epi32(xs0[r], idx);
        if constexpr (Traits<F>::split) {
          const __m256i ps1 = _mm256_permutevar8x32_epi32(xs1[r], idx);
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(pa, ps0), _mm256_madd_epi16(pb, ps1)));
        } else {
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ps0));
        }
      }
    };
    pair(std::integral_constant<int, 0>{});
    pair(std::integral_constant<int, 1>{});
    pair(std::integral_constant<int, 2>{});
    pair(std::integral_constant<int, 3>{});
    const float dw = _cvtsh_ss(w.d[n * nsb + sb]);
    const float dm = Traits<F>::has_min ? _cvtsh_ss(w.m[n * nsb + sb]) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const float dx = xd[r][sb];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(dw * dx), acc[r]);
      if constexpr (Traits<F>::has_min)  // - dmin * x's d_fine * sum of scaled min * (x's block sums of codes)
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(xs1[r], bs[r])), _mm256_set1_ps(dm * dx),
                                  acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float v = hsum8(acc[r]);
    y[(i0 + r) * w.N + n] = bias ? v + bias[n] : v;
  }
}

template <Fmt F, int NR, bool I8 = false>
static void rows(int r, const XQ& x, const QWeight& w, int64_t n, int64_t i0, const float* dn, const float* mn,
                 int64_t ld, const float* bias, float* y) {
  if constexpr (I8 && Traits<F>::nibbles) {
    switch (r) {
      case 1: micro_i8<F, NR, 1>(x, w, n, i0, dn, mn, ld, bias, y); break;
      case 2: micro_i8<F, NR, 2>(x, w, n, i0, dn, mn, ld, bias, y); break;
      default: micro_i8<F, NR, 3>(x, w, n, i0, dn, mn, ld, bias, y); break;
    }
    return;
  }
  switch (r) {
    case 1: micro<F, NR, 1>(x, w, n, i0, dn, mn, ld, bias, y); break;
    case 2: micro<F, NR, 2>(x, w, n, i0, dn, mn, ld, bias, y); break;
    default: micro<F, NR, 3>(x, w, n, i0, dn, mn, ld, bias, y); break;
  }
}

template <Fmt F, bool I8 = false>
static void gemm(const XQ& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1) {
  if constexpr (I8 && Traits<F>::kquant && !Traits<F>::lut) {  // x per super-block (x.sub): micro_i8k
    for (int64_t n = n0; n < n1; ++n) {  // one weight row at a time (its registers hold R rows of x's sums)
      if (n + kAhead < w.N) prefetch_fields<F>(w, n + kAhead, 1);
      for (int64_t i0 = 0; i0 < x.M; i0 += kR) {
        switch (std::min<int64_t>(kR, x.M - i0)) {
          case 1: micro_i8k<F, 1>(x, w, n, i0, bias, y); break;
          case 2: micro_i8k<F, 2>(x, w, n, i0, bias, y); break;
          default: micro_i8k<F, 3>(x, w, n, i0, bias, y); break;
        }
      }
    }
    return;
  }
  const int64_t ld = (w.KB + 7) / 8 * 8;
  thread_local std::vector<float> buf;
  buf.assign(2 * kNr * ld, 0.0f);
  float* dn = buf.data();
  float* mn = dn + kNr * ld;
  const bool streamed = stream_rows(x, w.KB);  // one weight row at a time: see stream_rows
  for (int64_t n = n0; n < n1; n += kNr) {
    const int nr = static_cast<int>(std::min<int64_t>(kNr, n1 - n));
    if (n + kAhead < w.N) prefetch_fields<F>(w, n + kAhead, std::min<int64_t>(kNr, w.N - n - kAhead));
    // the int8 micro-kernel of a 32-weight nibble format reads the fp16 scales itself (micro_i8)
    constexpr bool scales_in_place = I8 && Traits<F>::nibbles && !Traits<F>::kquant;
    for (int j = 0; j < (scales_in_place ? 0 : nr); ++j) row_scales_of<F>(w, n + j, dn + j * ld, mn + j * ld, ld);
    const bool tile = nr == kNr && !streamed;
    for (int64_t i0 = 0; i0 < x.M; i0 += kR) {
      const int r = static_cast<int>(std::min<int64_t>(kR, x.M - i0));
      if (tile) {
        rows<F, kNr, I8>(r, x, w, n, i0, dn, mn, ld, bias, y);
      } else {
        for (int j = 0; j < nr; ++j) rows<F, 1, I8>(r, x, w, n + j, i0, dn + j * ld, mn + j * ld, ld, bias, y);
      }
    }
  }
}

}  // namespace avx2

void gemm_avx2(const XQ& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1) {
  dispatch_fmt(w.fmt, [&](auto f) { avx2::gemm<decltype(f)::value>(x, w, bias, y, n0, n1); });
}

void row_scales_avx2(const QWeight& w, int64_t n, float* s0, float* s1, int64_t padded) {
  dispatch_fmt(w.fmt, [&](auto f) { avx2::row_scales_of<decltype(f)::value>(w, n, s0, s1, padded); });
}

void gemm_avx2_i8(const XQ& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1) {
  dispatch_fmt(w.fmt, [&](auto f) { avx2::gemm<decltype(f)::value, true>(x, w, bias, y, n0, n1); });
}

}  // namespace servelm_quant

#pragma GCC pop_options
