// torch ops `servelm_quant::*`: run-time ISA dispatch and threading (torch's intra-op pool) around the kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "quant_common.h"

namespace servelm_quant {
namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int64_t best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

GemmFn gemm_for(int64_t isa) {
  TORCH_CHECK(isa >= kScalar && isa <= best_isa(), "servelm_quant: ISA level ", isa, " is not available here");
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == kAvx512) return gemm_avx512;
  if (isa == kAvx2) return gemm_avx2;
#endif
  return gemm_scalar;
}

// Weight rows dequantised per tile: an L1-sized tile for a few rows of x (decode), an L2-sized one for
// prefill (the AVX-512 kernel has fixed 64-row tiles); never fewer tiles than ~4 per thread so the pool stays balanced. Numerics do not depend on it.
int64_t rows_per_tile(int64_t M, int64_t N, int64_t kp, int64_t isa) {
  if (isa == kAvx512) return 64;  // its own tile width
  const int64_t budget = M <= 8 ? (32 << 10) : (256 << 10);
  int64_t nb = std::clamp<int64_t>(budget / (kp * 4), 12, 96) / 12 * 12;
  const int64_t per_thread = (N + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  nb = std::min(nb, std::max<int64_t>(12, (per_thread + 11) / 12 * 12));
  return nb;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m,
                  int64_t fmt, const std::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, KB*32]");
  TORCH_CHECK(fmt >= Q8_0 && fmt <= Q4_1, "unknown format ", fmt);
  const int64_t N = qs.size(0), KB = qs.size(1), M = x.size(0), kp = KB * kBlock;
  TORCH_CHECK(x.size(1) == kp, "x has ", x.size(1), " columns, the weight ", kp);
  TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1 && qs.size(2) == (fmt == Q8_0 ? 32 : 16), "qs layout");
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.size(0) == N && d.size(1) == KB, "d layout");
  const bool has_m = m.has_value() && m->defined();
  TORCH_CHECK(has_m == (fmt == Q4_1), "m is given exactly for q4_1");
  if (has_m) TORCH_CHECK(m->is_contiguous() && m->scalar_type() == at::kHalf && m->sizes() == d.sizes(), "m layout");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QWeight w{static_cast<const uint8_t*>(qs.data_ptr()), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                  has_m ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr, N, KB, static_cast<Fmt>(fmt)};
  const GemmFn fn = gemm_for(isa);
  const int64_t nb = rows_per_tile(M, N, kp, isa);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + nb - 1) / nb, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < nb * kp) buf.resize(nb * kp);
    fn(xp, M, w, bp, yp, t0 * nb, std::min(N, t1 * nb), buf.data(), nb);
  });
  return y;
}

}  // namespace
}  // namespace servelm_quant

TORCH_LIBRARY(servelm_quant, lib) {
  lib.def("best_isa() -> int", &servelm_quant::best_isa);
  lib.def("linear(Tensor x, Tensor qs, Tensor d, Tensor? m, int fmt, Tensor? bias, int isa) -> Tensor",
          &servelm_quant::linear);
}
