// Shared by the per-ISA kernel files: the weight view, the prepared activations, fp16 scales, the entry points.
//
// The scheme (llama.cpp's, with 16-bit activations): each row of x is quantised per block of 32 to int16 with
// a power-of-two scale s (|x| / s <= 32767, rounded to nearest even); a block's dot product with the weight's
// integer codes is exact int32 arithmetic (vpdpwssd / vpmaddwd; the SIMD paths' lanes stay below 2^24, so their
// conversion to fp32 is exact too, the scalar path's whole-block sum may round); it is scaled by s (a power of two)
// and the weight's scale (fp16 d, or the k-quants' d * sc, an exact fp32 product), and added to fp32 lane
// accumulators in block order; the lanes are summed in one fixed tree, then the minimum term of q4_1, q5_1,
// Q4_K and Q5_K (sum over blocks of m * the fp32 sum of x's block) and the bias.
// Every output element is therefore one fixed sequence of operations on its own row of x and of W, whatever
// M is, however rows are grouped into micro-tiles and however threads split N: batch-invariant.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "prefetch.h"

namespace servelm_quant {

// The block formats (servelm.kernels.quant.FORMATS is the Python side of this table; the codes must agree).
// Every format is read as 32-weight blocks of integer codes; the k-quants (Q2_K .. Q6_K: 256-weight super-blocks
// in the file) are laid out at load as such blocks, the same bits rearranged (quant.py).
// Q2_K: its 2-bit codes as crumbs (Traits::crumb_codes), each read + 4 so that every kernel computes it as it
// computes Q3_K (offset 4, int8 scales per 16 weights); its minimums per 16 weights (mn) are added after the
// kernel (quant_ops.cpp split_min_for).
enum Fmt : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, IQ4_NL = 8,
                     IQ4_XS = 9, Q3_K = 10, Q2_K = 11 };
constexpr int64_t kNumFmts = 12;
constexpr int64_t kBlock = 32;
constexpr int64_t kSuper = 8;  // 32-weight blocks per k-quant super-block

// One row of the format table: how a block's integer codes become values.
//   code = nibble (+ 16 * plane-0 bit) (+ 32 * plane-1 bit) - offset, or q8_0's signed byte;
//   value = s0 * code (+ s1) for one scale per block, or s0 * code (first 16 codes) and s1 * code (last 16)
//   for the split formats (Q3_K, Q6_K: a scale per 16 weights), with s0, s1 from `row_scales_ref`.
//   The lookup formats (IQ4_NL, IQ4_XS) map the nibble through kIq4Codes first: code = that table's entry.
template <Fmt F>
struct Traits {
  static constexpr bool nibbles = F != Q8_0;  // qs holds 16 bytes of nibble pairs, not 32 int8
  static constexpr bool has_min = F == Q4_1 || F == Q5_1 || F == Q4_K || F == Q5_K;
  static constexpr int planes =  // bits over the nibble (Q3_K: over its crumb, see crumb_codes)
      F == Q6_K ? 2 : (F == Q5_0 || F == Q5_1 || F == Q5_K || F == Q3_K) ? 1 : 0;
  // Q6_K's two high bits are 2-bit fields ("crumbs") in qh, 32 bytes a quad of blocks (see crumb_at), not two
  // bit planes: the int8 kernels add them with a shift and a mask a half quad, where two planes took 24 ops a
  // pair of blocks on AVX2.
  static constexpr bool crumbs = F == Q6_K;
  static constexpr bool has_qh = planes > 0;
  // scales derived per super-block (IQ4_XS: d * its 6-bit scale - 32, as the k-quants keep their own)
  static constexpr bool kquant = F == Q2_K || F == Q3_K || F == Q4_K || F == Q5_K || F == Q6_K || F == IQ4_XS;
  static constexpr bool split = F == Q2_K || F == Q3_K || F == Q6_K;  // int8 scales per 16 weights (sc: the halves')
  // Q2_K, Q3_K: the codes' two low bits are crumbs in qs, 8 bytes a block, laid out as Q6_K's crumbs (crumb_at:
  // a quad's 32 bytes, byte t holding L[t], L[32 + t], H[t], H[32 + t]); Q3_K's third bit is a bit plane (qh)
  // worth 4, Q2_K's codes are read + 4 (crumb_base), so that both are computed alike (offset 4) and only the
  // unpacking differs from the nibble formats' (crumb_codes_quad, crumb_codes_pair, crumb_nibbles)
  static constexpr bool crumb_codes = F == Q2_K || F == Q3_K;
  static constexpr int crumb_base = F == Q2_K ? 4 : 0;
  static constexpr int plane_value = F == Q3_K ? 4 : 16;  // what plane 0's bit adds (plane 1's: 32)
  // Q2_K: each scale byte (sc, one per 16 weights) holds the 4-bit scale in its low nibble and the 4-bit minimum
  // in its high one, as the file does; the scale readers mask it (scale_bytes), the minimum term shifts it
  static constexpr bool packed_min = F == Q2_K;
  // IQ4_NL, IQ4_XS: a nibble indexes a table of 16 int8 values (llama.cpp's kvalues_iq4nl), kept as value + 128
  // so that the int8 kernels' vpdpbusd reads it as an unsigned code (one vpshufb a vector), with the offset 128.
  static constexpr bool lut = F == IQ4_NL || F == IQ4_XS;
  static constexpr int sc_bytes = !kquant ? 0 : F == IQ4_XS ? 1 : 2;  // bytes of sc per block
  static constexpr int offset =
      F == Q4_0 ? 8 : F == Q5_0 ? 16 : F == Q6_K ? 32 : F == Q3_K || F == Q2_K ? 4 : lut ? 128 : 0;
  static constexpr int payload = crumb_codes ? 8 : nibbles ? 16 : 32;  // bytes of qs per block
};

// Calls fn(std::integral_constant<Fmt, F>{}) for the run-time format f: the drivers are written once over it.
template <typename Fn>
inline void dispatch_fmt(Fmt f, Fn&& fn) {
  switch (f) {
    case Q8_0: fn(std::integral_constant<Fmt, Q8_0>{}); break;
    case Q4_0: fn(std::integral_constant<Fmt, Q4_0>{}); break;
    case Q4_1: fn(std::integral_constant<Fmt, Q4_1>{}); break;
    case Q5_0: fn(std::integral_constant<Fmt, Q5_0>{}); break;
    case Q5_1: fn(std::integral_constant<Fmt, Q5_1>{}); break;
    case Q4_K: fn(std::integral_constant<Fmt, Q4_K>{}); break;
    case Q5_K: fn(std::integral_constant<Fmt, Q5_K>{}); break;
    case Q6_K: fn(std::integral_constant<Fmt, Q6_K>{}); break;
    case IQ4_NL: fn(std::integral_constant<Fmt, IQ4_NL>{}); break;
    case IQ4_XS: fn(std::integral_constant<Fmt, IQ4_XS>{}); break;
    case Q2_K: fn(std::integral_constant<Fmt, Q2_K>{}); break;
    default: fn(std::integral_constant<Fmt, Q3_K>{}); break;
  }
}

// Run-time view of the same table (the scalar paths and argument checks).
#define SERVELM_TRAIT(name, field)                                           \
  inline std::remove_cv_t<decltype(Traits<Q8_0>::field)> name(Fmt f) {       \
    std::remove_cv_t<decltype(Traits<Q8_0>::field)> v{};                     \
    dispatch_fmt(f, [&](auto c) { v = Traits<decltype(c)::value>::field; }); \
    return v;                                                                \
  }
SERVELM_TRAIT(fmt_has_min, has_min)
SERVELM_TRAIT(fmt_planes, planes)
SERVELM_TRAIT(fmt_kquant, kquant)
SERVELM_TRAIT(fmt_split, split)
SERVELM_TRAIT(fmt_crumbs, crumbs)
SERVELM_TRAIT(fmt_offset, offset)
SERVELM_TRAIT(fmt_payload, payload)
SERVELM_TRAIT(fmt_lut, lut)
SERVELM_TRAIT(fmt_sc_bytes, sc_bytes)
SERVELM_TRAIT(fmt_crumb_codes, crumb_codes)
SERVELM_TRAIT(fmt_crumb_base, crumb_base)
SERVELM_TRAIT(fmt_plane_value, plane_value)
SERVELM_TRAIT(fmt_packed_min, packed_min)
#undef SERVELM_TRAIT

// The lookup formats' codes (IQ4_NL, IQ4_XS in llama.cpp): kvalues_iq4nl + 128, so code - offset (128) is the
// table's int8 value; kIq4Values the same values (the int16 and fp32 paths, which take them signed).
constexpr uint8_t kIq4Codes[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// One [N, KB * 32] quantised weight, in 32-weight blocks:
//   qs: q8_0 int8 [N, KB, 32]; the others uint8 [N, KB, 16], element j in the low nibble of byte j, element
//       j + 16 in the high one;
//   qh, qh2: bit planes, plane 0 (+16) / plane 1 (+32) of each code (q5_*, Q5_K: qh; Q6_K: both), two uint64
//       per quad of blocks (4q .. 4q + 3), [N, 2 * ceil(KB / 4)], in the order the AVX-512 kernels' lanes come
//       (see plane_word): one mask load per quad and half, none of the bit shuffling per block a uint32 per
//       block needs;
//   d, m: fp16 [N, KB] scale and minimum (q4_1, q5_1) of each block; for the k-quants, [N, KB / 8]: the
//       super-block's d and dmin;
//   sc: k-quants, [N, KB, 2] per block: Q4_K/Q5_K uint8 (6-bit scale, 6-bit min), Q3_K and Q6_K int8 (scale of
//       the first 16 weights, of the last 16); IQ4_XS [N, KB, 1] int8 (its 6-bit scale - 32).
struct QWeight {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;
  const uint64_t* qh;
  const uint64_t* qh2;
  const uint8_t* sc;
  int64_t N;
  int64_t KB;
  Fmt fmt;
};

// Scale bytes as the kernels read them: Q2_K's low nibbles (its minimums masked off), the others' as they are.
template <Fmt F>
inline __m128i scale_bytes(__m128i raw) {
  if constexpr (Traits<F>::packed_min) return _mm_and_si128(raw, _mm_set1_epi8(15));
  return raw;
}
template <Fmt F>
__attribute__((target("avx2"))) inline __m256i scale_bytes(__m256i raw) {
  if constexpr (Traits<F>::packed_min) return _mm256_and_si256(raw, _mm256_set1_epi8(15));
  return raw;
}

// Plane words per row (Q6_K: crumb words, four a quad).
inline int64_t plane_stride(const QWeight& w) { return (w.KB + 3) / 4 * (fmt_crumbs(w.fmt) ? 4 : 2); }

// Where element k of block b lies in a row's plane words: word 2 * (b / 4) holds the quad's k 0..15, word
// 2 * (b / 4) + 1 its k 16..31, bits 16 * (b % 4) + (k % 16).
inline int64_t plane_word(int64_t b, int k) { return b / 4 * 2 + (k >= 16); }
inline int plane_bit(int64_t b, int k) { return static_cast<int>(b & 3) * 16 + (k & 15); }

// The 32 bits of block b of row n in one plane (bit k = element k), for the paths that go block by block.
inline uint32_t block_word(const uint64_t* plane, const QWeight& w, int64_t n, int64_t b) {
  const uint64_t* q = plane + n * plane_stride(w) + b / 4 * 2;
  const int sh = static_cast<int>(b & 3) * 16;
  return static_cast<uint32_t>((q[0] >> sh) & 0xFFFFu) | (static_cast<uint32_t>((q[1] >> sh) & 0xFFFFu) << 16);
}

// Q6_K's crumbs: the two high bits of every code of a quad of blocks in 32 bytes. With L = the quad's 64 low-
// nibble bytes [4q k 0..15, 4q+1 k 0..15, 4q+2 .., 4q+3 ..] and H its high-nibble bytes (the same blocks' k
// 16..31), the int8 kernels' two 64-byte halves of a quad, byte t (0..31) holds the crumbs of L[t] (bits 0-1),
// L[32 + t] (bits 2-3), H[t] (bits 4-5) and H[32 + t] (bits 6-7): a pair of blocks (the quad's first or second
// half, 32 bytes of L and of H) takes the 32 bytes shifted so that its crumbs are bits 4-5, then masked.
// Q6_K: the crumb bytes of quad q of row n start at crumb_row(w, n) + 32 q.
inline const uint8_t* crumb_row(const QWeight& w, int64_t n) {
  return reinterpret_cast<const uint8_t*>(w.qh + n * plane_stride(w));
}

inline int crumb_at(const uint8_t* row, int64_t b, int k) {
  const int idx = static_cast<int>(b & 3) * 16 + (k & 15);
  const int sh = 2 * (idx >> 5) + (k >= 16 ? 4 : 0);
  return (row[b / 4 * 32 + (idx & 31)] >> sh) & 3;
}

// The 32 bits of block b of row n in plane p (bit k = element k's bit 4 + p), for the paths that go block by
// block: the plane words as they are, or Q6_K's crumbs gathered (bit 7 of each byte shifted in, one movemask
// per 16 elements; SSE2, which every x86-64 has).
inline uint32_t block_plane(const QWeight& w, int p, int64_t n, int64_t b) {
  if (!fmt_crumbs(w.fmt)) return block_word(p ? w.qh2 : w.qh, w, n, b);
  const uint8_t* c = crumb_row(w, n) + b / 4 * 32 + 16 * (b & 1);
  const int s = 2 * static_cast<int>((b >> 1) & 1) + p;  // block b's crumb bits: s (k 0..15), s + 4 (k 16..31)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const auto bits = [&](int at) {
    return static_cast<uint32_t>(_mm_movemask_epi8(_mm_sll_epi16(v, _mm_cvtsi32_si128(7 - at)))) & 0xFFFFu;
  };
  return bits(s) | (bits(s + 4) << 16);
}

// A quad's crumbs added to its codes (AVX-512 BW): lo, hi the quad's 64 low- and high-nibble bytes (L, H),
// c32 its 32 crumb bytes. Broadcast to both 256-bit halves, shifted per half so the crumbs are bits 4-5, then
// lo | (t & 0x30) in one ternary-logic op: five ops a quad where two bit planes took four mask loads and four
// masked adds.
__attribute__((target("avx512f,avx512bw"))) inline void add_crumbs_quad(const uint8_t* c32, __m512i& lo,
                                                                          __m512i& hi) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c32)));
  const __m512i lo_shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  // L[t], L[32 + t]
  const __m512i hi_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  // H[t], H[32 + t]
  const __m512i m = _mm512_set1_epi8(0x30);
  lo = _mm512_ternarylogic_epi32(lo, _mm512_sllv_epi16(v, lo_shift), m, 0xF8);  // lo | (t & m)
  hi = _mm512_ternarylogic_epi32(hi, _mm512_srlv_epi16(v, hi_shift), m, 0xF8);
}

// The lookup formats (IQ4_NL, IQ4_XS): nibble bytes -> their codes (kIq4Codes), one vpshufb (AVX-512 BW: the
// int8 micro-kernel and the panel decoding); other formats as they are.
template <Fmt F>
__attribute__((target("avx512f,avx512bw"))) inline __m512i lut_bytes(__m512i nib) {
  if constexpr (!Traits<F>::lut) return nib;
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Codes))),
                             nib);
}

// The same for one pair of blocks on AVX2 (half 0 or 1 of its quad: 32 bytes of L and of H).
template <int H>
__attribute__((target("avx2"))) inline void add_crumbs_pair(const uint8_t* c32, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c32));
  const __m256i m = _mm256_set1_epi8(0x30);
  lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(v, 4 - 2 * H), m));
  hi = _mm256_or_si256(hi, _mm256_and_si256(H ? _mm256_srli_epi16(v, 2) : v, m));
}

using servelm_prefetch::prefetch_read;

// Prefetches into L2 the fields of rows [n, n + rows) other than the codes (scales, minimums, the k-quants' scale
// bytes, bit planes): a few cache lines a row, in arrays of their own, so the hardware's stream prefetchers
// lag behind on them; the kernels call it a few micro-tiles ahead (the codes they prefetch as they go).
template <Fmt F>
inline void prefetch_fields(const QWeight& w, int64_t n, int64_t rows) {
  const auto lines = [](const void* base, int64_t first, int64_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(base) + first, end = a + bytes;
    for (uintptr_t p = a & ~uintptr_t{63}; p < end; p += 64) prefetch_read<2>(reinterpret_cast<const void*>(p));
  };
  const int64_t per = Traits<F>::kquant ? w.KB / kSuper : w.KB;  // d (and m) per row
  lines(w.d, n * per * 2, rows * per * 2);
  if (Traits<F>::has_min) lines(w.m, n * per * 2, rows * per * 2);
  if (Traits<F>::kquant) lines(w.sc, n * w.KB * Traits<F>::sc_bytes, rows * w.KB * Traits<F>::sc_bytes);
  const int64_t ps = plane_stride(w) * 8;
  if (Traits<F>::planes >= 1) lines(w.qh, n * ps, rows * ps);
  if (Traits<F>::planes >= 2 && !Traits<F>::crumbs) lines(w.qh2, n * ps, rows * ps);
}

// The code crumbs of row n (Q2_K, Q3_K): quad q's 32 bytes at + 32 q (crumb_at's layout).
inline const uint8_t* code_crumbs(const QWeight& w, int64_t n) { return w.qs + n * w.KB * 8; }

// Block b's 16 bytes of nibble pairs (element k low, k + 16 high) from its crumbs (SSE2), each | base (Q2_K's 4;
// Q3_K's planes are added after): for the paths that go block by block, which then read them as nibbles.
inline __m128i crumb_nibbles(const uint8_t* row, int64_t b, int base) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b / 4 * 32 + 16 * (b & 1)));
  const __m128i s = _mm_cvtsi32_si128(2 * static_cast<int>((b >> 1) & 1));  // block b's L bits: 2s; H: 4 + 2s
  const __m128i three = _mm_set1_epi8(3), add = _mm_set1_epi8(static_cast<char>(base));
  const __m128i lo = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(v, s), three), add);
  const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(_mm_srli_epi16(v, 4), s), three), add);
  return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));  // hi <= 7: nothing crosses into the next byte
}

// A quad's codes from its 32 crumb bytes (AVX-512 BW), each | base: lo, hi as a nibble format's (the quad's 64
// low-nibble codes L, its 64 high-nibble ones H); (v >> s) & 3 | base in one ternary-logic op a vector.
__attribute__((target("avx512f,avx512bw"))) inline void crumb_codes_quad(const uint8_t* c32, int base, __m512i& lo,
                                                                           __m512i& hi) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c32)));
  const __m512i lo_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  // L[t], L[32 + t]
  const __m512i hi_shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);  // H[t], H[32 + t]
  const __m512i three = _mm512_set1_epi8(3), add = _mm512_set1_epi8(static_cast<char>(base));
  lo = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(v, lo_shift), three, add, 0xEA);  // (a & b) | c
  hi = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(v, hi_shift), three, add, 0xEA);
}

// The same for one pair of blocks on AVX2 (half H of its quad: 32 codes of L and of H), from the quad's 32 bytes.
template <int H>
__attribute__((target("avx2"))) inline void crumb_codes_pair(const uint8_t* c32, int base, __m256i& lo,
                                                            __m256i& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c32));
  const __m256i three = _mm256_set1_epi8(3), add = _mm256_set1_epi8(static_cast<char>(base));
  lo = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * H), three), add);
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4 + 2 * H), three), add);
}

// The integer code of element k (0..31) of block b of row n (the scalar reference of every path).
inline int code_at(const QWeight& w, int64_t n, int64_t b, int k) {
  if (w.fmt == Q8_0) return reinterpret_cast<const int8_t*>(w.qs)[(n * w.KB + b) * 32 + k];
  if (fmt_crumb_codes(w.fmt)) {
    int q = crumb_at(code_crumbs(w, n), b, k) | fmt_crumb_base(w.fmt);
    if (w.qh) q |= static_cast<int>((w.qh[n * plane_stride(w) + plane_word(b, k)] >> plane_bit(b, k)) & 1u) << 2;
    return q - fmt_offset(w.fmt);
  }
  const uint8_t byte = w.qs[(n * w.KB + b) * 16 + (k & 15)];
  int q = k < 16 ? (byte & 15) : (byte >> 4);
  if (fmt_lut(w.fmt)) return kIq4Values[q];
  if (fmt_crumbs(w.fmt))
    return (q | crumb_at(crumb_row(w, n), b, k) << 4) - fmt_offset(w.fmt);
  const int64_t at = n * plane_stride(w) + plane_word(b, k);
  if (w.qh) q |= static_cast<int>((w.qh[at] >> plane_bit(b, k)) & 1u) << 4;
  if (w.qh2) q |= static_cast<int>((w.qh2[at] >> plane_bit(b, k)) & 1u) << 5;
  return q - fmt_offset(w.fmt);
}

// x prepared for one ISA: int16 codes [M][KBp * 32] in that ISA's layout, block scales s [M][KBp] (padding
// blocks: 0), fp32 block sums [M][KBp] (formats with a minimum only), and for the AVX-512 nibble layout the
// scales of each pair of blocks spread over 16 lanes, [M][KBp / 2][16] (all three with the row stride `ss`).
struct XQ {
  const int16_t* q;
  const float* s;
  const float* xsum;
  const float* spair;
  int64_t M;
  int64_t KBp;
  int64_t ss;  // row stride (floats) of s, xsum and spair: row i's scales are at s + i * ss
  // The int8 scheme (AVX-512 VNNI, the nibble formats): KBp is KB rounded up to whole quads (4 blocks), codes
  // int8 [M][KBp * 32] in the quad layout instead of q, s the fp32 scales d = amax / 127 (not powers of two),
  // xsum d * the sum of the block's codes, spair the scales per lane of a quad's vpdpbusd ([b x4, b+1 x4,
  // b+2 x4, b+3 x4]), corr [M][KBp / 4][32] -offset * each lane's sum of codes (first 16: the low nibbles'
  // lanes, or both halves' where a block has one scale; last 16: the high nibbles', split formats).
  const int8_t* q8 = nullptr;
  const int32_t* corr = nullptr;
  // The k-quants on AVX2 (Q3_K .. Q6_K; `super_x` in quant_ops.cpp): x rounded per super-block of 256 with
  // power-of-two sub-scales (see kSubShift), the codes in the same quad layout (KBp = KB), s one fp32 d_fine per
  // super-block ([M][KB / 8], stride ss: block j's scale is d_fine * 2^(kSubShift - e_j)), and sub int16
  // [M][KB / 8][32]: per super-block, the blocks' sums of codes (k 0..15, k 16..31: words 2j, 2j + 1), then the
  // multipliers 2^(kSubShift - e_j) (words 16 + 2j and 16 + 2j + 1, equal). spair, xsum and corr are unused.
  const int16_t* sub = nullptr;
};

// x for the k-quants on AVX2: one d = amax / 127 per super-block of 256 (llama.cpp's Q8_K), and per block j of
// 32 a power-of-two sub-scale d * 2^-e_j, e_j the largest e <= kSubShift with the block's amax * 2^e <= amax:
// each block's codes reach at least 64 (where it is within 2^kSubShift of the super-block's amax), near a
// scale of its own (one d per 256 had cost 1.3-1.5 points of top-1 agreement with fp32 on a Q4_K_M file of the
// default model's weights), while a super-block's scaled block sums stay int32: the micro-kernel multiplies each
// block's integer scale by 2^(kSubShift - e_j) (vpmullw) and sums in int32 (bounds: quant_avx2.cpp micro_i8k).
constexpr int kSubShift = 6;

// Whether the micro-kernels walk a thread's weight rows one at a time instead of in tiles of 4 rows: then they
// read them as one sequential stream (the rows are consecutive), which this memory serves better than four
// streams a row apart. Two threads reading 1 GB on a 2-core Zen 5 EPYC, 8 rows prefetched ahead: one stream
// 41-43 GB/s, four rows of 1,152 bytes in lockstep 31-33. The Llama-3.2-1B shape's matrices at M = 1, rounds
// interleaved: Q4_K_M 22.4 against 26.1 ms, Q8_0 (the int16 scheme) 39 against 46. Short rows (the default
// model's K = 576: a tile's four rows are 1.2 KB, one stream already) and 3+ rows of x (the tiles reuse each x
// load across weight rows) keep the tiles (docs/measurements/quant-kernels.md, eighth session).
constexpr int64_t kStreamMaxRows = 2;
constexpr int64_t kStreamMinBlocks = 64;  // 1 KB of nibbles a row
inline bool stream_rows(const XQ& x, int64_t kb) { return x.M <= kStreamMaxRows && kb >= kStreamMinBlocks; }

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

// fp32 scales of the blocks of row n, exact products of the file's numbers: s0[b] (the block's scale; split
// formats: its first 16 weights'), s1[b] (the block's minimum, added to each value; split formats: the scale of
// its last 16 weights; formats with neither leave s1 alone). Blocks [KB, padded) get zeros.
inline void row_scales_ref(const QWeight& w, int64_t n, float* s0, float* s1, int64_t padded) {
  const int64_t kb = w.KB;
  const Fmt f = w.fmt;
  const bool kq = fmt_kquant(f), has_min = fmt_has_min(f), split = fmt_split(f);
  for (int64_t b = 0; b < kb; ++b) {
    if (!kq) {
      s0[b] = half_to_float(w.d[n * kb + b]);
      if (has_min) s1[b] = half_to_float(w.m[n * kb + b]);
      continue;
    }
    const int64_t sb = n * (kb / kSuper) + b / kSuper;
    const float d = half_to_float(w.d[sb]);
    const uint8_t* sc = w.sc + (n * kb + b) * fmt_sc_bytes(f);
    if (fmt_lut(f)) {  // IQ4_XS: d * (6-bit scale - 32), exact
      s0[b] = d * static_cast<float>(static_cast<int8_t>(sc[0]));
    } else if (split) {  // int8 scales of the two halves (d fp16 x int8: exact in fp32); Q2_K's low nibbles
      const bool packed = fmt_packed_min(f);
      s0[b] = d * static_cast<float>(packed ? sc[0] & 15 : static_cast<int8_t>(sc[0]));
      s1[b] = d * static_cast<float>(packed ? sc[1] & 15 : static_cast<int8_t>(sc[1]));
    } else {  // 6-bit scale and minimum: value = d * sc * q - dmin * mn
      s0[b] = d * static_cast<float>(sc[0]);
      s1[b] = -(half_to_float(w.m[sb]) * static_cast<float>(sc[1]));
    }
  }
  for (int64_t b = kb; b < padded; ++b) {
    s0[b] = 0.0f;
    if (has_min || split) s1[b] = 0.0f;
  }
}

// row_scales_ref's numbers with AVX-512 (F16C conversions, 16 blocks a step; quant_avx512_vnni.cpp): the same
// exact values, for the panel GEMM's decoding, where the scalar reference's bit arithmetic per block had taken
// 11% of a 128-row Q4_K GEMM. Writes s0 (and s1 for the formats with a minimum or split scales) up to `padded`
// (a multiple of 16), zeros past KB; leaves s1 alone otherwise.
void row_scales_avx512(const QWeight& w, int64_t n, float* s0, float* s1, int64_t padded);
// The same with AVX2 + F16C, 8 blocks a step (quant_avx2.cpp), for the AVX2 panel GEMM.
void row_scales_avx2(const QWeight& w, int64_t n, float* s0, float* s1, int64_t padded);

// y[:, n0:n1] = x @ W[n0:n1].T (+ bias[n0:n1]) with y fp32 [M, N] (row stride N).
using GemmFn = void (*)(const XQ& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1);

void gemm_scalar(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
void gemm_avx2(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
void gemm_avx512(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
void gemm_avx512_vnni(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
// The int8 scheme (x.q8): vpdpbusd of the weights' unsigned codes with x's int8 codes, 64 weights an
// instruction (the int16 scheme's vpdpwssd: 32), exact int32 lane sums corrected for the offset, then as above.
void gemm_avx512_vnni_i8(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);
// The same scheme on AVX2: vpmaddubsw + vpmaddwd, 32 weights an instruction pair.
void gemm_avx2_i8(const XQ&, const QWeight&, const float*, float*, int64_t, int64_t);

// x prepared for the int8 panel GEMM (panels_avx512_vnni.cpp, panels_avx2.cpp): the int8 scheme's codes and
// scales (exactly the decode kernel's), laid out by groups of gb blocks (gb = 16 on AVX-512, 8 on AVX2: a
// vector's int32 lanes; G = ceil(KB / gb)): codes int8 [M][G][8][gb * 4], slice i of group g holding
// k 4i..4i+3 of block gb * g + l in bytes 4l..4l+3; per row (stride ss = 2 * G * gb) fp32 s [G * gb] | xsum
// [G * gb] (d * the sum of the block's codes) and int32 corr [G * gb] | corr1 [G * gb] (-offset * the block's
// sum of codes; split formats: of its first 16, then of its last 16; the split formats on AVX2, whose x is
// rounded per super-block: the two half sums as an int16 pair in corr). Zero past KB.
struct XP {
  const int8_t* q;
  const float* s;
  const int32_t* corr;
  int64_t M;
  int64_t G;
  int64_t ss;
};
// y[:, n0:n1] = x @ W[n0:n1].T (+ bias) for the nibble formats, decoding kPanelRows weight rows at a time
// (the callers hand each thread whole panels).
constexpr int kPanelRows = 16;
void panels_avx512_vnni_i8(const XP&, const QWeight&, const float*, float*, int64_t, int64_t);
void panels_avx2_i8(const XP&, const QWeight&, const float*, float*, int64_t, int64_t);

// Weights interleaved by 16 rows ("rows16": rows16_avx512_vnni.cpp, rows16_avx2.cpp;
// servelm.kernels.quant.interleave_rows16), the int8 paths' layout for Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
// and Q8_0: the same bytes as the row layout, reordered so that lane l of every vector is weight row 16g + l (on
// AVX2 a 64-byte chunk is two 8-row halves). Per group g of 16 rows and block b:
//   qs: nibble formats [G][KB][4 chunks][16 rows][4 bytes] (chunk j: a row's bytes 4j..4j+3 of the q4 layout, so
//       elements 4j..4j+3 in the low nibbles, 16+4j..16+4j+3 in the high ones); Q8_0 [G][KB][16 pairs][16][2]
//       (pair j: elements 2j, 2j+1);
//   d, m: fp16 [G][KB][16] (k-quants: per super-block, [G][KB/8][16]);
//   sc: the k-quants' two scale bytes [G][KB][2][16];
//   hb: Q6_K's high bits [G][KB][2][16][4]: byte c of row l in half p holds chunk 2p's crumbs (element 8p+c in
//       bits 0-1, 16+8p+c in bits 2-3) and chunk 2p+1's (bits 4-5, 6-7); the fifth bits of Q5_0, Q5_1 and Q5_K
//       [G][KB][16][4]: byte c of row l holds element 4j+c's in bit 2j and 16+4j+c's in bit 2j+1 (j 0..3).
struct R16W {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;
  const uint8_t* hb;
  const uint8_t* sc;
  int64_t G;
  int64_t KB;
  Fmt fmt;
};
// x for it. The nibble formats: the int8 scheme's codes in the quad layout (XQ.q8, row stride q8s bytes), s and
// xsum per block (stride ss), init [M][KB][2] int32 (-offset * the block's sum of codes, split formats per half;
// the first vpdpbusd's start). Q8_0: the int16 scheme's codes in the natural layout (q16, row stride q16s) and
// its power-of-two scales s.
struct R16X {
  const int8_t* q8;
  const int16_t* q16;
  int64_t qstride;  // elements of q8 / q16 per row
  const float* s;
  const float* xsum;
  int64_t ss;
  const int32_t* init;
  int64_t M;
};
// What a 16-row kernel's tile reads (rows16_avx512_vnni.cpp, rows16_avx2.cpp): group g's fields and rows
// i0 .. i0 + R of x, bound by name in the kernels (`auto& [qs, dg, ...] = tile`).
template <Fmt F, int R>
struct R16Tile {
  using T = Traits<F>;
  static constexpr bool kq = T::kquant, split = T::split, plane = T::planes == 1, q8 = F == Q8_0;
  static constexpr int64_t qb = q8 ? 512 : 256;    // code bytes per (group, block)
  static constexpr int64_t hbb = split ? 128 : 64;  // high-bit bytes per (group, block)
  static constexpr int64_t kAhead = 4096;           // bytes of codes prefetched ahead (the thread's one stream)
  const uint8_t* qs;
  const uint16_t* dg;
  const uint16_t* mg;   // fp16 minimums (per block, or the k-quants' dmin per super-block)
  const uint8_t* scg;   // the k-quants' scale bytes
  const uint8_t* hbg;   // high bits (Q6_K's crumbs, the q5s' fifth bits)
  const int8_t* xq[R];  // x's codes (the nibble formats), Q8_0's int16 ones, scales, block sums, offset starts
  const int16_t* xw[R];
  const float* xs[R];
  const float* xm[R];
  const int32_t* xi[R];

  R16Tile(const R16X& x, const R16W& w, int64_t g, int64_t i0) {
    const int64_t KB = w.KB, ns = kq ? KB / kSuper : KB;
    qs = w.qs + g * KB * qb;
    dg = w.d + g * ns * 16;
    mg = T::has_min ? w.m + g * ns * 16 : nullptr;
    scg = kq ? w.sc + g * KB * 32 : nullptr;
    hbg = (split || plane) ? w.hb + g * KB * hbb : nullptr;
    for (int r = 0; r < R; ++r) {
      xq[r] = q8 ? nullptr : x.q8 + (i0 + r) * x.qstride;
      xw[r] = q8 ? x.q16 + (i0 + r) * x.qstride : nullptr;
      xs[r] = x.s + (i0 + r) * x.ss;
      xm[r] = x.xsum ? x.xsum + (i0 + r) * x.ss : nullptr;
      xi[r] = T::offset != 0 ? x.init + (i0 + r) * KB * 2 : nullptr;
    }
  }

  // Block b's fields kAhead bytes of codes ahead: the same distance in blocks for every field (prefetches past
  // an array's end do not fault).
  void prefetch(int64_t b) const {
    constexpr int64_t ahead = kAhead / qb;
    const uint8_t* p = qs + b * qb + kAhead;
    for (int64_t c = 0; c < qb; c += 64) prefetch_read<3>(p + c);
    if constexpr (kq) {
      prefetch_read<3>(scg + (b + ahead) * 32);
      if ((b & (kSuper - 1)) == 0) {
        prefetch_read<3>(dg + (b / kSuper + 2) * 16);
        if (mg) prefetch_read<3>(mg + (b / kSuper + 2) * 16);
      }
    } else {
      prefetch_read<3>(dg + (b + ahead) * 16);
      if (mg) prefetch_read<3>(mg + (b + ahead) * 16);
    }
    if constexpr (split || plane) prefetch_read<3>(hbg + (b + ahead) * hbb);
    if constexpr (split) prefetch_read<3>(hbg + (b + ahead) * hbb + 64);
  }
};
inline bool rows16_format(Fmt f) {
  return f == Q4_0 || f == Q4_1 || f == Q5_0 || f == Q5_1 || f == Q4_K || f == Q5_K || f == Q6_K || f == Q8_0;
}
// y[:, 16 g0 : 16 g1] = x @ W[16 g0 : 16 g1].T (+ bias), y [M, 16 G]. Every output is one fixed sequence of
// operations on its own rows of x and W, whatever M and the split: batch-invariant at every M.
void rows16_gemm(const R16X& x, const R16W& w, const float* bias, float* y, int64_t g0, int64_t g1);
void rows16_gemm_avx2(const R16X& x, const R16W& w, const float* bias, float* y, int64_t g0, int64_t g1);
// The same with AMX tiles (rows16_amx.cpp; the same bits), for the nibble formats: xa is x's codes in natural
// order [M][KB][32], rows xas bytes apart. amx_usable(): the CPU has AMX-TILE and AMX-INT8 and the kernel gave this process the tiles.
inline bool amx_format(Fmt f) { return rows16_format(f) && f != Q8_0 && f != Q6_K; }
bool amx_usable();
void rows16_gemm_amx(const R16X& x, const int8_t* xa, int64_t xas, const R16W& w, const float* bias, float* y, int64_t g0,
                     int64_t g1);

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
