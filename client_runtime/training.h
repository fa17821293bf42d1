#pragma once
// Training helpers for client programs.
#include <ATen/ATen.h>

namespace symbiosis {

// The loss transformers' causal LM heads compute: logits [B,T,V] predict labels shifted by one
// (position t predicts labels[t+1]); labels [B,T] int64 with -100 for positions to ignore; mean
// cross-entropy over the remaining positions, in fp32. NaN when every label is ignored, as in
// transformers.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

constexpr int64_t kIgnoreIndex = -100;

}  // namespace symbiosis
