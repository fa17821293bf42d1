#include "kernels/swiglu.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <utility>

#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

constexpr int kThreads = 256;

// A [rows, n] matrix whose rows lie `stride` elements apart, its last dimension contiguous.
template <typename T>
struct Matrix {
  T* data;
  int64_t stride;
  __device__ T& at(int64_t row, int64_t column) const { return data[row * stride + column]; }
};

template <typename T>
Matrix<T> matrix(const at::Tensor& t, const char* what) {
  const auto rows = t.view({-1, t.size(-1)});  // throws where the rows do not lie at one stride
  TORCH_CHECK(rows.stride(1) == 1 || rows.size(1) == 1, "swiglu: ", what, "'s last dimension must be contiguous");
  return {static_cast<T*>(rows.data_ptr()), rows.stride(0)};
}

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

void check(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type() &&
                  t.device() == like.device(),
              "swiglu: ", what, " must be ", like.sizes(), " in ", like.scalar_type(), " on ", like.device(), ", got ",
              t.sizes(), " in ", t.scalar_type(), " on ", t.device());
}

int blocks_for(int64_t elements) {
  return static_cast<int>(std::min<int64_t>((elements + kThreads - 1) / kThreads, 65535));
}

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  const auto device_guard = on_device_of(gate);  // [Operands' device]
  TORCH_CHECK(gate.is_cuda() && gate.dim() >= 1, "swiglu: gate must be a CUDA tensor, got ", gate.sizes(), " on ",
              gate.device());
  check(up, gate, "up");
  auto out = at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.size(-1), elements = gate.numel();
  if (elements == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu_forward", [&] {
    const auto g = matrix<const scalar_t>(gate, "gate"), u = matrix<const scalar_t>(up, "up");
    const auto o = matrix<scalar_t>(out, "out");
    const auto stream = at::cuda::getCurrentCUDAStream();
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (vectorizable<scalar_t>(n, {{g.data, g.stride}, {u.data, u.stride}, {o.data, o.stride}})) {
      forward_kernel<scalar_t, kVec><<<blocks_for(elements / kVec), kThreads, 0, stream>>>(g, u, o, n, elements / kVec);
    } else {
      forward_kernel<scalar_t, 1><<<blocks_for(elements), kThreads, 0, stream>>>(g, u, o, n, elements);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad_gate,
                     const at::Tensor& grad_up) {
  const auto device_guard = on_device_of(gate);  // [Operands' device]
  TORCH_CHECK(gate.is_cuda() && gate.dim() >= 1, "swiglu: gate must be a CUDA tensor, got ", gate.sizes(), " on ",
              gate.device());
  for (const auto& [t, what] : {std::pair{&grad, "grad"}, {&up, "up"}, {&grad_gate, "grad_gate"}, {&grad_up, "grad_up"}}) {
    check(*t, gate, what);
  }
  const int64_t n = gate.size(-1), elements = gate.numel();
  if (elements == 0) return;
  const auto dy = grad.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu_backward", [&] {
    const auto d = matrix<const scalar_t>(dy, "grad"), g = matrix<const scalar_t>(gate, "gate");
    const auto u = matrix<const scalar_t>(up, "up");
    const auto dg = matrix<scalar_t>(grad_gate, "grad_gate"), du = matrix<scalar_t>(grad_up, "grad_up");
    const auto stream = at::cuda::getCurrentCUDAStream();
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (vectorizable<scalar_t>(
            n, {{d.data, d.stride}, {g.data, g.stride}, {u.data, u.stride}, {dg.data, dg.stride}, {du.data, du.stride}})) {
      backward_kernel<scalar_t, kVec><<<blocks_for(elements / kVec), kThreads, 0, stream>>>(d, g, u, dg, du, n,
                                                                                           elements / kVec);
    } else {
      backward_kernel<scalar_t, 1><<<blocks_for(elements), kThreads, 0, stream>>>(d, g, u, dg, du, n, elements);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace symbiosis::kernels
