// torch ops `servelm_fused::*`: the small per-token ops of a decoder layer fused into one call each (RMSNorm with
// and without the residual add, rotary embedding, SiLU-and-multiply, decode attention over the paged KV cache),
// fp32 on CPU. At batch 1 a decode step is dominated by the dispatch of ~75 tiny torch ops per layer; each of
// these replaces 3 to 15 of them. Run-time ISA dispatch (AVX-512, AVX2, SSE2) as in quant_ops.cpp; threads
// (torch's intra-op pool) only above a grain of work, since for one token a fork/join costs more than the op.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "parallel.h"
#include "prefetch.h"

namespace servelm_quant {
at::Tensor linear_call(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& qh,
                       const std::optional<at::Tensor>& qh2, const std::optional<at::Tensor>& sc, int64_t fmt,
                       const std::optional<at::Tensor>& bias, int64_t isa, bool tiles);
}  // namespace servelm_quant

namespace servelm_fused {

// KV-cache storage types (servelm/mem_cache/memory_pool.py): fp32, bf16, fp16, fp8 e4m3 / e5m2 without a
// scale, int8 with a float16 scale per token and KV head.
enum KvType : int { kKvF32 = 0, kKvBF16 = 1, kKvF16 = 2, kKvE4M3 = 3, kKvE5M2 = 4, kKvI8 = 5 };

// Bytes per stored value of each KV type (the kernels' kv_size<KT>() too).
constexpr int64_t kv_elem_size(int type) { return type == kKvF32 ? 4 : (type == kKvBF16 || type == kKvF16) ? 2 : 1; }

// Keys per unit of decode attention (see fused_kernels.inc): a chunk's K (or V) decoded to fp32 is 32 KiB at
// head_dim 64, inside L1/L2, and a 16k context gives 128 units per KV head to spread over the threads.
constexpr int64_t kAttnChunk = 128;

// One layer's caches [slots, Hkv, D] and, for int8, their float16 scales [slots, Hkv].
struct KvView {
  void* k;
  void* v;
  uint16_t* ks;
  uint16_t* vs;
  int type;
};

// A decode-attention call: q [B, H, D]; request b attends to the slots index[b, 0 .. lens[b]). Item i = (b, hk)
// has chunks of kAttnChunk keys whose partials are partial[item_first[i] + c] ([g][D + 2] each); units (rows
// units[4u] .. + units[4u + 1], chunk units[4u + 2], kv heads units[4u + 3] .. + heads_per_unit) compute them,
// a unit's rows seeing the same keys, each one more than the last (fused_kernels.inc attend_unit). out [B, H * D].
constexpr int64_t kMaxUnitRows = 16;
struct DecodeWork {
  const float* q;
  KvView kv;
  const int64_t* index;
  const int64_t* lens;
  float scale;
  int64_t H, Hkv, D, L;
  int64_t heads_per_unit;
  const int64_t* units;
  const int64_t* item_first;
  float* partial;
  float* out;
};

// A prefill-attention call (fused_kernels.inc, prefill_units): request r's n new queries are rows
// q_start .. q_start + n of q [T, H, D], at positions seq_len - n .. seq_len - 1, and attend causally (or, not
// `causal`, all of them: an encoder) to the slots index[index_off .. index_off + seq_len) (reqs[r] = {q_start, n,
// seq_len, index_off}). Unit u = (request
// units[3u], kv head units[3u + 1], queries units[3u + 2] .. + qb): its qb * g query rows, padded to rows (a
// multiple of W). out [T, H * D] (the covered rows).
struct PrefillWork {
  const float* q;
  KvView kv;
  const int64_t* index;
  const int64_t* reqs;
  float scale;
  int64_t H, Hkv, D, qb, rows;
  const int64_t* units;
  float* out;
  bool causal;
};

// A prefill unit's working floats (fused_kernels.inc, prefill_unit): queries and outputs [D][rows], one chunk's
// scores [kAttnChunk][rows], the row statistics, the chunk's K then V [kAttnChunk][D], a zero row, the scales.
constexpr int64_t prefill_buf_floats(int64_t D, int64_t rows) {
  return 2 * D * rows + kAttnChunk * rows + 3 * rows + kAttnChunk * D + D + 2 * kAttnChunk;
}

// One ISA's kernels; each runs on a range of rows (tokens, or (request, kv head) items) so the ops can split it
// across threads.
struct Kernels {
  void (*rms_norm)(const float* x, const float* res, const float* w, float eps, float* y, float* s, int64_t D,
                   int64_t r0, int64_t r1);
  void (*rotary)(const int64_t* pos, const float* x, int64_t xs, int64_t H, int64_t D, const float* cos,
                 const float* sin, float* out, const int64_t* out_rows, int64_t t0, int64_t t1);
  void (*silu_and_mul)(const float* gu, float* y, int64_t I, int64_t r0, int64_t r1);
  void (*attend_units)(const DecodeWork& w, int64_t u0, int64_t u1, float* scores, float* kbuf);
  void (*merge_items)(const DecodeWork& w, int64_t i0, int64_t i1);
  void (*encode_row)(int kt, const float* x, int64_t D, void* dst, uint16_t* scale);
  void (*prefill_units)(const PrefillWork& w, int64_t u0, int64_t u1, float* buf);
  void (*argmax_rows)(const float* x, int64_t V, int64_t* out, int64_t r0, int64_t r1);
  int64_t width;  // W: floats per vector
};

namespace sse2 {
#define SERVELM_W 4
#include "fused_kernels.inc"
#undef SERVELM_W
}  // namespace sse2

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#define SERVELM_W 8
#include "fused_kernels.inc"
#undef SERVELM_W
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,f16c")
namespace avx512 {
#define SERVELM_W 16
#include "fused_kernels.inc"
#undef SERVELM_W
}  // namespace avx512
#pragma GCC pop_options

// AVX-512 with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids on): the same kernels, but decode and prefill
// attention over a bf16 cache take their products as vdpbf16ps (attend_unit, prefill_unit).
#pragma GCC push_options
#pragma GCC target("avx512f,f16c,avx512bw,avx512bf16")
namespace avx512bf16 {
#define SERVELM_W 16
#define SERVELM_BF16DOT 1
#include "fused_kernels.inc"
#undef SERVELM_BF16DOT
#undef SERVELM_W
}  // namespace avx512bf16
#pragma GCC pop_options
#endif

namespace {

enum Isa : int64_t { kSse2 = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

int64_t best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") ? kAvx512Bf16 : kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kSse2;
}

std::atomic<int64_t> g_isa{-1};

const Kernels& kernels() {
  int64_t isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = best_isa();
    g_isa.store(isa, std::memory_order_relaxed);
  }
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == kAvx512Bf16) return avx512bf16::kernels;
  if (isa == kAvx512) return avx512::kernels;
  if (isa == kAvx2) return avx2::kernels;
#endif
  return sse2::kernels;
}

// The ISA the ops use now.
int64_t current_isa() {
  kernels();  // resolves the default
  return g_isa.load(std::memory_order_relaxed);
}

// The ISA every op uses from now on (tests run each path): -1 = the best this CPU has. Returns the one in use.
int64_t set_isa(int64_t isa) {
  const int64_t best = best_isa();
  TORCH_CHECK(isa >= -1 && isa <= best, "servelm_fused: ISA level ", isa, " is not available here (best ", best,
              ")");
  g_isa.store(isa < 0 ? best : isa, std::memory_order_relaxed);
  return g_isa.load();
}

// Elements of work below which an op runs on the calling thread.
constexpr int64_t kGrainElems = 1 << 15;

int64_t grain(int64_t per_row) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, per_row)); }

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "servelm_fused: ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

void check_contig_f32(const at::Tensor& t, const char* name) {
  check_f32(t, name);
  TORCH_CHECK(t.is_contiguous(), "servelm_fused: ", name, " must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x, const at::Tensor* residual,
                                             const at::Tensor& weight, double eps) {
  check_contig_f32(x, "x");
  check_contig_f32(weight, "weight");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "servelm_fused: x's last dim (",
              x.dim() ? x.size(-1) : 0, ") must equal weight's size (", weight.numel(), ")");
  const int64_t D = weight.size(0), N = D ? x.numel() / D : 0;
  at::Tensor y = at::empty_like(x);
  at::Tensor s;
  const float* res = nullptr;
  if (residual != nullptr) {
    check_contig_f32(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "servelm_fused: residual's shape ", residual->sizes(),
                " differs from x's ", x.sizes());
    res = residual->data_ptr<float>();
    s = at::empty_like(x);
  }
  if (N == 0 || D == 0) return {y, s};
  const Kernels& k = kernels();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = s.defined() ? s.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain(D), [&](int64_t r0, int64_t r1) { k.rms_norm(xp, res, wp, e, yp, sp, D, r0, r1); });
  return {y, s};
}

// weight * (x * rsqrt(mean(x^2, -1) + eps)) over the last dim.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm_impl(x, nullptr, weight, eps));
}

// (rms_norm(x + residual), x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm_impl(x, &residual, weight, eps);
}

void check_heads(const at::Tensor& x, const char* name, int64_t T, int64_t D) {
  check_f32(x, name);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == T && x.size(2) == D, "servelm_fused: ", name, " must be [T=", T,
              ", heads, D=", D, "], got ", x.sizes());
  TORCH_CHECK(x.stride(2) == 1 && (x.size(1) <= 1 || x.stride(1) == D) && (T <= 1 || x.stride(0) >= x.size(1) * D),
              "servelm_fused: ", name, " must have contiguous [heads, D] rows");
}

at::Tensor rotate(const Kernels& k, const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos,
                  const at::Tensor& sin) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  at::Tensor out = at::empty({T, H, D}, x.options());
  if (T == 0 || H == 0) return out;
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const int64_t xs = T > 1 ? x.stride(0) : H * D;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(H * D),
                   [&](int64_t t0, int64_t t1) { k.rotary(pp, xp, xs, H, D, cp, sp, op, nullptr, t0, t1); });
  return out;
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), "servelm_fused: ", name,
              " must be a contiguous int64 CPU tensor");
}

// Checks positions [T] (inside the cache) and the caches cos/sin [P, D/2]; returns T.
int64_t check_positions(const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_index(positions, "positions");
  TORCH_CHECK(positions.dim() == 1, "servelm_fused: positions must be [T]");
  check_contig_f32(cos, "cos");
  check_contig_f32(sin, "sin");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes(), "servelm_fused: cos/sin must be [P, D/2]");
  const int64_t T = positions.size(0), P = cos.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "servelm_fused: position ", pp[t], " outside the rotary cache [0, ", P, ")");
  }
  return T;
}

// Rotate-half rotary embedding of q [T, H, D] and k [T, Hkv, D] (rows of [heads, D] may be strided, e.g. views
// of a fused qkv) at positions [T], with cos/sin caches [P, D/2] -> contiguous (q, k).
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T = check_positions(positions, cos, sin), D = 2 * cos.size(1);
  check_heads(q, "q", T, D);
  check_heads(k, "k", T, D);
  const Kernels& kk = kernels();
  return {rotate(kk, positions, q, cos, sin), rotate(kk, positions, k, cos, sin)};
}

int kv_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kKvF32;
    case at::kBFloat16: return kKvBF16;
    case at::kHalf: return kKvF16;
    case at::kFloat8_e4m3fn: return kKvE4M3;
    case at::kFloat8_e5m2: return kKvE5M2;
    case at::kChar: return kKvI8;
    default: TORCH_CHECK(false, "servelm_fused: a KV cache of ", t, " is not supported");
  }
  return kKvF32;
}

// Checks one layer's caches k_cache, v_cache [slots, Hkv, D] (and int8's scales [slots, Hkv]).
KvView kv_view(const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
               const std::optional<at::Tensor>& v_scale, int64_t D) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "servelm_fused: k_cache and v_cache must be contiguous CPU tensors of one dtype");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == D,
              "servelm_fused: k_cache and v_cache must be [slots, Hkv, D=", D, "] alike, got ", k_cache.sizes());
  KvView kv{k_cache.data_ptr(), v_cache.data_ptr(), nullptr, nullptr, kv_type(k_cache.scalar_type())};
  const bool scaled = kv.type == kKvI8;
  TORCH_CHECK(scaled == (k_scale.has_value() && k_scale->defined()) &&
                  scaled == (v_scale.has_value() && v_scale->defined()),
              "servelm_fused: an int8 KV cache takes k_scale and v_scale, other dtypes none");
  if (scaled) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1),
                  "servelm_fused: KV scales must be contiguous float16 [slots, Hkv]");
    }
    kv.ks = reinterpret_cast<uint16_t*>(k_scale->data_ptr());
    kv.vs = reinterpret_cast<uint16_t*>(v_scale->data_ptr());
  }
  return kv;
}

// The attention input of a layer from its fused projection qkv [T, (H + 2 Hkv) D] (rows may be strided): returns
// q [T, H, D] rotated, and writes k rotated and v into k_cache, v_cache [slots, Hkv, D] at the slots
// out_cache_loc [T] (what split + views + rotary + two index_copy_ do), encoded in the caches' dtype
// (memory_pool.encode's bits; int8 also writes the scales).
at::Tensor qkv_rotary_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            const at::Tensor& out_cache_loc, int64_t H) {
  const int64_t T = check_positions(positions, cos, sin), D = 2 * cos.size(1);
  check_f32(qkv, "qkv");
  const KvView kv = kv_view(k_cache, v_cache, k_scale, v_scale, D);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(0), width = (H + 2 * Hkv) * D;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == T && qkv.size(1) == width && qkv.stride(1) == 1 &&
                  (T <= 1 || qkv.stride(0) >= width),
              "servelm_fused: qkv must be [T=", T, ", (H + 2 Hkv) D=", width, "] with contiguous rows, got ",
              qkv.sizes());
  check_index(out_cache_loc, "out_cache_loc");
  TORCH_CHECK(out_cache_loc.dim() == 1 && out_cache_loc.size(0) == T, "servelm_fused: out_cache_loc must be [T]");
  const int64_t* lp = out_cache_loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lp[t] >= 0 && lp[t] < S, "servelm_fused: cache slot ", lp[t], " outside [0, ", S, ")");
  }
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  if (T == 0) return q;
  const Kernels& k = kernels();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* xp = qkv.data_ptr<float>();
  const int64_t xs = T > 1 ? qkv.stride(0) : width;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t es = kv_elem_size(kv.type);
  std::vector<int64_t> zero_rows(kv.type == kKvF32 ? 0 : T, 0);
  at::parallel_for(0, T, grain(width), [&](int64_t t0, int64_t t1) {
    k.rotary(pp, xp, xs, H, D, cp, sp, qp, nullptr, t0, t1);
    if (kv.type == kKvF32) {
      float *kp = static_cast<float*>(kv.k), *vp = static_cast<float*>(kv.v);
      k.rotary(pp, xp + H * D, xs, Hkv, D, cp, sp, kp, lp, t0, t1);
      for (int64_t t = t0; t < t1; ++t) {
        std::memcpy(vp + lp[t] * Hkv * D, xp + t * xs + (H + Hkv) * D, sizeof(float) * Hkv * D);
      }
      return;
    }
    std::vector<float> rot(Hkv * D);  // one token's rotated k, then encoded into the cache
    for (int64_t t = t0; t < t1; ++t) {
      k.rotary(pp, xp + H * D, xs, Hkv, D, cp, sp, rot.data(), zero_rows.data(), t, t + 1);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = lp[t] * Hkv + h;
        k.encode_row(kv.type, rot.data() + h * D, D, static_cast<uint8_t*>(kv.k) + row * D * es,
                     kv.ks ? kv.ks + row : nullptr);
        k.encode_row(kv.type, xp + t * xs + (H + Hkv + h) * D, D, static_cast<uint8_t*>(kv.v) + row * D * es,
                     kv.vs ? kv.vs + row : nullptr);
      }
    }
  });
  return q;
}

// Rows x [N, D] (fp32, contiguous) encoded into dst ([N, D] of a KV storage dtype) and, for int8, scale [N]:
// the C++ side of memory_pool.encode, for tests.
void kv_encode(const at::Tensor& x, const at::Tensor& dst, const std::optional<at::Tensor>& scale) {
  check_contig_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && dst.sizes() == x.sizes() && dst.is_contiguous(), "servelm_fused: dst must be [N, D]");
  const int type = kv_type(dst.scalar_type());
  TORCH_CHECK((type == kKvI8) == (scale.has_value() && scale->defined()), "servelm_fused: int8 takes a scale");
  if (type == kKvI8) {
    TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->is_contiguous() && scale->numel() == x.size(0),
                "servelm_fused: scale must be contiguous float16 [N]");
  }
  const Kernels& k = kernels();
  const int64_t N = x.size(0), D = x.size(1), es = kv_elem_size(type);
  for (int64_t r = 0; r < N; ++r) {
    k.encode_row(type, x.data_ptr<float>() + r * D, D, static_cast<uint8_t*>(dst.data_ptr()) + r * D * es,
                 type == kKvI8 ? reinterpret_cast<uint16_t*>(scale->data_ptr()) + r : nullptr);
  }
}

// silu(gate_up[..., :I]) * gate_up[..., I:] -> [..., I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_contig_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "servelm_fused: gate_up's last dim must be even");
  const int64_t I = gate_up.size(-1) / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor y = at::empty(shape, gate_up.options());
  const int64_t N = I ? gate_up.numel() / (2 * I) : 0;
  if (N == 0) return y;
  const Kernels& k = kernels();
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain(2 * I), [&](int64_t r0, int64_t r1) { k.silu_and_mul(gp, yp, I, r0, r1); });
  return y;
}

// torch.argmax(x, dim=-1) of a [R, V] float32 tensor (the greedy tokens of a step's logits), bit for bit: the
// first of equal maxima, a NaN counted as the largest -> int64 [R].
at::Tensor argmax_rows(const at::Tensor& x) {
  check_contig_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "servelm_fused: argmax_rows takes [R, V] with V > 0, got ", x.sizes());
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const Kernels& k = kernels();
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, grain(V), [&](int64_t r0, int64_t r1) { k.argmax_rows(xp, V, op, r0, r1); });
  return out;
}

// One query token per request over its cached keys: q [B, H, D]; k_cache, v_cache [slots, Hkv, D] (any KV
// storage dtype, read as it is: no fp32 copy of the cache); kv_index [B, L] cache slots, of which request b
// attends to the first lens[b] -> [B, H * D]. Query head h reads kv head h / (H / Hkv); softmax(scale * q.k),
// as flash-decoding: chunks of kAttnChunk keys on any thread, merged in order (fused_kernels.inc).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            const at::Tensor& kv_index, const at::Tensor& lens, double scale) {
  check_contig_f32(q, "q");
  TORCH_CHECK(q.dim() == 3, "servelm_fused: q must be [B, H, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const KvView kv = kv_view(k_cache, v_cache, k_scale, v_scale, D);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "servelm_fused: heads of q ", q.sizes(), " and the cache ", k_cache.sizes(),
              " do not match");
  TORCH_CHECK(kv_index.device().is_cpu() && kv_index.scalar_type() == at::kLong && kv_index.is_contiguous() &&
                  kv_index.dim() == 2 && kv_index.size(0) == B,
              "servelm_fused: kv_index must be a contiguous int64 [B, L] CPU tensor");
  TORCH_CHECK(lens.device().is_cpu() && lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.dim() == 1 &&
                  lens.size(0) == B, "servelm_fused: lens must be a contiguous int64 [B] CPU tensor");
  const int64_t L = kv_index.size(1);
  at::Tensor out = at::empty({B, H * D}, q.options());
  if (B == 0 || H == 0) return out;
  const int64_t* ip = kv_index.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "servelm_fused: request ", b, " attends to ", lp[b], " positions of ", L);
    for (int64_t l = 0; l < lp[b]; ++l) {
      TORCH_CHECK(ip[b * L + l] >= 0 && ip[b * L + l] < S, "servelm_fused: cache slot ", ip[b * L + l],
                  " outside [0, ", S, ")");
    }
    keys += lp[b];
  }
  const int64_t items = B * Hkv, g = H / Hkv;
  std::vector<int64_t> item_first(items + 1, 0), chunks(B);
  for (int64_t b = 0; b < B; ++b) chunks[b] = (lp[b] + kAttnChunk - 1) / kAttnChunk;
  for (int64_t i = 0; i < items; ++i) item_first[i + 1] = item_first[i] + chunks[i / Hkv];
  // Rows that see the same keys, each one more than the last (a speculating request's verify rows: its last
  // token and the draft), are one group: a unit computes a chunk for all of them, reading and decoding the
  // chunk's K and V once. Each row's numbers are what it would get alone, so the bits are a plain decode step's.
  // NOTE: one row a unit, the default model's 5 verify rows at 600 keys had cost 3.4x one row's attention
  // (docs/measurements/decode-attention.md).
  std::vector<int64_t> group_end;  // groups [group_end[i - 1], group_end[i])
  for (int64_t b0 = 0; b0 < B;) {
    int64_t b1 = b0 + 1;
    while (b1 < B && b1 - b0 < kMaxUnitRows && lp[b1] == lp[b1 - 1] + 1 &&
           std::memcmp(ip + b1 * L, ip + (b1 - 1) * L, lp[b1 - 1] * sizeof(int64_t)) == 0)
      ++b1;
    group_end.push_back(b1);
    b0 = b1;
  }
  // A unit takes all of a chunk's kv heads (their values are contiguous per token), unless that leaves fewer
  // than four units a thread: then the next smaller divisor of Hkv, and so on down to one head (an odd Hkv had
  // stopped at all heads: the default model's 3 kv heads at 200-300 keys were 2-3 units of unequal size for
  // two threads; at 600 keys, 5 units split 3 and 2, two units a thread had cost 10-20% of the attention's time,
  // docs/measurements/decode-attention.md). The bits are the same either way.
  int64_t per = Hkv, total = 0, max_rows = 1;
  const int64_t want = 4 * at::get_num_threads();
  for (;;) {
    total = 0;
    for (int64_t b1 : group_end) total += chunks[b1 - 1] * (Hkv / per);
    if (total >= want || per == 1) break;
    do --per; while (Hkv % per != 0);
  }
  std::vector<int64_t> units;
  units.reserve(4 * total);
  for (int64_t b0 = 0, i = 0; i < static_cast<int64_t>(group_end.size()); b0 = group_end[i++]) {
    const int64_t b1 = group_end[i];
    max_rows = std::max(max_rows, b1 - b0);
    for (int64_t c = 0; c < chunks[b1 - 1]; ++c) {
      int64_t first = b0;  // the group's rows that reach chunk c: a suffix of it
      while (chunks[first] <= c) ++first;
      for (int64_t h0 = 0; h0 < Hkv; h0 += per) units.insert(units.end(), {first, b1 - first, c, h0});
    }
  }
  std::vector<float> partial(item_first[items] * g * (D + 2));
  const DecodeWork w{q.data_ptr<float>(), kv, ip, lp, static_cast<float>(scale), H, Hkv, D, L, per,
                     units.data(), item_first.data(), partial.data(), out.data_ptr<float>()};
  const Kernels& k = kernels();
  // per unit ~2 * keys * g * D multiply-adds per head (keys: its share of the step's)
  const int64_t per_unit = std::max<int64_t>(1, 2 * (keys / total) * per * g * D);
  const auto attend = [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scratch, kbuf;
    const int64_t need = per * (max_rows * g + 1) * kAttnChunk;
    if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
    if (static_cast<int64_t>(kbuf.size()) < kAttnChunk * per * D) kbuf.resize(kAttnChunk * per * D);
    k.attend_units(w, u0, u1, scratch.data(), kbuf.data());
  };
  // as many threads as the grain allows, sharing runs of units (8 a thread) by work stealing (parallel.h; a unit
  // writes its own partial results, whichever thread computes it)
  const int64_t gu = grain(per_unit), threads = std::min<int64_t>(at::get_num_threads(), (total + gu - 1) / gu);
  servelm_parallel::steal_range(total, threads < 2 ? 1 : 8 * threads, attend);
  at::parallel_for(0, items, grain(item_first[items] * g * D / items),
                   [&](int64_t i0, int64_t i1) { k.merge_items(w, i0, i1); });
  return out;
}

// Prefill and extend attention over the paged KV, causal, read in its storage dtype (no fp32 copy of the cache,
// no [queries, keys] matrix): q [T, H, D]; reqs [R, 4] int64 rows {q_start, n, seq_len, index_off}: request r's
// n queries are rows q_start .. q_start + n of q, at positions seq_len - n .., and see the slots
// index[index_off .. index_off + position] (not `causal`: all seq_len of them, an encoder's bidirectional
// attention). Writes those rows of out [T, H * D] (others untouched).
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                       const at::Tensor& index, const at::Tensor& reqs, double scale, const at::Tensor& out,
                       bool causal) {
  check_contig_f32(q, "q");
  check_contig_f32(out, "out");
  TORCH_CHECK(q.dim() == 3, "servelm_fused: q must be [T, H, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == H * D, "servelm_fused: out must be [T, H * D]");
  const KvView kv = kv_view(k_cache, v_cache, k_scale, v_scale, D);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "servelm_fused: heads of q ", q.sizes(), " and the cache ", k_cache.sizes(),
              " do not match");
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.is_contiguous() &&
                  index.dim() == 1, "servelm_fused: index must be a contiguous int64 [N] CPU tensor");
  TORCH_CHECK(reqs.device().is_cpu() && reqs.scalar_type() == at::kLong && reqs.is_contiguous() && reqs.dim() == 2 &&
                  reqs.size(1) == 4, "servelm_fused: reqs must be a contiguous int64 [R, 4] CPU tensor");
  const int64_t* ip = index.data_ptr<int64_t>();
  const int64_t* rp = reqs.data_ptr<int64_t>();
  const int64_t N = index.size(0), nreq = reqs.size(0), g = H / Hkv;
  for (int64_t r = 0; r < nreq; ++r) {
    const int64_t qs = rp[4 * r], n = rp[4 * r + 1], L = rp[4 * r + 2], off = rp[4 * r + 3];
    TORCH_CHECK(n >= 1 && qs >= 0 && qs + n <= T && L >= n && off >= 0 && off + L <= N, "servelm_fused: request ",
                r, " {", qs, ", ", n, ", ", L, ", ", off, "} does not fit q's ", T, " rows and the index's ", N);
    for (int64_t l = 0; l < L; ++l) {
      TORCH_CHECK(ip[off + l] >= 0 && ip[off + l] < S, "servelm_fused: cache slot ", ip[off + l], " outside [0, ", S,
                  ")");
    }
  }
  if (H == 0 || nreq == 0) return;
  const Kernels& k = kernels();
  // rows: 2 * W query rows (two vectors of the score and output tiles), or one query's g when more
  const int64_t W = k.width, qb = std::max<int64_t>(1, 2 * W / g), rows = (qb * g + W - 1) / W * W;
  std::vector<int64_t> units;
  std::vector<double> cost{0.0};  // running sum of each unit's rows * keys
  for (int64_t r = 0; r < nreq; ++r) {
    const int64_t n = rp[4 * r + 1], prefix = rp[4 * r + 2] - n;
    for (int64_t i0 = 0; i0 < n; i0 += qb) {
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        units.insert(units.end(), {r, hk, i0});
        const int64_t seen = prefix + (causal ? std::min(n, i0 + qb) : n);  // keys its last query sees
        cost.push_back(cost.back() + static_cast<double>(rows) * seen);
      }
    }
  }
  const int64_t U = static_cast<int64_t>(units.size()) / 3;
  const PrefillWork w{q.data_ptr<float>(), kv, ip, rp, static_cast<float>(scale), H, Hkv, D, qb, rows,
                      units.data(), out.data_ptr<float>(), causal};
  // Runs of units of equal cost (a causal prompt's later queries see more keys), 8 a thread, which the threads
  // take by work stealing (parallel.h; a unit's output does not depend on the run or thread that computes it).
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(8 * at::get_num_threads(), U));
  const double total = cost.back();
  const auto first = [&](int64_t part) {
    return part == parts ? U
                         : static_cast<int64_t>(std::lower_bound(cost.begin(), cost.end() - 1, total * part / parts) -
                                                cost.begin());
  };
  const auto run = [&](int64_t part) {
    thread_local std::vector<float> buf;
    const int64_t need = prefill_buf_floats(D, rows);
    if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
    k.prefill_units(w, first(part), first(part + 1), buf.data());
  };
  if (total * D < kGrainElems * 4) {  // ~2 * total * D multiply-adds: too few to share
    for (int64_t part = 0; part < parts; ++part) run(part);
  } else {
    servelm_parallel::steal_chunks(parts, run);
  }
}

// One decoder layer's decode step (Llama family, fp32 activations, quantised weights, one rank) in one call:
// what LlamaDecoderLayer.forward runs as ~10 torch ops and ~40 Python frames, here without the dispatcher.
//   hidden, residual = add_rms_norm(hidden, residual) (rms_norm(hidden), hidden for the first layer)
//   q = qkv_rotary_cache(qkv_proj(hidden)); out = o_proj(decode_attention(q))
//   hidden, residual = add_rms_norm(out, residual); return down_proj(silu_and_mul(gate_up_proj(hidden))), residual
// Each projection is one or more parts (runs of one format: a Q4_K_M file's Q4_K q/k beside a Q6_K v), six
// tensors a part in `weights` (qs, d, m, qh, qh2, sc), `parts[i]` of them for projection i (qkv, o, gate_up,
// down), their formats in `fmts`; `biases` one per projection, sliced along the parts. Part p takes the
// many-rows path (linear_tiles) from `tiles_from[p]` rows of x on (servelm.kernels.quant.tiles_min_rows).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& in_norm,
    const at::Tensor& post_norm, double eps, const c10::List<std::optional<at::Tensor>>& weights,
    at::IntArrayRef fmts, at::IntArrayRef parts, const c10::List<std::optional<at::Tensor>>& biases,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    const at::Tensor& out_cache_loc, const at::Tensor& kv_index, const at::Tensor& lens, int64_t num_heads,
    double scale, int64_t isa, at::IntArrayRef tiles_from) {
  TORCH_CHECK(parts.size() == 4 && biases.size() == 4, "servelm_fused: decode_layer takes 4 projections");
  int64_t total = 0;
  for (int64_t n : parts) total += n;
  TORCH_CHECK(static_cast<int64_t>(fmts.size()) == total && static_cast<int64_t>(tiles_from.size()) == total &&
                  static_cast<int64_t>(weights.size()) == 6 * total,
              "servelm_fused: decode_layer: ", weights.size(), " weight tensors for ", total, " parts");
  std::vector<int64_t> first(4, 0);
  for (int i = 1; i < 4; ++i) first[i] = first[i - 1] + parts[i - 1];
  const auto opt = [&](int64_t at) -> std::optional<at::Tensor> { return weights.get(at); };
  const auto project = [&](int i, const at::Tensor& x) {
    const std::optional<at::Tensor> bias = biases.get(i);
    std::vector<at::Tensor> outs;
    int64_t row = 0;
    for (int64_t p = first[i]; p < first[i] + parts[i]; ++p) {
      const at::Tensor qs = *opt(6 * p);
      std::optional<at::Tensor> b;
      if (bias.has_value() && bias->defined()) b = parts[i] == 1 ? *bias : bias->narrow(0, row, qs.size(0));
      outs.push_back(servelm_quant::linear_call(x, qs, *opt(6 * p + 1), opt(6 * p + 2), opt(6 * p + 3),
                                                opt(6 * p + 4), opt(6 * p + 5), fmts[p], b, isa,
                                                x.size(0) >= tiles_from[p]));
      row += qs.size(0);
    }
    return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  };
  at::Tensor h, res;
  if (residual.has_value() && residual->defined()) {
    std::tie(h, res) = add_rms_norm(hidden, *residual, in_norm, eps);
  } else {
    h = rms_norm(hidden, in_norm, eps);
    res = hidden;
  }
  const at::Tensor q = qkv_rotary_cache(project(0, h), positions, cos, sin, k_cache, v_cache, k_scale, v_scale,
                                        out_cache_loc, num_heads);
  const at::Tensor attn = decode_attention(q, k_cache, v_cache, k_scale, v_scale, kv_index, lens, scale);
  std::tie(h, res) = add_rms_norm(project(1, attn), res, post_norm, eps);
  return {project(3, silu_and_mul(project(2, h))), res};
}

// Every decoder layer's decode step from one call (fused.decode_stack): the layers' `decode_layer` arguments that
// do not change from step to step, kept here once, so a step crosses from Python into C++ once, not once a layer
// (a layer's call converted ~30 Python arguments, lists of tensors among them: ~40 us a layer, 1.2 ms of the
// default model's decode step on a 2-core EPYC). The same calls in the same order as layer by layer.
struct DecodeStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor in_norm, post_norm, cos, sin, k_cache, v_cache;
    double eps, scale;
    c10::List<std::optional<at::Tensor>> weights, biases;
    std::vector<int64_t> fmts, parts, tiles_from;
    std::optional<at::Tensor> k_scale, v_scale;
    int64_t num_heads, isa;
  };
  std::vector<Layer> layers;

  void add_layer(at::Tensor in_norm, at::Tensor post_norm, double eps, c10::List<std::optional<at::Tensor>> weights,
                 std::vector<int64_t> fmts, std::vector<int64_t> parts, c10::List<std::optional<at::Tensor>> biases,
                 at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                 std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale, int64_t num_heads,
                 double scale, int64_t isa, std::vector<int64_t> tiles_from) {
    layers.push_back(Layer{std::move(in_norm), std::move(post_norm), std::move(cos), std::move(sin),
                           std::move(k_cache), std::move(v_cache), eps, scale, std::move(weights), std::move(biases),
                           std::move(fmts), std::move(parts), std::move(tiles_from), std::move(k_scale),
                           std::move(v_scale), num_heads, isa});
  }

  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, at::Tensor positions, at::Tensor out_cache_loc,
                                         at::Tensor kv_index, at::Tensor lens) const {
    TORCH_CHECK(!layers.empty(), "servelm_fused: DecodeStack has no layers");
    std::optional<at::Tensor> residual;
    for (const Layer& l : layers) {
      auto [h, r] = decode_layer(hidden, residual, l.in_norm, l.post_norm, l.eps, l.weights, l.fmts, l.parts,
                                 l.biases, positions, l.cos, l.sin, l.k_cache, l.v_cache, l.k_scale, l.v_scale,
                                 out_cache_loc, kv_index, lens, l.num_heads, l.scale, l.isa, l.tiles_from);
      hidden = std::move(h);
      residual = std::move(r);
    }
    return {hidden, *residual};
  }
};

}  // namespace
}  // namespace servelm_fused

TORCH_LIBRARY(servelm_fused, lib) {
  lib.class_<servelm_fused::DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &servelm_fused::DecodeStack::add_layer)
      .def("run", &servelm_fused::DecodeStack::run);
  lib.def("best_isa() -> int", &servelm_fused::best_isa);
  lib.def("set_isa(int isa) -> int", &servelm_fused::set_isa);
  lib.def("isa() -> int", &servelm_fused::current_isa);
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &servelm_fused::rms_norm);
  lib.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
          &servelm_fused::add_rms_norm);
  lib.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
          &servelm_fused::rotary);
  lib.def("qkv_rotary_cache(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor(c!)? k_scale, Tensor(d!)? v_scale, Tensor out_cache_loc, int num_heads) "
          "-> Tensor", &servelm_fused::qkv_rotary_cache);
  lib.def("kv_encode(Tensor x, Tensor(a!) dst, Tensor(b!)? scale) -> ()", &servelm_fused::kv_encode);
  lib.def("silu_and_mul(Tensor gate_up) -> Tensor", &servelm_fused::silu_and_mul);
  lib.def("argmax_rows(Tensor x) -> Tensor", &servelm_fused::argmax_rows);
  lib.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
          "Tensor kv_index, Tensor lens, float scale) -> Tensor", &servelm_fused::decode_attention);
  lib.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
          "Tensor index, Tensor reqs, float scale, Tensor(a!) out, bool causal=True) -> ()",
          &servelm_fused::prefill_attention);
  lib.def("decode_layer(Tensor hidden, Tensor? residual, Tensor in_norm, Tensor post_norm, float eps, "
          "Tensor?[] weights, int[] fmts, int[] parts, Tensor?[] biases, Tensor positions, Tensor cos, Tensor sin, "
          "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, Tensor(d!)? v_scale, Tensor out_cache_loc, "
          "Tensor kv_index, Tensor lens, int num_heads, float scale, int isa, int[] tiles_from) -> (Tensor, Tensor)",
          &servelm_fused::decode_layer);
}
