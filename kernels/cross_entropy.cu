// [Torch-free kernels] (kernels/launch.h): [Fused cross-entropy]'s kernels;
// kernels/cross_entropy.cpp checks and launches.
#include "kernels/cross_entropy_launch.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

// As LibTorch's CUDA_KERNEL_ASSERT: a device-side assertion, checked with NDEBUG too.
#define SYMBIOSIS_KERNEL_ASSERT(cond)                                                \
  do {                                                                               \
    if (__builtin_expect(!(cond), 0)) {                                              \
      __assert_fail(#cond, __FILE__, static_cast<unsigned int>(__LINE__), __func__); \
    }                                                                                \
  } while (0)

namespace symbiosis::kernels::device {
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
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* logits, const int64_t* labels, int64_t vocab,
                                                           int64_t ignore_index, float* lse_out, float* losses) {
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
  SYMBIOSIS_KERNEL_ASSERT(label >= 0 && label < vocab && "cross-entropy label outside the vocabulary");
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
void with_width(const T* logits, int64_t vocab, Launch&& launch) {
  constexpr int kVector = 16 / sizeof(T);
  const bool vectors = vocab % kVector == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (vectors) {
    launch(std::integral_constant<int, kVector>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

}  // namespace

template <typename T>
cudaError_t cross_entropy_forward(const T* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                                  int64_t ignore_index, float* lse, float* losses, cudaStream_t stream) {
  with_width(logits, vocab, [&](auto width) {
    forward_kernel<T, decltype(width)::value>
        <<<rows, kThreads, 0, stream>>>(logits, labels, vocab, ignore_index, lse, losses);
  });
  return cudaGetLastError();
}

template <typename T>
cudaError_t cross_entropy_backward(const T* logits, const int64_t* labels, const float* lse, const float* scale,
                                   int64_t rows, int64_t vocab, int64_t ignore_index, T* grad, cudaStream_t stream) {
  with_width(logits, vocab, [&](auto width) {
    backward_kernel<T, decltype(width)::value>
        <<<rows, kThreads, 0, stream>>>(logits, labels, lse, scale, vocab, ignore_index, grad);
  });
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T)                                                                                     \
  template cudaError_t cross_entropy_forward<T>(const T*, const int64_t*, int64_t, int64_t, int64_t, float*, float*, \
                                                cudaStream_t);                                                       \
  template cudaError_t cross_entropy_backward<T>(const T*, const int64_t*, const float*, const float*, int64_t,      \
                                                 int64_t, int64_t, T*, cudaStream_t);
SYMBIOSIS_FOR_KERNEL_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
