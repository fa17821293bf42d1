// [Fused cross-entropy]: checks, allocation and dispatch; the kernels are in
// kernels/cross_entropy.cu ([Torch-free kernels] in kernels/launch.h).
#include "kernels/cross_entropy.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

#include "kernels/cross_entropy_launch.h"
#include "kernels/cuda_types.h"
#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

template <typename Launch>
void with_type(const at::Tensor& logits, Launch&& launch) {
  TORCH_CHECK(with_cuda_type(logits.scalar_type(), launch), "cross-entropy: logits of dtype ", logits.scalar_type(),
              ", expected fp32, bf16 or fp16");
}

void check_operands(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
                  logits.size(0) <= std::numeric_limits<int32_t>::max(),
              "cross-entropy: logits must be a contiguous CUDA tensor [tokens, vocab], got ", logits.sizes(), " on ",
              logits.device());
  TORCH_CHECK(labels.device() == logits.device() && labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                  labels.size(0) == logits.size(0) && labels.is_contiguous(),
              "cross-entropy: labels must be int64 [", logits.size(0), "] on ", logits.device(), ", got ",
              labels.scalar_type(), " ", labels.sizes(), " on ", labels.device());
}

}  // namespace

std::pair<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels,
                                                        int64_t ignore_index) {
  const auto device_guard = on_device_of(logits);  // [Operands' device]
  check_operands(logits, labels);
  const auto rows = logits.size(0);
  auto losses = at::empty({rows}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {losses, lse};
  with_type(logits, [&](auto type) {
    using T = decltype(type);
    C10_CUDA_CHECK(device::cross_entropy_forward(static_cast<const T*>(logits.data_ptr()), labels.data_ptr<int64_t>(),
                                                 rows, logits.size(1), ignore_index, lse.data_ptr<float>(),
                                                 losses.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  });
  return {losses, lse};
}

at::Tensor cross_entropy_backward(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                                  const at::Tensor& scale, int64_t ignore_index) {
  const auto device_guard = on_device_of(logits);  // [Operands' device]
  check_operands(logits, labels);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.numel() == logits.size(0) && lse.is_contiguous() &&
                  lse.device() == logits.device(),
              "cross-entropy backward: lse must be fp32 [", logits.size(0), "] on ", logits.device());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1 && scale.device() == logits.device(),
              "cross-entropy backward: scale must be one fp32 value on ", logits.device());
  auto grad = at::empty_like(logits);
  if (logits.size(0) == 0) return grad;
  with_type(logits, [&](auto type) {
    using T = decltype(type);
    C10_CUDA_CHECK(device::cross_entropy_backward(static_cast<const T*>(logits.data_ptr()), labels.data_ptr<int64_t>(),
                                                  lse.data_ptr<float>(), scale.data_ptr<float>(), logits.size(0),
                                                  logits.size(1), ignore_index, static_cast<T*>(grad.data_ptr()),
                                                  c10::cuda::getCurrentCUDAStream()));
  });
  return grad;
}

}  // namespace symbiosis::kernels
