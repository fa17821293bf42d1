#include "kernels/cross_entropy.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <limits>

#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// kWidth elements loaded as one 16-byte vector (or one element where rows are not whole vectors).
template <typename T, int kWidth>
struct alignas(sizeof(T) * kWidth) Pack {
  T v[kWidth];
};

// A running log-sum-exp: the largest value seen and the sum of exp(value - largest).
struct LogSumExp {
  float max = -INFINITY;
  float sum = 0.f;

  __device__ void add(float v) {
    if (v > max) {
      sum = sum * __expf(max - v) + 1.f;
      max = v;
    } else if (max != -INFINITY) {
      sum += __expf(v - max);  // NaN stays NaN
    }
  }
  __device__ void merge(float other_max, float other_sum) {
    const float m = fmaxf(max, other_max);
    if (m == -INFINITY) return;
    sum = sum * __expf(max - m) + other_sum * __expf(other_max - m);
    max = m;
  }
};

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* logits, const int64_t* labels, int64_t vocab, int64_t ignore_index, float* lse_out,
                   float* losses) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const auto* packs = reinterpret_cast<const Pack<T, kWidth>*>(x);
  LogSumExp acc;
  for (int64_t i = threadIdx.x; i < vocab / kWidth; i += kThreads) {
    const auto p = packs[i];
#pragma unroll
    for (int j = 0; j < kWidth; ++j) acc.add(static_cast<float>(p.v[j]));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    acc.merge(__shfl_xor_sync(0xffffffff, acc.max, offset), __shfl_xor_sync(0xffffffff, acc.sum, offset));
  }
  __shared__ float maxes[kWarps], sums[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    maxes[warp] = acc.max;
    sums[warp] = acc.sum;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w) acc.merge(maxes[w], sums[w]);
  const float lse = acc.max + logf(acc.sum);
  lse_out[row] = lse;
  const int64_t label = labels[row];
  if (label == ignore_index) {
    losses[row] = 0.f;
    return;
  }
  CUDA_KERNEL_ASSERT(label >= 0 && label < vocab && "cross-entropy label outside the vocabulary");
  losses[row] = lse - static_cast<float>(x[label]);
}

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* logits, const int64_t* labels, const float* lse, const float* scale, int64_t vocab,
                    int64_t ignore_index, T* grad) {
  const int64_t row = blockIdx.x;
  const int64_t label = labels[row];
  const float l = lse[row];
  const bool counted = label != ignore_index;
  const float g = counted ? *scale : 0.f;
  const auto* in = reinterpret_cast<const Pack<T, kWidth>*>(logits + row * vocab);
  auto* out = reinterpret_cast<Pack<T, kWidth>*>(grad + row * vocab);
  for (int64_t i = threadIdx.x; i < vocab / kWidth; i += kThreads) {
    const auto p = in[i];
    Pack<T, kWidth> q;
#pragma unroll
    for (int j = 0; j < kWidth; ++j) {
      const float softmax = __expf(static_cast<float>(p.v[j]) - l);
      q.v[j] = static_cast<T>(counted ? (softmax - (i * kWidth + j == label ? 1.f : 0.f)) * g : 0.f);
    }
    out[i] = q;
  }
}

// Whole 16-byte vectors a row where the rows allow it, single elements otherwise.
template <typename T, typename Launch>
void with_width(const at::Tensor& logits, Launch&& launch) {
  constexpr int kVector = 16 / sizeof(T);
  const bool vectors = logits.size(1) % kVector == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  if (vectors) {
    launch(std::integral_constant<int, kVector>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

template <typename Launch>
void with_type(const at::Tensor& logits, Launch&& launch) {
  switch (logits.scalar_type()) {
    case at::kFloat: return with_width<float>(logits, [&](auto w) { launch(float{}, w); });
    case at::kBFloat16: return with_width<__nv_bfloat16>(logits, [&](auto w) { launch(__nv_bfloat16{}, w); });
    case at::kHalf: return with_width<__half>(logits, [&](auto w) { launch(__half{}, w); });
    default: TORCH_CHECK(false, "cross-entropy: logits of dtype ", logits.scalar_type(), ", expected fp32, bf16 or fp16");
  }
}

void check_operands(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
                  logits.size(0) <= std::numeric_limits<int32_t>::max(),
              "cross-entropy: logits must be a contiguous CUDA tensor [tokens, vocab], got ", logits.sizes(), " on ",
              logits.device());
  TORCH_CHECK(labels.device() == logits.device() && labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                  labels.size(0) == logits.size(0) && labels.is_contiguous(),
              "cross-entropy: labels must be int64 [", logits.size(0), "] on ", logits.device(), ", got ",
              labels.scalar_type(), " ", labels.sizes(), " on ", labels.device());
}

}  // namespace

std::pair<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels,
                                                        int64_t ignore_index) {
  const auto device_guard = on_device_of(logits);  // [Operands' device]
  check_operands(logits, labels);
  const auto rows = logits.size(0);
  auto losses = at::empty({rows}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {losses, lse};
  with_type(logits, [&](auto type, auto width) {
    using T = decltype(type);
    forward_kernel<T, decltype(width)::value><<<rows, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const T*>(logits.data_ptr()), labels.data_ptr<int64_t>(), logits.size(1), ignore_index,
        lse.data_ptr<float>(), losses.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {losses, lse};
}

at::Tensor cross_entropy_backward(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                                  const at::Tensor& scale, int64_t ignore_index) {
  const auto device_guard = on_device_of(logits);  // [Operands' device]
  check_operands(logits, labels);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.numel() == logits.size(0) && lse.is_contiguous() &&
                  lse.device() == logits.device(),
              "cross-entropy backward: lse must be fp32 [", logits.size(0), "] on ", logits.device());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1 && scale.device() == logits.device(),
              "cross-entropy backward: scale must be one fp32 value on ", logits.device());
  auto grad = at::empty_like(logits);
  if (logits.size(0) == 0) return grad;
  with_type(logits, [&](auto type, auto width) {
    using T = decltype(type);
    backward_kernel<T, decltype(width)::value><<<logits.size(0), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const T*>(logits.data_ptr()), labels.data_ptr<int64_t>(), lse.data_ptr<float>(),
        scale.data_ptr<float>(), logits.size(1), ignore_index, static_cast<T*>(grad.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

}  // namespace symbiosis::kernels
