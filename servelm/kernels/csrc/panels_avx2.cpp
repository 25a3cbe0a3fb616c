// The int8 panel GEMM of panels_avx512_vnni.cpp on AVX2 (path avx2_i8): the same scheme and x codes, groups of
// 8 blocks (lane l = block l of a ymm), the dot products as vpmaddubsw (unsigned weight codes x int8 x, pairs
// summed to int16: at most 2 x 63 x 127, so two slices' sums still fit) + vpmaddwd with ones (to int32).
// Q8_0 comes here too (paths avx2 and avx2_i8; its prompts had run on fp32 tiles) with the int16 scheme's codes,
// x rounded as its decode rounds it, and vpmaddwd. int8 codes (vpmaddubsw of |w| with x signed by w, as
// llama.cpp's q8_0 dot products) had cost the default model 2.4 points of teacher-forced top-1 agreement with
// fp32 in --quantization int8 (97.85% -> 95.41%), for ~15% more speed (docs/measurements/quant-kernels.md). The
// weights are decoded a panel of kNp rows at a time, block by block (nibbles and bit planes to bytes, then
// each 4-byte group to its slice), and used against every row of x.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace servelm_quant {
namespace {

constexpr int kGb = 8;                          // blocks per group (int32 lanes of a ymm)
constexpr int kNp = kPanelRows;                 // weight rows per decoded panel
constexpr int kNr = 2;                          // weight rows per micro-tile
constexpr int kR = 3;                           // rows of x per micro-tile
constexpr int64_t kGroupBytes = kGb * kBlock;   // one group: 8 slices of 32 bytes
constexpr int64_t kSlice = kGb * 4;
constexpr bool kPanelsQ8 = true;                // Q8_0 too, with int16 codes (the driver's run_any)
// Bytes per code: Q8_0's panel holds int16 (x and the weights sign-extended), 16 slices of 32 bytes a group.
template <Fmt F>
constexpr int64_t kWidth = F == Q8_0 ? 2 : 1;
// The split formats (Q3_K, Q6_K: an int8 scale per 16 weights) keep their scales as integers in the panel: s0
// holds each block's super-block d (fp32), s1 per group three vectors of 16 int16 (kS1 = 3 floats a block): the
// first halves' scales twice per int32 lane, the second halves' twice, then (first, second) per lane. The
// micro-kernel multiplies each half's int16 pair sums by its scale in vpmaddwd (in place of a multiply by ones),
// sums both halves and the offset term in int32, and scales once per group: one convert, multiply and fma
// where each half's fp32 scaling had taken its own, with x's offset correction per half (Q3_K and Q6_K ran
// at half Q4_K's speed here: 115-164 against 243-254 GFLOP/s at 128 x 8192 x 2048).
template <Fmt F>
constexpr int64_t kS1 = Traits<F>::split ? 3 : 1;
static_assert(kGb == kSuper, "a group of blocks is one k-quant super-block");

inline float hsum_ps(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// The 32 bits of a plane word as 32 bytes, 0 or `value` (bit k -> byte k).
inline __m256i plane_bytes(uint32_t bits, uint8_t value) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                                              2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(static_cast<char>(value)));
}

// Rows [n, n + rows) of w into a panel: codes [kNp][G][8 slices][32], s0/s1 [kNp][G * 8] (see the AVX-512 file).
template <Fmt F>
void decode_panel(const QWeight& w, int64_t n, int rows, int64_t G, uint8_t* codes, float* s0, float* s1) {
  const int64_t kb = w.KB, kbg = G * kGb;
  const __m128i low4 = _mm_set1_epi8(0x0f);
  for (int j = 0; j < kNp; ++j) {
    uint8_t* cj = codes + j * G * kGroupBytes * kWidth<F>;
    float* s0j = s0 + j * kbg;
    float* s1j = s1 + j * kbg * kS1<F>;
    std::memset(cj, 0, G * kGroupBytes * kWidth<F>);
    std::fill(s1j, s1j + kbg * kS1<F>, 0.0f);
    if (j >= rows) {
      std::fill(s0j, s0j + kbg, 0.0f);
      continue;
    }
    const int64_t row = n + j;
    if constexpr (Traits<F>::split) {  // d per block; the int8 scales widened to int16 (see kS1)
      const int64_t nsb = kb / kSuper;  // == G
      const __m256i lo16 = _mm256_set1_epi32(0xFFFF), hi16 = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      for (int64_t g = 0; g < nsb; ++g) {
        _mm256_storeu_ps(s0j + g * kGb, _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(w.d[row * nsb + g]))));
        const __m256i v = _mm256_cvtepi8_epi16(
            scale_bytes<F>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (row * kb + g * kSuper) * 2))));
        __m256i* dst = reinterpret_cast<__m256i*>(s1j + g * kGb * kS1<F>);
        _mm256_storeu_si256(dst, _mm256_or_si256(_mm256_and_si256(v, lo16), _mm256_slli_epi32(v, 16)));
        _mm256_storeu_si256(dst + 1, _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_and_si256(v, hi16)));
        _mm256_storeu_si256(dst + 2, v);
      }
    } else {
      row_scales_avx2(w, row, s0j, s1j, kbg);
    }
    if constexpr (F == Q8_0) {  // block b's k 2i, 2i + 1 as int16 at slice i, lane b % 8
      const int8_t* src = reinterpret_cast<const int8_t*>(w.qs) + row * kb * kBlock;
      for (int64_t b = 0; b < kb; ++b) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + b * kBlock));
        alignas(32) uint32_t dw[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(dw), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(dw + 8), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)));
        uint8_t* dst = cj + (b / kGb) * 2 * kGroupBytes + (b % kGb) * 4;
        for (int i = 0; i < 16; ++i) std::memcpy(dst + i * kSlice, &dw[i], 4);
      }
      continue;
    }
    for (int64_t b = 0; b < kb; ++b) {
      const __m128i raw =
          Traits<F>::crumb_codes ? crumb_nibbles(code_crumbs(w, row), b, Traits<F>::crumb_base)
                                 : _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + (row * kb + b) * 16));
      __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
      if constexpr (Traits<F>::crumbs) {  // block b's 16 crumb bytes: k 0..15 at bits 2s, k 16..31 at 4 + 2s
        const __m128i v =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(crumb_row(w, row) + b / 4 * 32 + 16 * (b & 1)));
        const int s2 = 2 * static_cast<int>((b >> 1) & 1);
        const __m128i m = _mm_set1_epi8(0x30);
        c = _mm256_or_si256(c, _mm256_set_m128i(_mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(s2)), m),
                                                _mm_and_si128(_mm_sll_epi16(v, _mm_cvtsi32_si128(4 - s2)), m)));
      } else {
        if constexpr (Traits<F>::planes >= 1)
          c = _mm256_add_epi8(c, plane_bytes(block_plane(w, 0, row, b), Traits<F>::plane_value));
        if constexpr (Traits<F>::planes >= 2) c = _mm256_add_epi8(c, plane_bytes(block_plane(w, 1, row, b), 32));
      }
      alignas(32) uint32_t dw[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(dw), c);
      uint8_t* dst = cj + (b / kGb) * kGroupBytes + (b % kGb) * 4;
      for (int i = 0; i < 8; ++i) std::memcpy(dst + i * kSlice, &dw[i], 4);
    }
  }
}

// Q8_0: int16 weights x int16 x (the int16 scheme's codes), vpmaddwd per slice into int32 lanes (a block's 32
// products: at most 32 x 128 x 32767), then as the nibble formats.
template <int R>
inline void micro_q8(const uint8_t* wc, const float* s0, const float* s1, int64_t G, const XP& x, int64_t i0,
                     float out[kNr][kR]) {
  const int64_t kbg = G * kGb, wstride = G * 2 * kGroupBytes;
  __m256 acc[kNr][R];
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t gb = g * kGb;
    __m256i ia[kNr][R];
    for (int j = 0; j < kNr; ++j)
      for (int r = 0; r < R; ++r) ia[j][r] = _mm256_setzero_si256();
    for (int i = 0; i < 16; ++i) {
      __m256i wv[kNr];
      for (int j = 0; j < kNr; ++j)
        wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + j * wstride + g * 2 * kGroupBytes +
                                                                    i * kSlice));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.q + (i0 + r) * wstride + g * 2 * kGroupBytes + i * kSlice));
        for (int j = 0; j < kNr; ++j) ia[j][r] = _mm256_add_epi32(ia[j][r], _mm256_madd_epi16(wv[j], xv));
      }
    }
    for (int j = 0; j < kNr; ++j) {
      const __m256 wsv = _mm256_loadu_ps(s0 + j * kbg + gb);
      for (int r = 0; r < R; ++r)
        acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j][r]),
                                    _mm256_mul_ps(wsv, _mm256_loadu_ps(x.s + (i0 + r) * x.ss + gb)), acc[j][r]);
    }
  }
  (void)s1;
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) out[j][r] = hsum_ps(acc[j][r]);
}

// kStep consecutive slices of a panel row's weights (kSlice bytes apart).
template <int kStep>
inline void load_slices(const uint8_t* wp, __m256i (&wv)[kStep]) {
  for (int t = 0; t < kStep; ++t) wv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + t * kSlice));
}

// Those slices against x's at xp: vpmaddubsw's int16 pair sums, added in int16 (the callers bound kStep so that
// they cannot saturate).
template <int kStep>
inline __m256i slice_pair_sums(const __m256i (&wv)[kStep], const int8_t* xp) {
  __m256i p = _mm256_maddubs_epi16(wv[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
  for (int t = 1; t < kStep; ++t)
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wv[t], _mm256_loadu_si256(
                                                            reinterpret_cast<const __m256i*>(xp + t * kSlice))));
  return p;
}

// The split formats (see kS1): x's corr holds each block's two half sums of codes as an int16 pair
// (prep_row_panel with `super`, the k-quants' rounding on this path). Bounds (codes < 64, |x codes| <= 127,
// |scales| <= 128): a pair sum of two slices < 2^15 as below; per lane and group, 2 halves x 2 steps x 2 x
// 32,004 x 128 plus the offset 32 x 2 x 128 x 2,032 < 2^26: int32 holds it, and its conversion rounds (above
// 2^24) once per 256 weights.
template <Fmt F, int R>
inline void micro_split(const uint8_t* wc, const float* s0, const float* s1, int64_t G, const XP& x, int64_t i0,
                        float out[kNr][kR]) {
  constexpr int kShift = Traits<F>::offset == 32 ? 5 : 2;
  static_assert(Traits<F>::offset == 1 << kShift, "split formats: offset 32 or 4");
  constexpr int kStep = 2;  // pairs of slices: Q3_K's four at a time were no faster (more registers live)
  const int64_t kbg = G * kGb, wstride = G * kGroupBytes;
  __m256 acc[kNr][R];
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  // One weight row at a time within a group (its R dot products live, not the tile's kNr x R: those had
  // spilled to the stack here).
  for (int64_t g = 0; g < G; ++g) {
    const int64_t gb = g * kGb;
    for (int j = 0; j < kNr; ++j) {
      const __m256i* scj = reinterpret_cast<const __m256i*>(s1 + (j * kbg + gb) * kS1<F>);
      __m256i ia[R];
      for (int r = 0; r < R; ++r) ia[r] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i sc = _mm256_loadu_si256(scj + h);
        for (int i = 4 * h; i < 4 * h + 4; i += kStep) {
          __m256i wv[kStep];
          load_slices<kStep>(wc + j * wstride + g * kGroupBytes + i * kSlice, wv);
          for (int r = 0; r < R; ++r) {
            const __m256i p = slice_pair_sums<kStep>(wv, x.q + (i0 + r) * wstride + g * kGroupBytes + i * kSlice);
            ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(p, sc));
          }
        }
      }
      const __m256i sc = _mm256_loadu_si256(scj + 2);
      const __m256 dv = _mm256_loadu_ps(s0 + j * kbg + gb);
      for (int r = 0; r < R; ++r) {  // - offset * (s0 * x's first-half sum + s1 * its second-half sum)
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + (i0 + r) * x.ss + gb));
        const __m256i v = _mm256_sub_epi32(ia[r], _mm256_slli_epi32(_mm256_madd_epi16(sc, xs), kShift));
        const __m256 xsv = _mm256_loadu_ps(x.s + (i0 + r) * x.ss + gb);
        acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dv, xsv), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) out[j][r] = hsum_ps(acc[j][r]);
}

// The formats with one scale per block: the slices' int16 pair sums widened to int32 from x's offset correction,
// then scaled per block (and the minimum term).
template <Fmt F, int R>
inline void micro_one(const uint8_t* wc, const float* s0, const float* s1, int64_t G, const XP& x, int64_t i0,
                      float out[kNr][kR]) {
  constexpr bool off = Traits<F>::offset != 0;
  const int64_t kbg = G * kGb, wstride = G * kGroupBytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kNr][R];
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t gb = g * kGb;
    __m256i ia[kNr][R];
    for (int r = 0; r < R; ++r) {
      const __m256i c = off ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + (i0 + r) * x.ss + gb))
                            : _mm256_setzero_si256();
      for (int j = 0; j < kNr; ++j) ia[j][r] = c;
    }
    // Slices' pair sums added in int16, then widened by one vpmaddwd: four slices where the codes are below
    // 32 (4 x 2 x 31 x 127 < 2^15), two for Q6_K's (2 x 2 x 63 x 127): the multiplier ports, this kernel's
    // limit, then take 2.5 instructions per 64 products instead of 3.
    constexpr int kStep = Traits<F>::planes <= 1 ? 4 : 2;
    for (int i = 0; i < 8; i += kStep) {
      for (int j = 0; j < kNr; ++j) {
        __m256i wv[kStep];
        load_slices<kStep>(wc + j * wstride + g * kGroupBytes + i * kSlice, wv);
        for (int r = 0; r < R; ++r) {
          const __m256i p = slice_pair_sums<kStep>(wv, x.q + (i0 + r) * wstride + g * kGroupBytes + i * kSlice);
          ia[j][r] = _mm256_add_epi32(ia[j][r], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int j = 0; j < kNr; ++j) {
      const __m256 wsv = _mm256_loadu_ps(s0 + j * kbg + gb);
      for (int r = 0; r < R; ++r)
        acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j][r]),
                                    _mm256_mul_ps(wsv, _mm256_loadu_ps(x.s + (i0 + r) * x.ss + gb)), acc[j][r]);
    }
    if constexpr (Traits<F>::has_min) {
      for (int j = 0; j < kNr; ++j) {
        const __m256 wm = _mm256_loadu_ps(s1 + j * kbg + gb);
        for (int r = 0; r < R; ++r)
          acc[j][r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(x.s + (i0 + r) * x.ss + kbg + gb), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < kNr; ++j)
    for (int r = 0; r < R; ++r) out[j][r] = hsum_ps(acc[j][r]);
}

template <Fmt F, int R>
inline void micro(const uint8_t* wc, const float* s0, const float* s1, int64_t G, const XP& x, int64_t i0,
                  float out[kNr][kR]) {
  if constexpr (F == Q8_0) {
    micro_q8<R>(wc, s0, s1, G, x, i0, out);
  } else if constexpr (Traits<F>::split) {
    micro_split<F, R>(wc, s0, s1, G, x, i0, out);
  } else {
    micro_one<F, R>(wc, s0, s1, G, x, i0, out);
  }
}

#include "panels_driver.inc"

}  // namespace

void panels_avx2_i8(const XP& x, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1) {
  run_any(x, w, bias, y, n0, n1);
}

}  // namespace servelm_quant

#pragma GCC pop_options
