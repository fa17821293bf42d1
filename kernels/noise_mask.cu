// [Torch-free kernels] (kernels/launch.h): [Fused noise masking]'s kernels;
// kernels/noise_mask.cpp checks, allocates and launches. The noise choice, which the host shares
// (kernels/noise_choice.h), is the one use of LibTorch here: ATen's header-only Philox generator,
// whose header uses AT_ASSERT without including c10/util/Exception.h.
#include "kernels/noise_mask_launch.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/noise_choice.h"

namespace symbiosis::kernels::device {
namespace {

constexpr int kThreads = 256;

// A row's choice, decoded into shared memory: bank rows and signs over √mix.
struct RowChoice {
  int64_t index[kMaxNoiseMix];
  float sign[kMaxNoiseMix];
};

__device__ void decode(const int32_t* choices, int mix, RowChoice& choice) {
  const float norm = rsqrtf(static_cast<float>(mix));
  for (int j = 0; j < mix; ++j) {
    const int32_t c = choices[j];
    choice.index[j] = (c > 0 ? c : -c) - 1;
    choice.sign[j] = c > 0 ? norm : -norm;
  }
}

// kVec consecutive elements, loaded and stored as one (16 bytes of T, or one element).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <int kVec, typename T>
__device__ Pack<T, kVec> load(const T* p) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}

// One block a row: its choice (thread 0), then x + s·noise across its features.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    mask_kernel(const T* x, int64_t x_stride, const T* bank, int64_t features, int64_t bank_rows, int mix,
                const int64_t* call, uint64_t secret, const float* norm, float factor, T* out, int32_t* choices) {
  __shared__ RowChoice choice;
  const int64_t row = blockIdx.x;
  const T* in = x + row * x_stride;
  if (threadIdx.x == 0) {
    int64_t index[kMaxNoiseMix];
    float sign[kMaxNoiseMix];
    noise_choice(secret, static_cast<uint64_t>(*call), static_cast<uint64_t>(row), bank_rows, mix, index, sign);
    for (int j = 0; j < mix; ++j) {
      choices[row * mix + j] = static_cast<int32_t>(sign[j] > 0 ? index[j] + 1 : -(index[j] + 1));
    }
    decode(choices + row * mix, mix, choice);
  }
  __syncthreads();
  const float s = factor * *norm;
  for (int64_t f = threadIdx.x * int64_t{kVec}; f < features; f += int64_t{kThreads} * kVec) {
    float noise[kVec] = {};
    for (int j = 0; j < mix; ++j) {
      const auto b = load<kVec>(bank + choice.index[j] * features + f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) noise[i] += choice.sign[j] * static_cast<float>(b.v[i]);
    }
    const auto v = load<kVec>(in + f);
    Pack<T, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = static_cast<T>(static_cast<float>(v.v[i]) + s * noise[i]);
    *reinterpret_cast<Pack<T, kVec>*>(out + row * features + f) = o;
  }
}

// One block a row: y - s·effects (+ bias); block 0 advances the call's number.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    unmask_kernel(const T* y, int64_t y_stride, const T* effect, int64_t features, int mix, const int32_t* choices,
                  const float* norm, float factor, const float* bias, T* out, int64_t* call) {
  __shared__ RowChoice choice;
  const int64_t row = blockIdx.x;
  if (threadIdx.x == 0) {
    decode(choices + row * mix, mix, choice);
    if (row == 0) ++*call;  // every block of the mask read it: the mask ran before this on the stream
  }
  __syncthreads();
  const float s = factor * *norm;
  for (int64_t f = threadIdx.x * int64_t{kVec}; f < features; f += int64_t{kThreads} * kVec) {
    float value[kVec];
    const auto in = load<kVec>(y + row * y_stride + f);
#pragma unroll
    for (int i = 0; i < kVec; ++i) value[i] = static_cast<float>(in.v[i]);
    for (int j = 0; j < mix; ++j) {
      const auto e = load<kVec>(effect + choice.index[j] * features + f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) value[i] -= s * choice.sign[j] * static_cast<float>(e.v[i]);
    }
    if (bias != nullptr) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) value[i] += bias[f + i];
    }
    Pack<T, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = static_cast<T>(value[i]);
    *reinterpret_cast<Pack<T, kVec>*>(out + row * features + f) = o;
  }
}

// Whether rows of `features` elements at these addresses and row strides can go kVec at a time.
template <int kVec, typename T>
bool vectorizable(int64_t features, std::initializer_list<int64_t> strides, std::initializer_list<const T*> pointers) {
  if (features % kVec != 0) return false;
  for (const int64_t stride : strides) {
    if (stride % kVec != 0) return false;
  }
  for (const T* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) != 0) return false;
  }
  return true;
}

}  // namespace

template <typename T>
cudaError_t mask_rows(const T* x, int64_t x_stride, const T* bank, int64_t rows, int64_t features, int64_t bank_rows,
                      int mix, const int64_t* call, uint64_t secret, const float* norm, float factor, T* out,
                      int32_t* choices, cudaStream_t stream) {
  auto launch = [&](auto vec) {
    mask_kernel<T, decltype(vec)::value><<<rows, kThreads, 0, stream>>>(x, x_stride, bank, features, bank_rows, mix,
                                                                        call, secret, norm, factor, out, choices);
  };
  constexpr int kVec = 16 / sizeof(T);
  if (vectorizable<kVec, T>(features, {x_stride}, {x, bank, out})) {
    launch(std::integral_constant<int, kVec>());
  } else {
    launch(std::integral_constant<int, 1>());
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t unmask_rows(const T* y, int64_t y_stride, const T* effect, int64_t rows, int64_t features, int mix,
                        const int32_t* choices, const float* norm, float factor, const float* bias, T* out,
                        int64_t* call, cudaStream_t stream) {
  auto launch = [&](auto vec) {
    unmask_kernel<T, decltype(vec)::value>
        <<<rows, kThreads, 0, stream>>>(y, y_stride, effect, features, mix, choices, norm, factor, bias, out, call);
  };
  constexpr int kVec = 16 / sizeof(T);
  if (features > 0 && vectorizable<kVec, T>(features, {y_stride}, {y, effect, out})) {
    launch(std::integral_constant<int, kVec>());
  } else {
    launch(std::integral_constant<int, 1>());
  }
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T)                                                                                 \
  template cudaError_t mask_rows<T>(const T*, int64_t, const T*, int64_t, int64_t, int64_t, int, const int64_t*, \
                                    uint64_t, const float*, float, T*, int32_t*, cudaStream_t);                  \
  template cudaError_t unmask_rows<T>(const T*, int64_t, const T*, int64_t, int64_t, int, const int32_t*,        \
                                      const float*, float, const float*, T*, int64_t*, cudaStream_t);
SYMBIOSIS_FOR_FLOATING_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
