#include "client_runtime/models/attention.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>

namespace symbiosis::detail {
namespace {

double lowest(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return std::numeric_limits<float>::lowest();
    case at::kDouble: return std::numeric_limits<double>::lowest();
    case at::kBFloat16: return static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf: return static_cast<float>(std::numeric_limits<c10::Half>::lowest());
    default: TORCH_CHECK(false, "attention in unsupported dtype ", dtype);
  }
}

// [Logit soft-capping]: transformers' eager attention with a soft cap (Gemma 2's eager_attention_forward).
at::Tensor capped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            bool causal, const AttentionScores& scores) {
  const int64_t groups = q.size(1) / k.size(1);
  auto repeated = [&](const at::Tensor& t) { return groups == 1 ? t : t.repeat_interleave(groups, 1); };
  const double scale = scores.scale > 0 ? scores.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto s = soft_cap(at::matmul(q, repeated(k).transpose(-2, -1)) * scale, scores.softcap);
  if (mask.defined()) {
    s = s + mask;
  } else if (causal) {
    const int64_t queries = q.size(2), keys = k.size(2);
    const auto future = at::ones({queries, keys}, q.options().dtype(at::kBool)).triu(keys - queries + 1);
    s = s.masked_fill(future, lowest(s.scalar_type()));
  }
  return at::matmul(at::softmax(s, -1, at::kFloat).to(q.scalar_type()), repeated(v));
}

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, bool causal,
                const AttentionScores& scores) {
  if (scores.softcap > 0) return capped_attention(q, k, v, mask, causal, scores);
  const bool grouped = q.size(1) != k.size(1);
  const auto scale = scores.scale > 0 ? std::optional<double>(scores.scale) : std::nullopt;
  return at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                          /*dropout_p=*/0.0, causal, scale, grouped);
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask,
                     const AttentionScores& scores) {
  return sdpa(q, k, v, additive_mask, /*causal=*/!additive_mask.defined(), scores);
}

at::Tensor attention_over(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& additive_mask, const AttentionScores& scores) {
  return sdpa(q, k, v, additive_mask, /*causal=*/false, scores);
}

at::Tensor additive_mask(const at::Tensor& allowed, at::ScalarType dtype) {
  return at::zeros(allowed.sizes(), at::TensorOptions().dtype(dtype).device(allowed.device()))
      .masked_fill(allowed.logical_not(), lowest(dtype));
}

at::Tensor soft_cap(const at::Tensor& x, double softcap) {
  return softcap > 0 ? at::tanh(x / softcap) * softcap : x;
}

}  // namespace symbiosis::detail
