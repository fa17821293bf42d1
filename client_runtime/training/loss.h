#pragma once
// Training helpers for client programs.
#include <ATen/ATen.h>

namespace symbiosis {

// The loss transformers' causal LM heads compute: logits [B,T,V] predict labels shifted by one
// (position t predicts labels[t+1]); labels [B,T] int64 with -100 for positions to ignore; mean
// cross-entropy over the remaining positions, in fp32. NaN when every label is ignored, as in
// transformers. Reduction::Sum sums instead (what gradient accumulation over micro-batches wants).
// Computed by token_cross_entropy.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels,
                          at::Reduction::Reduction reduction = at::Reduction::Mean);

// Cross-entropy of logits [N, V] (any float dtype) against labels [N] (int64, kIgnoreIndex to
// ignore), in fp32: what at::cross_entropy_loss(logits.to(fp32), labels) gives, mean over the
// counted rows or their sum. On a CUDA device the logits are read once forward and once backward
// and never copied to fp32 ([Fused cross-entropy] in kernels/cross_entropy.h); elsewhere it is
// that ATen expression.
at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                               at::Reduction::Reduction reduction = at::Reduction::Mean);

constexpr int64_t kIgnoreIndex = -100;

}  // namespace symbiosis
