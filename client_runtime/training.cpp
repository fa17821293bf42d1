#include "client_runtime/training.h"

namespace symbiosis {

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 3, "logits have shape ", logits.sizes(), ", expected [batch, tokens, vocab]");
  TORCH_CHECK(labels.dim() == 2 && labels.size(0) == logits.size(0) && labels.size(1) == logits.size(1),
              "labels have shape ", labels.sizes(), ", expected [", logits.size(0), ", ", logits.size(1), "]");
  TORCH_CHECK(labels.scalar_type() == at::kLong, "labels have dtype ", labels.scalar_type(), ", expected int64");
  // Shift the labels rather than the logits (as transformers does): position t predicts
  // labels[t+1], the last position predicts nothing. The [B, T, vocab] logits are never copied.
  const int64_t vocab = logits.size(2);
  auto targets = labels.to(logits.device());
  auto shifted_labels = at::cat({targets.narrow(1, 1, labels.size(1) - 1),
                                 at::full({labels.size(0), 1}, kIgnoreIndex, targets.options())},
                                1);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, vocab}), shifted_labels.reshape({-1}),
                                /*weight=*/{}, at::Reduction::Mean, kIgnoreIndex);
}

}  // namespace symbiosis
