#pragma once
// [Fused rotary embedding]
// Llama's rotary position embedding, x·cos + rotate_half(x)·sin with rotate_half(x) = [-x2, x1]
// (x1, x2 the halves of the last dimension), and its gradient g·cos - rotate_half(g·sin), each in
// one kernel. LibTorch runs the expression as five kernels forward and five backward on q and on
// k, each on a view that is not contiguous (q and k are transposed to [batch, heads, tokens,
// head_dim]), so through its slower strided path: on an H200 they were a third of a Llama-3.2-1B
// client's own GPU time at 2 x 512 tokens (bench/trace_summary.py, docs/benchmarks-history.md).
// Here each thread reads one pair (x_i, x_{i+half}) and the matching cos and sin, computes in fp32
// and rounds once, so results match the expression within the dtype's rounding, not bit for bit.
// Built only with CUDA; client_runtime/models/llama.cpp calls it on a GPU.
#include <ATen/ATen.h>

namespace symbiosis::kernels {

// x: [batch, heads, tokens, dim] (any strides, the last dimension contiguous, dim even), fp32, bf16
// or fp16 on a GPU; cos, sin: [batch or 1, 1, tokens, dim] in x's dtype, the last dimension
// contiguous. Returns x·cos + rotate_half(x)·sin (backward: x·cos - rotate_half(x·sin), the
// gradient for an upstream gradient x), laid out as x is.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward);

}  // namespace symbiosis::kernels
