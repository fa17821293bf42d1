#include "client_runtime/training.h"

namespace symbiosis {

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 3, "logits have shape ", logits.sizes(), ", expected [batch, tokens, vocab]");
  TORCH_CHECK(labels.dim() == 2 && labels.size(0) == logits.size(0) && labels.size(1) == logits.size(1),
              "labels have shape ", labels.sizes(), ", expected [", logits.size(0), ", ", logits.size(1), "]");
  TORCH_CHECK(labels.scalar_type() == at::kLong, "labels have dtype ", labels.scalar_type(), ", expected int64");
  const int64_t length = logits.size(1);
  const int64_t vocab = logits.size(2);
  auto shifted_logits = logits.narrow(1, 0, length - 1).to(at::kFloat).reshape({-1, vocab});
  auto shifted_labels = labels.narrow(1, 1, length - 1).to(logits.device()).reshape({-1});
  return at::cross_entropy_loss(shifted_logits, shifted_labels, /*weight=*/{}, at::Reduction::Mean, kIgnoreIndex);
}

}  // namespace symbiosis
