#include "client_runtime/models/attention.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <limits>

namespace symbiosis::detail {
namespace {

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, bool causal) {
  const bool grouped = q.size(1) != k.size(1);
  return at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                          /*dropout_p=*/0.0, causal, /*scale=*/std::nullopt, grouped);
}

double lowest(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return std::numeric_limits<float>::lowest();
    case at::kDouble: return std::numeric_limits<double>::lowest();
    case at::kBFloat16: return static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf: return static_cast<float>(std::numeric_limits<c10::Half>::lowest());
    default: TORCH_CHECK(false, "attention in unsupported dtype ", dtype);
  }
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask) {
  return sdpa(q, k, v, additive_mask, /*causal=*/!additive_mask.defined());
}

at::Tensor attention_over(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask) {
  return sdpa(q, k, v, additive_mask, /*causal=*/false);
}

at::Tensor additive_mask(const at::Tensor& allowed, at::ScalarType dtype) {
  return at::zeros(allowed.sizes(), at::TensorOptions().dtype(dtype).device(allowed.device()))
      .masked_fill(allowed.logical_not(), lowest(dtype));
}

}  // namespace symbiosis::detail
