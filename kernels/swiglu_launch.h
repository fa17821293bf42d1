#pragma once
// [Fused SwiGLU]'s kernels, without LibTorch ([Torch-free kernels] in kernels/launch.h); callers
// use kernels/swiglu.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels::device {

// A [rows, n] matrix whose rows lie `stride` elements apart, its last dimension contiguous.
template <typename T>
struct Matrix {
  T* data;
  int64_t stride;
  __device__ T& at(int64_t row, int64_t column) const { return data[row * stride + column]; }
};

// out = silu(gate) · up over `elements` elements (a whole number of rows of n), on `stream`.
template <typename T>
cudaError_t swiglu_forward(Matrix<const T> gate, Matrix<const T> up, Matrix<T> out, int64_t n, int64_t elements,
                           cudaStream_t stream);

// grad_gate = grad · up · silu'(gate) and grad_up = grad · silu(gate), likewise.
template <typename T>
cudaError_t swiglu_backward(Matrix<const T> grad, Matrix<const T> gate, Matrix<const T> up, Matrix<T> grad_gate,
                            Matrix<T> grad_up, int64_t n, int64_t elements, cudaStream_t stream);

}  // namespace symbiosis::kernels::device
