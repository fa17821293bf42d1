#include "client_runtime/models/attention.h"

namespace symbiosis::detail {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask) {
  const bool grouped = q.size(1) != k.size(1);
  if (!additive_mask.defined()) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0,
                                            /*is_causal=*/true, /*scale=*/std::nullopt, grouped);
  }
  return at::scaled_dot_product_attention(q, k, v, additive_mask, 0.0, /*is_causal=*/false, std::nullopt, grouped);
}

}  // namespace symbiosis::detail
