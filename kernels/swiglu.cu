#include "kernels/swiglu.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <utility>

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

template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(Matrix<const T> gate, Matrix<const T> up, Matrix<T> out, int64_t n, int64_t elements) {
  for (int64_t e = blockIdx.x * int64_t{kThreads} + threadIdx.x; e < elements; e += int64_t{gridDim.x} * kThreads) {
    const int64_t r = e / n, c = e % n;
    const float g = static_cast<float>(gate.at(r, c));
    out.at(r, c) = static_cast<T>(g * sigmoid(g) * static_cast<float>(up.at(r, c)));
  }
}

// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g), as ATen's silu_backward computes it.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(Matrix<const T> grad, Matrix<const T> gate, Matrix<const T> up, Matrix<T> grad_gate,
                    Matrix<T> grad_up, int64_t n, int64_t elements) {
  for (int64_t e = blockIdx.x * int64_t{kThreads} + threadIdx.x; e < elements; e += int64_t{gridDim.x} * kThreads) {
    const int64_t r = e / n, c = e % n;
    const float dy = static_cast<float>(grad.at(r, c)), g = static_cast<float>(gate.at(r, c));
    const float u = static_cast<float>(up.at(r, c)), s = sigmoid(g);
    grad_gate.at(r, c) = static_cast<T>(dy * u * s * (1.f + g * (1.f - s)));
    grad_up.at(r, c) = static_cast<T>(dy * g * s);
  }
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
  TORCH_CHECK(gate.is_cuda() && gate.dim() >= 1, "swiglu: gate must be a CUDA tensor, got ", gate.sizes(), " on ",
              gate.device());
  check(up, gate, "up");
  auto out = at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.size(-1), elements = gate.numel();
  if (elements == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu_forward", [&] {
    forward_kernel<scalar_t><<<blocks_for(elements), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        matrix<const scalar_t>(gate, "gate"), matrix<const scalar_t>(up, "up"), matrix<scalar_t>(out, "out"), n,
        elements);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad_gate,
                     const at::Tensor& grad_up) {
  TORCH_CHECK(gate.is_cuda() && gate.dim() >= 1, "swiglu: gate must be a CUDA tensor, got ", gate.sizes(), " on ",
              gate.device());
  for (const auto& [t, what] : {std::pair{&grad, "grad"}, {&up, "up"}, {&grad_gate, "grad_gate"}, {&grad_up, "grad_up"}}) {
    check(*t, gate, what);
  }
  const int64_t n = gate.size(-1), elements = gate.numel();
  if (elements == 0) return;
  const auto dy = grad.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu_backward", [&] {
    backward_kernel<scalar_t><<<blocks_for(elements), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        matrix<const scalar_t>(dy, "grad"), matrix<const scalar_t>(gate, "gate"), matrix<const scalar_t>(up, "up"),
        matrix<scalar_t>(grad_gate, "grad_gate"), matrix<scalar_t>(grad_up, "grad_up"), n, elements);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace symbiosis::kernels
