#include "client_runtime/training/loss.h"

#include <torch/autograd.h>

#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/cross_entropy.h"
#endif

namespace symbiosis {
namespace {

#ifdef SYMBIOSIS_WITH_CUDA
// [Fused cross-entropy] as an autograd node: keeps the logits (the caller's tensor, not a copy)
// and one fp32 log-sum-exp a row for backward.
class FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& labels,
                            bool mean) {
    auto [losses, lse] = kernels::cross_entropy_forward(logits, labels, kIgnoreIndex);
    // The mean divides by the number of counted rows, as ATen's does (0 of them: NaN).
    auto divisor = mean ? labels.ne(kIgnoreIndex).sum().to(at::kFloat) : at::ones({}, lse.options());
    ctx->save_for_backward({logits, labels, lse, divisor});
    return losses.sum() / divisor;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto scale = grads[0].to(at::kFloat) / saved[3];
    return {kernels::cross_entropy_backward(saved[0], saved[1], saved[2], scale, kIgnoreIndex), at::Tensor(),
            at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& labels, at::Reduction::Reduction reduction) {
  TORCH_CHECK(logits.dim() == 2, "logits have shape ", logits.sizes(), ", expected [tokens, vocab]");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0), "labels have shape ", labels.sizes(),
              ", expected [", logits.size(0), "]");
  TORCH_CHECK(reduction == at::Reduction::Mean || reduction == at::Reduction::Sum,
              "token_cross_entropy reduces by Mean or Sum");
  auto targets = labels.to(logits.device());
#ifdef SYMBIOSIS_WITH_CUDA
  const auto dtype = logits.scalar_type();
  if (logits.is_cuda() && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf)) {
    return FusedCrossEntropy::apply(logits.contiguous(), targets.contiguous(), reduction == at::Reduction::Mean);
  }
#endif
  return at::cross_entropy_loss(logits.to(at::kFloat), targets, /*weight=*/{}, reduction, kIgnoreIndex);
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels, at::Reduction::Reduction reduction) {
  TORCH_CHECK(logits.dim() == 3, "logits have shape ", logits.sizes(), ", expected [batch, tokens, vocab]");
  TORCH_CHECK(labels.dim() == 2 && labels.size(0) == logits.size(0) && labels.size(1) == logits.size(1),
              "labels have shape ", labels.sizes(), ", expected [", logits.size(0), ", ", logits.size(1), "]");
  TORCH_CHECK(labels.scalar_type() == at::kLong, "labels have dtype ", labels.scalar_type(), ", expected int64");
  // Shift the labels rather than the logits (as transformers does): position t predicts
  // labels[t+1], the last position predicts nothing. The [B, T, vocab] logits are never copied.
  auto targets = labels.to(logits.device());
  auto shifted_labels = at::cat(
      {targets.narrow(1, 1, labels.size(1) - 1), at::full({labels.size(0), 1}, kIgnoreIndex, targets.options())}, 1);
  return token_cross_entropy(logits.reshape({-1, logits.size(2)}), shifted_labels.reshape({-1}), reduction);
}

}  // namespace symbiosis
