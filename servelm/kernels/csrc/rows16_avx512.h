// The 16-row layout's codes as unsigned bytes, shared by the AVX-512 kernels over it (rows16_avx512_vnni.cpp,
// rows16_amx.cpp): included inside their anonymous namespace, under their target pragmas. Chunk j (0..3) of a
// block of group g: 64 bytes, lane l = weight row 16g + l, its four bytes elements 4j..4j+3 (`lo`, the low
// nibbles) or 16+4j..16+4j+3 (`hi`, the high ones), the fifth bits (q5s) and Q6_K's two high bits added.
#pragma once

template <Fmt F>
struct R16Unpack {
  using T = Traits<F>;
  static constexpr bool split = T::split, plane = T::planes == 1;
  static_assert(T::nibbles && !T::lut && !T::crumb_codes, "a nibble format of the 16-row layout");
  __m512i low4, two;
  __m512i hv;  // the block's fifth bits, or the crumbs of the current pair of chunks
  // (constructors written out: an implicit one would not take the includer's target pragma)
  __attribute__((always_inline)) inline R16Unpack()
      : low4(_mm512_set1_epi8(0x0f)), two(_mm512_set1_epi8(0x30)), hv(_mm512_setzero_si512()) {}

  // Before block b's chunk 0 (hbg: the group's high bits).
  __attribute__((always_inline)) inline void start(const uint8_t* hbg, int64_t b) {
    if constexpr (plane) hv = _mm512_loadu_si512(hbg + b * 64);
  }
  // Chunk j of block b, whose codes start at p; chunks are taken in order 0..3.
  __attribute__((always_inline)) inline void chunk(const uint8_t* p, const uint8_t* hbg, int64_t b, int j,
                                                   __m512i& lo, __m512i& hi) {
    const __m512i raw = _mm512_loadu_si512(p + 64 * j);
    lo = _mm512_and_si512(raw, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    if constexpr (split) {  // Q6_K's two high bits, as +16 and +32 (0x30) over the nibble
      if ((j & 1) == 0) {
        hv = _mm512_loadu_si512(hbg + b * 128 + (j / 2) * 64);
        lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(hv, 4), two, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi16(hv, 2), two, 0xF8);
      } else {
        lo = _mm512_ternarylogic_epi32(lo, hv, two, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi16(hv, 2), two, 0xF8);
      }
    }
    if constexpr (plane) {  // chunk j's fifth bits: byte bit 2j (low nibbles') and 2j + 1 (high), to 0x10
      const __m512i bit = _mm512_set1_epi8(0x10);
      const auto at4 = [&](int from) {  // bit `from` of each byte moved to bit 4 (within the byte)
        return from <= 4 ? _mm512_slli_epi16(hv, 4 - from) : _mm512_srli_epi16(hv, from - 4);
      };
      lo = _mm512_ternarylogic_epi32(lo, at4(2 * j), bit, 0xF8);
      hi = _mm512_ternarylogic_epi32(hi, at4(2 * j + 1), bit, 0xF8);
    }
  }
};

// The fp32 steps of block b for rows i0 .. i0 + R of x, in the one order every AVX-512 kernel over the layout
// keeps (so that their outputs are the same bits, whichever computed the integer sums): `sum(r, h)`, row r's exact
// int32 block sum started from its offset correction (h = 0: the whole block; split formats: h = 0 the first half,
// 1 the second), converted, scaled by (weight scale * x scale) and added to tot[r]; the minimum term after it.
template <Fmt F, int R>
struct R16Steps {
  using T = Traits<F>;
  static constexpr bool kq = T::kquant, split = T::split;
  static constexpr bool minimum = T::has_min && !kq;  // per-block fp16 minimum
  static constexpr bool kmin = T::has_min && kq;      // dmin * 6-bit minimum
  __m512 dsup, msup;
  __attribute__((always_inline)) inline R16Steps() : dsup(_mm512_setzero_ps()), msup(_mm512_setzero_ps()) {}

  template <class Sum>
  __attribute__((always_inline)) inline void block(const R16Tile<F, R>& at, int64_t b, const Sum& sum, __m512* tot) {
    const auto& [qs, dg, mg, scg, hbg, xq, xw, xs, xm, xi] = at;
    if constexpr (kq) {
      if ((b & (kSuper - 1)) == 0) {
        dsup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b / kSuper * 16)));
        if constexpr (kmin)
          msup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b / kSuper * 16)));
      }
    }
    if constexpr (split) {  // an int8 scale per half block: d * scale, exact
      const __m128i* sp = reinterpret_cast<const __m128i*>(scg + b * 32);
      const __m512 d0 = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sp))));
      const __m512 d1 = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sp + 1))));
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(xs[r][b]);
        tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum(r, 0)), _mm512_mul_ps(d0, sx), tot[r]);
        tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum(r, 1)), _mm512_mul_ps(d1, sx), tot[r]);
      }
    } else {
      __m512 dv, mv = _mm512_setzero_ps();
      if constexpr (kmin) {  // d * 6-bit scale and dmin * 6-bit minimum, exact
        const __m128i* sp = reinterpret_cast<const __m128i*>(scg + b * 32);
        dv = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sp))));
        mv = _mm512_mul_ps(msup, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sp + 1))));
      } else {
        dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
        if constexpr (minimum)
          mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * 16)));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 iv = _mm512_cvtepi32_ps(sum(r, 0));
        tot[r] = _mm512_fmadd_ps(iv, _mm512_mul_ps(dv, _mm512_set1_ps(xs[r][b])), tot[r]);
        if constexpr (minimum) tot[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xm[r][b]), tot[r]);
        if constexpr (kmin) tot[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xm[r][b]), tot[r]);
      }
    }
  }
};

// y's rows i0 .. i0 + R for group g: tot (+ the bias).
template <int R>
__attribute__((always_inline)) inline void r16_store(const __m512* tot, const float* bias, float* y, int64_t N,
                                                     int64_t g, int64_t i0) {
  const __m512 bv = bias ? _mm512_loadu_ps(bias + g * 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + (i0 + r) * N + g * 16, bias ? _mm512_add_ps(tot[r], bv) : tot[r]);
}
