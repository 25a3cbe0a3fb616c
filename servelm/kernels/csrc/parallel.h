// Work stealing over the threads of at::parallel_for, shared by the quantised matmuls (quant_ops.cpp) and the
// fused prefill and decode attention (fused_ops.cpp). A static split (one fixed share a thread) makes every
// thread wait at the region's end for the slowest one: on a shared 2-vCPU VM the two threads lose their cores in
// turn (to other processes, to the hypervisor's steal time the thread governor cannot see, or to a hyperthread
// sibling). Here each thread takes the next chunk from an atomic counter until none is left, as ggml's mul_mat
// shares its chunks; a chunk's work must not depend on which thread runs it (every caller's outputs are bitwise
// those of one thread).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace servelm_parallel {

// fn(c) for every chunk c in [0, n), on the threads by work stealing (inside a parallel region: on this one)
template <typename Fn>
void steal_chunks(int64_t n, const Fn& fn) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt < 2 || at::in_parallel_region()) {
    for (int64_t c = 0; c < n; ++c) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(c);
  });
}

// fn(i0, i1) over [0, n) in about `chunks` runs of consecutive items (at least one), taken by work stealing
template <typename Fn>
void steal_range(int64_t n, int64_t chunks, const Fn& fn) {
  if (n <= 0) return;
  const int64_t parts = std::clamp<int64_t>(chunks, 1, n), run = (n + parts - 1) / parts;
  steal_chunks((n + run - 1) / run, [&](int64_t c) { fn(c * run, std::min(n, (c + 1) * run)); });
}

}  // namespace servelm_parallel
