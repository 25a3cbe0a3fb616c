// AVX-512F kernel, outer-product form: 64 weight rows (= output columns) at a time are dequantised into a
// [k][64] fp32 tile (exactly gguf's values; dword permutes put one k of 16 rows in one vector), then
// acc[m][n..n+16] = fma(x[m][k], w[k][n..n+16], acc) for k = 0, 1, ... in order. Each output element is that
// one sequential fp32 sum (plus the bias, last), whatever M is: up to 8 rows keep the accumulators in
// registers across K and dequantise in registers, 16 columns at a time; more rows run a 6 x 64 micro-kernel
// over the whole dequantised tile.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

namespace servelm_quant {
namespace tiles_avx512 {

constexpr int kTile = 64;  // weight rows per tile: 4 vectors of 16
constexpr int kGroups = kTile / 16;
constexpr int kMr = 6;     // rows of x per micro-kernel call
constexpr int kFewRows = 8;  // up to this many rows of x: weights dequantised in registers, no tile
constexpr int64_t kKc = 128;  // k per pass of the micro-kernel over all rows (128 x 64 fp32 = 32 KB)

// 16 rows x 16 bytes (row i at p + i * stride) -> out[c] (c = 0..3): dword i = bytes 4c..4c+3 of row i.
// Rows go four to a register, then eight two-source dword permutes regroup them (not 64 byte unpacks).
static inline void regroup16(const uint8_t* p, int64_t stride, __m512i out[4]) {
  __m512i a[4];
  for (int r = 0; r < 4; ++r) {
    const uint8_t* q = p + 4 * r * stride;
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + stride)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * stride)), 2);
    a[r] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 3 * stride)), 3);
  }
  // rows 0..7 (a[0], a[1]) or 8..15 (a[2], a[3]): [col 0 of the 8 rows, col 1] and [col 2, col 3]
  const __m512i cols01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i cols23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i lo01 = _mm512_permutex2var_epi32(a[0], cols01, a[1]);
  const __m512i lo23 = _mm512_permutex2var_epi32(a[0], cols23, a[1]);
  const __m512i hi01 = _mm512_permutex2var_epi32(a[2], cols01, a[3]);
  const __m512i hi23 = _mm512_permutex2var_epi32(a[2], cols23, a[3]);
  out[0] = _mm512_permutex2var_epi32(lo01, first, hi01);
  out[1] = _mm512_permutex2var_epi32(lo01, second, hi01);
  out[2] = _mm512_permutex2var_epi32(lo23, first, hi23);
  out[3] = _mm512_permutex2var_epi32(lo23, second, hi23);
}

// The 16 rows of group g, block b, bytes [16 * half, 16 * half + 16) of the payload, regrouped (rows past N
// read as zeros).
static inline void group_bytes(const QWeight& w, int64_t t0, int g, int64_t b, int half, __m512i out[4]) {
  const int64_t payload = fmt_payload(w.fmt);
  const int64_t stride = w.KB * payload;
  const int64_t n0 = t0 + g * 16;
  if (fmt_crumb_codes(w.fmt)) {  // Q2_K, Q3_K: each row's crumbs as nibble pairs (crumb_nibbles; planes after)
    alignas(64) uint8_t rows[16 * 16] = {0};
    for (int64_t i = 0; i < 16 && n0 + i < w.N; ++i)
      _mm_store_si128(reinterpret_cast<__m128i*>(rows + i * 16),
                      crumb_nibbles(code_crumbs(w, n0 + i), b, fmt_crumb_base(w.fmt)));
    regroup16(rows, 16, out);
    return;
  }
  const uint8_t* p = w.qs + n0 * stride + b * payload + half * 16;
  if (n0 + 16 <= w.N) {
    regroup16(p, stride, out);
    return;
  }
  alignas(64) uint8_t rows[16 * 16] = {0};
  for (int64_t i = 0; i < w.N - n0; ++i) std::memcpy(rows + i * 16, p + i * stride, 16);
  regroup16(rows, 16, out);
}

// Bytes of codes a block as group_bytes hands them out: the payload, or for the crumb formats (Q2_K, Q3_K) the 16
// bytes of nibble pairs it makes of them.
static inline int code_bytes(Fmt f) { return fmt_crumb_codes(f) ? 16 : static_cast<int>(fmt_payload(f)); }

// Plane p's words of the 16 rows of group g, block b (zeros for rows past N or no such plane).
static inline __m512i group_plane(int p, const QWeight& w, int64_t t0, int g, int64_t b) {
  if (fmt_planes(w.fmt) <= p) return _mm512_setzero_si512();
  alignas(64) uint32_t h[16] = {0};
  const int64_t n0 = t0 + g * 16;
  for (int64_t i = 0; i < 16 && n0 + i < w.N; ++i) h[i] = block_plane(w, p, n0 + i, b);
  return _mm512_load_si512(h);
}

// A nibble (the low 4 bits of each lane of `v`; higher bits are ignored), plus the plane bits k of `p0` (+16)
// and `p1` (+32), -> its code as a float: (code - offset), exact (IQ4_NL, IQ4_XS: the nibble's table value).
// vpermps reads the low 4 bits of each index lane; the q5 formats' 32 codes take the two-table vpermt2ps, which
// reads 5; Q6_K's 64 are computed.
struct CodeTable {
  __m512 lo, hi;
  int planes;
  __m512i offset;
  bool plane4;  // Q3_K: plane 0 is its codes' third bit (+4) over a crumb: codes 0..7, the 16-entry table
  explicit CodeTable(Fmt f)
      : planes(fmt_planes(f)), offset(_mm512_set1_epi32(fmt_offset(f))), plane4(fmt_plane_value(f) == 4) {
    lo = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_ps(static_cast<float>(fmt_offset(f))));
    if (fmt_lut(f))
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values))));
    hi = _mm512_add_ps(lo, _mm512_set1_ps(16.0f));
  }
  __m512 lookup(__m512i v, __m512i p0, __m512i p1, int k) const {
    if (planes == 0) return _mm512_permutexvar_ps(v, lo);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i b0 = _mm512_and_si512(_mm512_srl_epi32(p0, _mm_cvtsi32_si128(k)), one);
    if (plane4) return _mm512_permutexvar_ps(_mm512_or_si512(v, _mm512_slli_epi32(b0, 2)), lo);
    __m512i idx = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(15)), _mm512_slli_epi32(b0, 4));
    if (planes == 1) return _mm512_permutex2var_ps(lo, idx, hi);
    const __m512i b1 = _mm512_and_si512(_mm512_srl_epi32(p1, _mm_cvtsi32_si128(k)), one);
    idx = _mm512_or_si512(idx, _mm512_slli_epi32(b1, 5));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(idx, offset));
  }
};

// Per tile: fp32 scales (and mins; Q6_K: the second half's scales) transposed to [block][64 rows]; rows past
// N get zeros.
struct TileScales {
  std::vector<float> d, m, row0, row1;
  void load(const QWeight& w, int64_t t0) {
    const int64_t kb = w.KB;
    const bool second = fmt_has_min(w.fmt) || fmt_split(w.fmt);
    d.assign(kb * kTile, 0.0f);
    if (second) m.assign(kb * kTile, 0.0f);
    row0.resize(kb);
    row1.resize(kb);
    for (int r = 0; r < kTile && t0 + r < w.N; ++r) {
      row_scales_ref(w, t0 + r, row0.data(), row1.data(), kb);
      for (int64_t b = 0; b < kb; ++b) d[b * kTile + r] = row0[b];
      if (second)
        for (int64_t b = 0; b < kb; ++b) m[b * kTile + r] = row1[b];
    }
  }
};

static inline void store_ps(float* o, __m512i q, __m512 dv, const __m512* mv) {
  __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(q), dv);
  _mm512_storeu_ps(o, mv ? _mm512_add_ps(f, *mv) : f);
}

// Block b of the tile's rows, dequantised into out[k][64] (k = 0..31 of the block, row stride kTile).
static void dequant_block(const QWeight& w, int64_t t0, int64_t b, const TileScales& sc, float* out) {
  const int payload = code_bytes(w.fmt);
  const CodeTable table(w.fmt);
  const bool has_min = fmt_has_min(w.fmt), split = fmt_split(w.fmt);
  for (int g = 0; g < kGroups; ++g) {
    const __m512 dv = _mm512_loadu_ps(sc.d.data() + b * kTile + g * 16);
    const __m512 mv = has_min || split ? _mm512_loadu_ps(sc.m.data() + b * kTile + g * 16) : _mm512_setzero_ps();
    const __m512i p0 = group_plane(0, w, t0, g, b), p1 = group_plane(1, w, t0, g, b);
    float* o = out + g * 16;
    for (int half = 0; half < payload / 16; ++half) {
      __m512i cols[4];
      group_bytes(w, t0, g, b, half, cols);
      for (int j = 0; j < 16; ++j) {
        const __m512i v = cols[j / 4];
        const int s = 8 * (j % 4);
        if (w.fmt == Q8_0) {  // signed byte j of each row
          const __m512i q = _mm512_srai_epi32(_mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - s)), 24);
          _mm512_storeu_ps(o + (half * 16 + j) * kTile, _mm512_mul_ps(_mm512_cvtepi32_ps(q), dv));
          continue;
        }
        for (int nib = 0; nib < 2; ++nib) {
          const __m512 q = table.lookup(_mm512_srl_epi32(v, _mm_cvtsi32_si128(s + 4 * nib)), p0, p1, j + 16 * nib);
          const __m512 f = _mm512_mul_ps(q, split && nib ? mv : dv);
          _mm512_storeu_ps(o + (j + 16 * nib) * kTile, has_min ? _mm512_add_ps(f, mv) : f);
        }
      }
    }
  }
}

// acc[i][v] += x[i][k] * w[k][16v..16v+16] for k in [k0, k1), in order.
template <int R>
static inline void fma_rows(const float* x, int64_t kp, const float* w, int64_t k0, int64_t k1, __m512 (&acc)[R][4]) {
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + (k - k0) * kTile;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int i = 0; i < R; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * kp + k]);
      acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(xb, w3, acc[i][3]);
    }
  }
}

template <int R>
static inline void store_rows(__m512 (&acc)[R][4], float* y, int64_t ldy, const float* bias, int64_t cols) {
  for (int v = 0; v < 4; ++v) {
    const int64_t c = std::clamp<int64_t>(cols - v * 16, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << c) - 1u);
    if (!mask) break;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(y + i * ldy + v * 16, mask, bias ? _mm512_add_ps(acc[i][v], bv) : acc[i][v]);
  }
}

// One 16-row group of block b, dequantised in registers straight into the accumulators of those 16 columns:
// acc[i] += x[i][k] * w[k][group] for the block's k in order (the same values and order as the tile path).
template <int R>
static inline void group_block(const QWeight& w, int64_t t0, int g, int64_t b, const TileScales& sc, const float* x,
                               int64_t kp, __m512 (&acc)[R]) {
  const int payload = code_bytes(w.fmt);
  const CodeTable table(w.fmt);
  const bool has_min = fmt_has_min(w.fmt), split = fmt_split(w.fmt);
  const __m512 dv = _mm512_loadu_ps(sc.d.data() + b * kTile + g * 16);
  const __m512 mv = has_min || split ? _mm512_loadu_ps(sc.m.data() + b * kTile + g * 16) : _mm512_setzero_ps();
  const __m512i p0 = group_plane(0, w, t0, g, b), p1 = group_plane(1, w, t0, g, b);
  for (int half = 0; half < payload / 16; ++half) {
    __m512i cols[4];
    group_bytes(w, t0, g, b, half, cols);
    for (int nib = 0; nib < (payload == 16 ? 2 : 1); ++nib) {  // q4: low nibbles are k 0..15, high ones 16..31
      const float* xk = x + b * kBlock + (half + nib) * 16;
      for (int j = 0; j < 16; ++j) {
        const int s = 8 * (j % 4);
        __m512 wv;
        if (w.fmt == Q8_0) {
          const __m512i q = _mm512_srai_epi32(_mm512_sll_epi32(cols[j / 4], _mm_cvtsi32_si128(24 - s)), 24);
          wv = _mm512_mul_ps(_mm512_cvtepi32_ps(q), dv);
        } else {
          const __m512 q =
              table.lookup(_mm512_srl_epi32(cols[j / 4], _mm_cvtsi32_si128(s + 4 * nib)), p0, p1, j + 16 * nib);
          wv = _mm512_mul_ps(q, split && nib ? mv : dv);
          if (has_min) wv = _mm512_add_ps(wv, mv);
        }
        for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i * kp + j]), wv, acc[i]);
      }
    }
  }
}

// Up to 8 rows: accumulators stay in registers across all of K; weights are dequantised in registers.
template <int R>
static void tile_few_rows(const float* x, const QWeight& w, const TileScales& sc, int64_t t0, float* y,
                          const float* bias) {
  const int64_t kp = w.KB * kBlock;
  __m512 acc[R][4];
  for (int g = 0; g < kGroups; ++g) {
    __m512 a[R];
    for (int i = 0; i < R; ++i) a[i] = _mm512_setzero_ps();
    if (t0 + g * 16 < w.N)
      for (int64_t b = 0; b < w.KB; ++b) group_block<R>(w, t0, g, b, sc, x, kp, a);
    for (int i = 0; i < R; ++i) acc[i][g] = a[i];
  }
  store_rows<R>(acc, y + t0, w.N, bias ? bias + t0 : nullptr, w.N - t0);
}

// Rows of x over k in [k0, k1) of the dequantised tile (`tile` points at row k0). Between chunks of K the
// running sums wait in y, exactly (fp32 store and reload); the bias is added after the last chunk.
template <int R>
static void rows_over_tile(const float* x, int64_t kp, const float* tile, int64_t k0, int64_t k1, float* y,
                           int64_t ldy, const float* bias, int64_t cols) {
  __m512 acc[R][4];
  for (int v = 0; v < 4; ++v) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::clamp<int64_t>(cols - v * 16, 0, 16)) - 1u);
    for (int i = 0; i < R; ++i)
      acc[i][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + i * ldy + v * 16);
  }
  fma_rows<R>(x, kp, tile, k0, k1, acc);
  store_rows<R>(acc, y, ldy, k1 == kp ? bias : nullptr, cols);
}

static void few_rows(int r, const float* x, const QWeight& w, const TileScales& sc, int64_t t0, float* y,
                     const float* bias) {
  switch (r) {
    case 1: tile_few_rows<1>(x, w, sc, t0, y, bias); break;
    case 2: tile_few_rows<2>(x, w, sc, t0, y, bias); break;
    case 3: tile_few_rows<3>(x, w, sc, t0, y, bias); break;
    case 4: tile_few_rows<4>(x, w, sc, t0, y, bias); break;
    case 5: tile_few_rows<5>(x, w, sc, t0, y, bias); break;
    case 6: tile_few_rows<6>(x, w, sc, t0, y, bias); break;
    case 7: tile_few_rows<7>(x, w, sc, t0, y, bias); break;
    default: tile_few_rows<8>(x, w, sc, t0, y, bias); break;
  }
}

static void many_rows(int r, const float* x, int64_t kp, const float* tile, int64_t k0, int64_t k1, float* y,
                      int64_t ldy, const float* bias, int64_t cols) {
  switch (r) {
    case 1: rows_over_tile<1>(x, kp, tile, k0, k1, y, ldy, bias, cols); break;
    case 2: rows_over_tile<2>(x, kp, tile, k0, k1, y, ldy, bias, cols); break;
    case 3: rows_over_tile<3>(x, kp, tile, k0, k1, y, ldy, bias, cols); break;
    case 4: rows_over_tile<4>(x, kp, tile, k0, k1, y, ldy, bias, cols); break;
    case 5: rows_over_tile<5>(x, kp, tile, k0, k1, y, ldy, bias, cols); break;
    default: rows_over_tile<6>(x, kp, tile, k0, k1, y, ldy, bias, cols); break;
  }
}

}  // namespace tiles_avx512

// Tiles of 64 rows starting at n0 (n0 a multiple of 64) up to n1; `buf` holds KB * 32 * 64 floats.
void tiles_gemm_avx512(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t n0, int64_t n1,
                 float* buf, int64_t /*nb*/) {
  using namespace tiles_avx512;
  const int64_t kp = w.KB * kBlock;
  thread_local TileScales sc;  // reused: no allocation per tile
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    sc.load(w, t0);
    if (M <= kFewRows) {
      few_rows(static_cast<int>(M), x, w, sc, t0, y, bias);
      continue;
    }
    for (int64_t b = 0; b < w.KB; ++b) dequant_block(w, t0, b, sc, buf + b * kBlock * kTile);
    const int64_t cols = std::min(n1, w.N) - t0;
    for (int64_t k0 = 0; k0 < kp; k0 += kKc) {  // a 32 KB slice of the tile stays in L1 for all rows
      const int64_t k1 = std::min(kp, k0 + kKc);
      for (int64_t m0 = 0; m0 < M; m0 += kMr) {
        const int r = static_cast<int>(std::min<int64_t>(kMr, M - m0));
        many_rows(r, x + m0 * kp, kp, buf + k0 * kTile, k0, k1, y + m0 * w.N + t0, w.N, bias ? bias + t0 : nullptr,
                  cols);
      }
    }
  }
}

}  // namespace servelm_quant

#pragma GCC pop_options
