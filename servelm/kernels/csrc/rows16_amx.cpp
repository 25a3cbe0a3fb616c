// The 16-row kernel with AMX tiles (Intel Sapphire Rapids and later: AMX-TILE + AMX-INT8) for kAmxMinRows+ rows
// of x (quant_ops.cpp): prompts and large batches over Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K weights interleaved by
// 16 rows (R16W). The same bits as rows16_avx512_vnni.cpp's kernel, which keeps fewer rows (decode, verify steps),
// Q6_K and Q8_0.
//
// A tile multiply (TDPBSUD) takes a block for 16 weight rows and up to 16 rows of x at once: x's codes for the
// block as an R x 32-byte tile A, the block's unpacked codes as an 8 x 64-byte tile B (row t: the 16 weight rows'
// elements 4t..4t+3, which is the 16-row layout's chunk order, low nibbles then high), C = A . B the R x 16 int32
// block sums, where the AVX-512 kernel takes 8 vpdpbusd a row of x. The unpacking and the fp32 steps are the
// AVX-512 kernel's (rows16_avx512.h) and the block sums exact int32 either way, so every output is bitwise the
// AVX-512 kernel's: rows stay batch-invariant across decode and verify rows (AVX-512) and prompt rows (AMX).
//
// What bounds it (docs/measurements/quant-kernels.md, "Thirty-first session"): x's per-block scales need a tile
// store of C every block of 32, and the tile loads, multiply and store of a block cost ~10 ns whatever R is, so
// it gains from ~12 rows on (Q4_K at 16 rows 0.77x the AVX-512 kernel's time, 64 rows 0.62-0.71x); Q6_K, a scale
// per 16 weights, would take two of everything a block and lost at every M.
//
// x comes as its int8 codes in natural order, [M][KB][32] with rows xas bytes apart (`linear_rows16` lays the
// quad layout out again, its rows a cache line longer than KB * 32, so that a tile's 16 rows do not all fall in one
// L1 set). The AMX unit and the vector units work side by side: block b + 2's tiles are issued before block b's
// fp32 steps (two sets of tile registers, three C buffers).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_common.h"

// GCC 11 and clang 12 first took the AMX targets; an older compiler builds the stubs at the end.
#if (defined(__x86_64__) || defined(_M_X64)) && (__GNUC__ >= 11 || __clang_major__ >= 12)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

namespace servelm_quant {
namespace {

#include "rows16_avx512.h"

constexpr int kTileRows = 16;  // rows of x a tile holds (AMX's maximum)

// The tile shapes (palette 1): set s (0, 1) is A 3s (R x 32 bytes), B 3s + 1 (8 x 64), C 3s + 2 (R x 16 int32).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int R) {
  TileConfig c;
  for (int s = 0; s < 2; ++s) {
    c.rows[3 * s] = c.rows[3 * s + 2] = static_cast<uint8_t>(R);
    c.colsb[3 * s] = 32;
    c.rows[3 * s + 1] = 8;
    c.colsb[3 * s + 1] = c.colsb[3 * s + 2] = 64;
  }
  // not _tile_loadconfig: GCC 12's takes its operand as 8 bytes ("m" of a pointer), and stores to the rest of
  // the struct could be dropped as dead
  __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

// Block b's 16 weight rows as tile B's bytes (512: chunks 0..3 low nibbles, then high).
template <Fmt F>
__attribute__((always_inline)) inline void unpack_block(R16Unpack<F>& un, const uint8_t* p, const uint8_t* hbg,
                                                        int64_t b, uint8_t* out) {
  un.start(hbg, b);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m512i lo, hi;
    un.chunk(p, hbg, b, j, lo, hi);
    _mm512_store_si512(out + 64 * j, lo);
    _mm512_store_si512(out + 256 + 64 * j, hi);
  }
}

// Blocks by which the unpacking runs ahead of the tile loads: a tile load of bytes that vector stores have only
// just written waits for them (~28 ns a block at 0 ahead, 13 ns at 3-9 in a microbenchmark; 8 puts the stores
// 4 KB from the loads, which alias).
constexpr int64_t kAhead = 5;
// Blocks whose tile products are issued before a block's fp32 steps read its sums (its C buffer is read once
// the tile store has landed), and the C buffers that takes.
constexpr int64_t kIssueAhead = 2, kSlots = kIssueAhead + 1;

// Rows i0 .. i0 + R of x against group g. UNPACK: this tile unpacks the group's blocks into `gb` (KB x 512
// bytes) as it goes; the group's other tiles (prompts) take them from there. PF: prefetch the group's fields
// ahead (the first tile of a few rows, which waits on the weights' stream).
template <Fmt F, int R, bool UNPACK, bool PF>
void tile(const R16X& x, const int8_t* xa, int64_t xas, const R16W& w, int64_t g, int64_t i0, const float* bias, float* y,
          uint8_t* gb, int32_t* cbuf) {
  using T = Traits<F>;
  static_assert(!T::split, "a format with one scale a block");
  constexpr bool offset = T::offset != 0;
  const R16Tile<F, R> at(x, w, g, i0);
  const auto& [qs, dg, mg, scg, hbg, xq, xw, xs, xm, xi] = at;
  constexpr int64_t qb = R16Tile<F, R>::qb;
  const int64_t KB = w.KB;
  const int8_t* xt = xa + i0 * xas;
  __m512 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
  R16Unpack<F> un;
  R16Steps<F, R> steps;
  constexpr int kC = kTileRows * 16;  // int32 a C buffer
  const auto unpack = [&](int64_t b) {
    if constexpr (PF) at.prefetch(b);
    unpack_block<F>(un, qs + b * qb, hbg, b, gb + b * 512);
  };
  if constexpr (UNPACK)
    for (int64_t b = 0; b < std::min<int64_t>(kAhead, KB); ++b) unpack(b);
  const auto issue = [&](int64_t b) {  // block b's tile products into C buffer b % kSlots
    if constexpr (UNPACK)
      if (b + kAhead < KB) unpack(b + kAhead);
    const uint8_t* bb = gb + b * 512;
    int32_t* c = cbuf + (b % kSlots) * kC;
    if (b & 1) {  // the two sets of tiles in turn
      _tile_loadd(3, xt + b * kBlock, xas);
      _tile_loadd(4, bb, 64);
      _tile_zero(5);
      _tile_dpbsud(5, 3, 4);
      _tile_stored(5, c, 64);
    } else {
      _tile_loadd(0, xt + b * kBlock, xas);
      _tile_loadd(1, bb, 64);
      _tile_zero(2);
      _tile_dpbsud(2, 0, 1);
      _tile_stored(2, c, 64);
    }
  };
  for (int64_t b = 0; b < std::min<int64_t>(kIssueAhead, KB); ++b) issue(b);
  for (int64_t b = 0; b < KB; ++b) {
    if (b + kIssueAhead < KB) issue(b + kIssueAhead);
    const int32_t* c = cbuf + (b % kSlots) * kC;
    steps.block(
        at, b,
        [&](int r, int) {
          const __m512i s = _mm512_load_si512(c + r * 16);
          return offset ? _mm512_add_epi32(s, _mm512_set1_epi32(xi[r][2 * b])) : s;
        },
        tot);
  }
  r16_store<R>(tot, bias, y, w.G * 16, g, i0);
}

template <Fmt F, int R, bool UNPACK, bool PF>
void tile_upto(int n, const R16X& x, const int8_t* xa, int64_t xas, const R16W& w, int64_t g, int64_t i0, const float* bias,
               float* y, uint8_t* gb, int32_t* cbuf) {
  if constexpr (R > 1)
    if (n < R) return tile_upto<F, R - 1, UNPACK, PF>(n, x, xa, xas, w, g, i0, bias, y, gb, cbuf);
  tile<F, R, UNPACK, PF>(x, xa, xas, w, g, i0, bias, y, gb, cbuf);
}

// Rows of x up to which the first tile prefetches (rows16_driver.inc's kPrefetchRows).
constexpr int64_t kPrefetchRows = 16;

// x's rows are walked in blocks of kXBlockBytes of codes, each met by every group of the range: the group's
// first tile of a block unpacks its weights, the others reuse them.
constexpr int64_t kXBlockBytes = 1 << 20;

template <Fmt F>
void run(const R16X& x, const int8_t* xa, int64_t xas, const R16W& w, const float* bias, float* y, int64_t g0, int64_t g1) {
  thread_local std::vector<uint8_t> gbuf;
  alignas(64) int32_t cbuf[kSlots * kTileRows * 16];
  gbuf.resize(w.KB * 512 + 64);
  uint8_t* gb = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(gbuf.data()) + 63) & ~uintptr_t{63});
  const bool pf = x.M <= kPrefetchRows;
  const int64_t mb = std::max<int64_t>(kTileRows, kXBlockBytes / xas / kTileRows * kTileRows);
  int shape = -1;
  for (int64_t m0 = 0; m0 < x.M; m0 += mb) {
    const int64_t m1 = std::min(x.M, m0 + mb);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t i0 = m0; i0 < m1; i0 += kTileRows) {
        const int n = static_cast<int>(std::min<int64_t>(kTileRows, m1 - i0));
        if (n != shape) configure(n), shape = n;
        if (i0 != m0) {
          tile_upto<F, kTileRows, false, false>(n, x, xa, xas, w, g, i0, bias, y, gb, cbuf);
        } else if (pf) {
          tile_upto<F, kTileRows, true, true>(n, x, xa, xas, w, g, i0, bias, y, gb, cbuf);
        } else {
          tile_upto<F, kTileRows, true, false>(n, x, xa, xas, w, g, i0, bias, y, gb, cbuf);
        }
      }
  }
  _tile_release();
}

}  // namespace

bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8; then Linux's permission for the tile data (5.16+)
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void rows16_gemm_amx(const R16X& x, const int8_t* xa, int64_t xas, const R16W& w, const float* bias, float* y, int64_t g0,
                     int64_t g1) {
  switch (w.fmt) {
    case Q4_0: run<Q4_0>(x, xa, xas, w, bias, y, g0, g1); break;
    case Q4_1: run<Q4_1>(x, xa, xas, w, bias, y, g0, g1); break;
    case Q5_0: run<Q5_0>(x, xa, xas, w, bias, y, g0, g1); break;
    case Q5_1: run<Q5_1>(x, xa, xas, w, bias, y, g0, g1); break;
    case Q4_K: run<Q4_K>(x, xa, xas, w, bias, y, g0, g1); break;
    case Q5_K: run<Q5_K>(x, xa, xas, w, bias, y, g0, g1); break;
    default: break;  // the caller checks amx_format
  }
}

}  // namespace servelm_quant

#pragma GCC pop_options
#else
namespace servelm_quant {
bool amx_usable() { return false; }
void rows16_gemm_amx(const R16X&, const int8_t*, int64_t, const R16W&, const float*, float*, int64_t, int64_t) {}
}  // namespace servelm_quant
#endif
