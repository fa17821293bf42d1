#pragma once
// Scaled dot-product attention for the client's models, through LibTorch's fused kernels (flash
// or memory-efficient attention on a GPU, the math kernel on CPU): one call instead of the eager
// matmul, mask, softmax and matmul, which on a GPU also never materializes the [B, H, T, T] scores.
// This is what transformers' default ("sdpa") attention computes.
//
// [Logit soft-capping] Gemma 2 bounds its attention scores, after scaling and before the mask, to
// softcap · tanh(score / softcap), and its final logits likewise. No fused kernel does that, so a
// soft-capped attention computes as transformers' eager attention does: scores in the model's
// dtype, capped, masked, softmax in fp32, cast back, times the values.
#include <ATen/ATen.h>

namespace symbiosis {

// How attention turns q·kᵀ into the softmax's input.
struct AttentionScores {
  double scale = 0.0;    // multiplies q·kᵀ; 0: 1/sqrt(head_dim), the default
  double softcap = 0.0;  // > 0: scores become softcap·tanh(score/softcap) ([Logit soft-capping]); 0: none
};

namespace detail {

// q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] with H a multiple of Hkv (grouped-query attention);
// additive_mask [B, 1, Tq, Tk] added to the scores, or undefined for plain causal attention
// (Tq == Tk). Returns [B, H, Tq, D].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask,
                     const AttentionScores& scores = {});

// The same with no causal structure of its own: every query sees every key the mask allows, or
// every key when the mask is undefined.
at::Tensor attention_over(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& additive_mask, const AttentionScores& scores = {});

// 0 where `allowed` (bool) is true, the dtype's lowest value where it is false.
at::Tensor additive_mask(const at::Tensor& allowed, at::ScalarType dtype);

// softcap · tanh(x / softcap) in x's dtype ([Logit soft-capping]); x itself when softcap is 0.
at::Tensor soft_cap(const at::Tensor& x, double softcap);

}  // namespace detail
}  // namespace symbiosis
