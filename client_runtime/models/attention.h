#pragma once
// Scaled dot-product attention for the client's models, through LibTorch's fused kernels (flash
// or memory-efficient attention on a GPU, the math kernel on CPU): one call instead of the eager
// matmul, mask, softmax and matmul, which on a GPU also never materializes the [B, H, T, T] scores.
// This is what transformers' default ("sdpa") attention computes.
#include <ATen/ATen.h>

namespace symbiosis::detail {

// q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] with H a multiple of Hkv (grouped-query attention);
// additive_mask [B, 1, Tq, Tk] added to the scores, or undefined for plain causal attention
// (Tq == Tk). Returns [B, H, Tq, D].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask);

// The same with no causal structure of its own: every query sees every key the mask allows, or
// every key when the mask is undefined.
at::Tensor attention_over(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask);

// 0 where `allowed` (bool) is true, the dtype's lowest value where it is false.
at::Tensor additive_mask(const at::Tensor& allowed, at::ScalarType dtype);

}  // namespace symbiosis::detail
