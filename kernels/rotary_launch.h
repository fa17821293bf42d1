#pragma once
// [Fused rotary embedding]'s kernel, without LibTorch ([Torch-free kernels] in kernels/launch.h);
// callers use kernels/rotary.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels::device {

// Where row (b, h, t) of a [B, H, T, D] tensor starts, by its strides.
struct RotaryRows {
  int64_t heads, tokens;
  int64_t batch_stride, head_stride, token_stride;
  __device__ int64_t offset(int64_t row) const {
    const int64_t t = row % tokens;
    const int64_t bh = row / tokens;
    return (bh / heads) * batch_stride + (bh % heads) * head_stride + t * token_stride;
  }
};

// out = x·cos + rotate_half(x)·sin (backward: x·cos - rotate_half(x·sin)) over `pairs` pairs
// (i, i + half) of rows, on `stream`.
template <typename T>
cudaError_t rotary(const T* x, const T* cos, const T* sin, T* out, RotaryRows x_rows, RotaryRows out_rows,
                   RotaryRows angle_rows, int64_t half, int64_t pairs, bool backward, cudaStream_t stream);

}  // namespace symbiosis::kernels::device
