#include "client_runtime/cpu_product.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstring>
#include <vector>

namespace symbiosis::nn::detail {
namespace {

constexpr int64_t kBlock = 16;      // floats an inner loop handles: a vector register of AVX-512
constexpr int64_t kRowsATask = 64;  // rows of W a task reads: 512 KiB of a 4 096-wide bf16 weight

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SYMBIOSIS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SYMBIOSIS_CPU_CLONES
#endif

inline float as_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// out[i * out_stride + r] = x[i] · w[r] for rows r in [first, last) of w [.., in] and the m rows of
// x [m, in] (fp32); row: room for `in` floats.
SYMBIOSIS_CPU_CLONES void product_rows(const float* __restrict x, const c10::BFloat16* __restrict w, int64_t m,
                                       int64_t in, int64_t first, int64_t last, float* __restrict row,
                                       float* __restrict out, int64_t out_stride) {
  for (int64_t r = first; r < last; ++r) {
    const c10::BFloat16* weights = w + r * in;
    for (int64_t d = 0; d < in; ++d) row[d] = as_float(weights[d]);
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * in;
      float partial[kBlock] = {};
      for (int64_t d = 0; d < in; d += kBlock) {
        for (int64_t k = 0; k < kBlock; ++k) partial[k] += xi[d + k] * row[d + k];
      }
      float sum = 0;
      for (int64_t k = 0; k < kBlock; ++k) sum += partial[k];
      out[i * out_stride + r] = sum;
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SYMBIOSIS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
SYMBIOSIS_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const auto halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// The same in AVX-512 intrinsics: a row of w against a row of x in two accumulators of 16 lanes.
SYMBIOSIS_AVX512 void product_rows_avx512(const float* __restrict x, const c10::BFloat16* __restrict w, int64_t m,
                                          int64_t in, int64_t first, int64_t last, float* __restrict out,
                                          int64_t out_stride) {
  for (int64_t r = first; r < last; ++r) {
    const c10::BFloat16* weights = w + r * in;
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * in;
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 2 * kBlock <= in; d += 2 * kBlock) {
        even = _mm512_fmadd_ps(_mm512_loadu_ps(xi + d), load16(weights + d), even);
        odd = _mm512_fmadd_ps(_mm512_loadu_ps(xi + d + kBlock), load16(weights + d + kBlock), odd);
      }
      if (d < in) even = _mm512_fmadd_ps(_mm512_loadu_ps(xi + d), load16(weights + d), even);
      out[i * out_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
  }
}

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}
#else
bool has_avx512() { return false; }
void product_rows_avx512(const float*, const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, float*, int64_t) {}
#endif

}  // namespace

bool cpu_decode_product_supports(const at::Tensor& x, const at::Tensor& weight) {
  if (!x.defined() || !weight.defined() || x.dim() < 1 || weight.dim() != 2) return false;
  const int64_t in = weight.size(1);
  const bool differentiable = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  return !differentiable && x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == at::kBFloat16 &&
         weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && x.size(-1) == in && in % kBlock == 0 &&
         x.numel() / in <= kCpuDecodeProductRows;
}

at::Tensor cpu_decode_product(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(cpu_decode_product_supports(x, weight),
              "cpu_decode_product takes x [..., in] and a contiguous weight [out, in], both bf16 on the CPU (in a "
              "multiple of 16, at most ",
              kCpuDecodeProductRows, " rows of x, nothing to differentiate), got x ", x.sizes(), " ", x.scalar_type(),
              " on ", x.device(), " and weight ", weight.sizes(), " ", weight.scalar_type(), " on ", weight.device());
  // One scope for profilers ([Decode profile] in bench/long_context.cpp): free while none listens.
  RECORD_FUNCTION("symbiosis::cpu_decode_product", c10::ArrayRef<const c10::IValue>{});
  const int64_t in = weight.size(1), out = weight.size(0);
  const auto rows = x.reshape({-1, in}).to(at::kFloat).contiguous();
  const int64_t m = rows.size(0);
  auto result = at::empty({m, out}, at::TensorOptions().dtype(at::kFloat));
  const float* x_data = rows.const_data_ptr<float>();
  const auto* w_data = weight.const_data_ptr<c10::BFloat16>();
  float* out_data = result.data_ptr<float>();
  const bool avx512 = has_avx512();
  // [Balanced tasks] of kRowsATask rows of W each.
  balanced_tasks((out + kRowsATask - 1) / kRowsATask, 1, [&] {
    return [&, row = std::vector<float>(avx512 ? 0 : in)](int64_t task) mutable {
      const int64_t first = task * kRowsATask, last = std::min(out, first + kRowsATask);
      if (avx512) {
        product_rows_avx512(x_data, w_data, m, in, first, last, out_data, out);
      } else {
        product_rows(x_data, w_data, m, in, first, last, row.data(), out_data, out);
      }
    };
  });
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return result.to(at::kBFloat16).view(sizes);
}

at::Tensor linear_no_bias(const at::Tensor& x, const at::Tensor& weight) {
  return cpu_decode_product_supports(x, weight) ? cpu_decode_product(x, weight) : at::linear(x, weight);
}

}  // namespace symbiosis::nn::detail
