#pragma once
// [Fused cross-entropy]
// Token cross-entropy of a language model's logits [N, V] (V = the vocabulary) in two kernels,
// one pass over the logits each way, computed in fp32 from fp32, bf16 or fp16 logits.
// transformers (and ATen's cross_entropy_loss, given fp32) first copy the logits to fp32, then
// write the log-softmax and, in backward, a one-hot gradient, the log-softmax's gradient and its
// copy back: at Llama-3.2-1B's vocabulary of 128 256 and 1 024 tokens that is some 6 GB of memory
// traffic an iteration by our count, and 1.25 GB more at the peak (symbiosis-bench-loss measures
// both ways). Here forward reads the logits once (an online log-sum-exp per row) and keeps four
// bytes a row; backward reads them once more and writes the gradient in the logits' dtype. The
// sums run in another order than ATen's, so losses and gradients match its expression within fp32
// rounding (then the dtype's), not bit for bit. Its backward is not differentiable again.
// Built only with CUDA; client_runtime/training/loss.h is what clients call.
#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace symbiosis::kernels {

// For logits [N, V] (contiguous, CUDA, fp32/bf16/fp16) and labels [N] (int64, same device):
// returns (losses, lse), both fp32 [N]: lse[r] = log Σ_v exp(logits[r, v]), losses[r] =
// lse[r] - logits[r, labels[r]], or 0 where labels[r] == ignore_index. A label outside [0, V)
// stops the kernel with a device-side assertion, as ATen's nll_loss does.
std::pair<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels,
                                                        int64_t ignore_index);

// The gradient of Σ_r scale · losses[r] with respect to the logits, in the logits' dtype:
// scale · (softmax(logits[r]) - one_hot(labels[r])), and 0 on rows whose label is ignored.
// scale: a one-element fp32 tensor on the logits' device (the upstream gradient, divided by the
// number of counted rows for a mean), read by the kernel so that the host never waits for it.
at::Tensor cross_entropy_backward(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                                  const at::Tensor& scale, int64_t ignore_index);

}  // namespace symbiosis::kernels
