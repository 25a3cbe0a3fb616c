// Software prefetches that GCC keeps, for quant_common.h's kernels and fused_ops.cpp's attention. GCC models
// __builtin_prefetch as free of side effects, so its IPA found a function that only prefetches (R16Tile::prefetch,
// attend_unit's fetch lambda) pure and deleted every call to it: with GCC 12.2 the 16-row kernels and decode
// attention over fp32, bf16 and f16 caches had compiled without one prefetch instruction. An asm volatile is never
// deleted. Locality 3 into L1 (prefetcht0), 2 into L2 (prefetcht1).
#pragma once

namespace servelm_prefetch {

template <int Locality>
inline void prefetch_read(const void* p) {
  static_assert(Locality == 2 || Locality == 3, "prefetcht0 or prefetcht1");
#if defined(__x86_64__)
  if constexpr (Locality == 3) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p, 0, Locality);
#endif
}

}  // namespace servelm_prefetch
