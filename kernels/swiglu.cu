// [Torch-free kernels] (kernels/launch.h): [Fused SwiGLU]'s kernels; kernels/swiglu.cpp checks and launches.
#include "kernels/swiglu_launch.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

namespace symbiosis::kernels::device {
namespace {

constexpr int kThreads = 256;

__device__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// kVec elements of a row, loaded and stored as one (16 bytes, or one element).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T, int kVec>
__device__ Pack<T, kVec> load(const Matrix<const T>& m, int64_t row, int64_t column) {
  return *reinterpret_cast<const Pack<T, kVec>*>(&m.at(row, column));
}

template <typename T, int kVec>
__device__ void store(const Matrix<T>& m, int64_t row, int64_t column, const Pack<T, kVec>& pack) {
  *reinterpret_cast<Pack<T, kVec>*>(&m.at(row, column)) = pack;
}

// Each thread kVec consecutive elements of a row at a time (`packs` of them in all).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(Matrix<const T> gate, Matrix<const T> up, Matrix<T> out, int64_t n, int64_t packs) {
  const int64_t per_row = n / kVec;
  for (int64_t p = blockIdx.x * int64_t{kThreads} + threadIdx.x; p < packs; p += int64_t{gridDim.x} * kThreads) {
    const int64_t r = p / per_row, c = (p % per_row) * kVec;
    const auto g = load<T, kVec>(gate, r, c), u = load<T, kVec>(up, r, c);
    Pack<T, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float gi = static_cast<float>(g.v[i]);
      o.v[i] = static_cast<T>(gi * sigmoid(gi) * static_cast<float>(u.v[i]));
    }
    store<T, kVec>(out, r, c, o);
  }
}

// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g), as ATen's silu_backward computes it.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(Matrix<const T> grad, Matrix<const T> gate, Matrix<const T> up, Matrix<T> grad_gate,
                    Matrix<T> grad_up, int64_t n, int64_t packs) {
  const int64_t per_row = n / kVec;
  for (int64_t p = blockIdx.x * int64_t{kThreads} + threadIdx.x; p < packs; p += int64_t{gridDim.x} * kThreads) {
    const int64_t r = p / per_row, c = (p % per_row) * kVec;
    const auto dy = load<T, kVec>(grad, r, c), g = load<T, kVec>(gate, r, c), u = load<T, kVec>(up, r, c);
    Pack<T, kVec> dg, du;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float dyi = static_cast<float>(dy.v[i]), gi = static_cast<float>(g.v[i]);
      const float ui = static_cast<float>(u.v[i]), si = sigmoid(gi);
      dg.v[i] = static_cast<T>(dyi * ui * si * (1.f + gi * (1.f - si)));
      du.v[i] = static_cast<T>(dyi * gi * si);
    }
    store<T, kVec>(grad_gate, r, c, dg);
    store<T, kVec>(grad_up, r, c, du);
  }
}

// Whether rows of n elements of T, at these (address, row stride) pairs, can go 16 bytes at a time.
template <typename T>
bool vectorizable(int64_t n, std::initializer_list<std::pair<const void*, int64_t>> matrices) {
  constexpr int64_t kVec = 16 / sizeof(T);
  if (n % kVec != 0) return false;
  for (const auto& [data, stride] : matrices) {
    if (reinterpret_cast<uintptr_t>(data) % 16 != 0 || stride % kVec != 0) return false;
  }
  return true;
}

int blocks_for(int64_t elements) {
  return static_cast<int>(std::min<int64_t>((elements + kThreads - 1) / kThreads, 65535));
}

}  // namespace

template <typename T>
cudaError_t swiglu_forward(Matrix<const T> gate, Matrix<const T> up, Matrix<T> out, int64_t n, int64_t elements,
                           cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (vectorizable<T>(n, {{gate.data, gate.stride}, {up.data, up.stride}, {out.data, out.stride}})) {
    forward_kernel<T, kVec><<<blocks_for(elements / kVec), kThreads, 0, stream>>>(gate, up, out, n, elements / kVec);
  } else {
    forward_kernel<T, 1><<<blocks_for(elements), kThreads, 0, stream>>>(gate, up, out, n, elements);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t swiglu_backward(Matrix<const T> grad, Matrix<const T> gate, Matrix<const T> up, Matrix<T> grad_gate,
                            Matrix<T> grad_up, int64_t n, int64_t elements, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (vectorizable<T>(n, {{grad.data, grad.stride},
                          {gate.data, gate.stride},
                          {up.data, up.stride},
                          {grad_gate.data, grad_gate.stride},
                          {grad_up.data, grad_up.stride}})) {
    backward_kernel<T, kVec>
        <<<blocks_for(elements / kVec), kThreads, 0, stream>>>(grad, gate, up, grad_gate, grad_up, n, elements / kVec);
  } else {
    backward_kernel<T, 1>
        <<<blocks_for(elements), kThreads, 0, stream>>>(grad, gate, up, grad_gate, grad_up, n, elements);
  }
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T)                                                                                       \
  template cudaError_t swiglu_forward<T>(Matrix<const T>, Matrix<const T>, Matrix<T>, int64_t, int64_t, cudaStream_t); \
  template cudaError_t swiglu_backward<T>(Matrix<const T>, Matrix<const T>, Matrix<const T>, Matrix<T>, Matrix<T>,     \
                                          int64_t, int64_t, cudaStream_t);
SYMBIOSIS_FOR_FLOATING_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
