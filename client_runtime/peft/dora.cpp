#include "client_runtime/peft/dora.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace symbiosis {
namespace {

// Identity rows per FORWARD_NO_BIAS call when streaming a virtual layer's weight norms: bounds
// the client's memory to a few of W's rows while keeping the call count at in/256.
constexpr int64_t kNormChunkRows = 256;

}  // namespace

DoraAdapterImpl::DoraAdapterImpl(int64_t in_features, int64_t out_features, const LoraConfig& config)
    : LoraAdapterImpl(in_features, out_features, config) {
  lora_magnitude_vector = register_parameter("lora_magnitude_vector", at::ones({out_features}));
}

void DoraAdapterImpl::attach(nn::BaseLayerImpl* layer) {
  TORCH_CHECK(layer != nullptr, "DoRA adapter attached to no layer");
  TORCH_CHECK(layer->out_features() == lora_magnitude_vector.size(0) && layer->in_features() == lora_A.size(1),
              "DoRA adapter for in=", lora_A.size(1), ", out=", lora_magnitude_vector.size(0),
              " attached to a layer with in=", layer->in_features(), ", out=", layer->out_features());
  layer_ = layer;
  if (layer_->is_virtual() || layer_->weight.defined()) ensure_magnitude();
}

void DoraAdapterImpl::ensure_magnitude() {
  if (magnitude_ready_) return;
  auto norm = weight_norm();
  at::NoGradGuard no_grad;
  lora_magnitude_vector.copy_(norm);
  magnitude_ready_ = true;
}

void DoraAdapterImpl::cache_virtual_base() {
  const void* binding = layer_->virt().get();
  if (cached_binding_ == binding) return;
  at::NoGradGuard no_grad;
  const int64_t in = layer_->in_features();
  auto sum = at::zeros({layer_->out_features()}, at::kDouble);
  for (int64_t first = 0; first < in; first += kNormChunkRows) {
    const int64_t rows = std::min(kNormChunkRows, in - first);
    auto eye = at::zeros({rows, in});
    eye.narrow(1, first, rows).copy_(at::eye(rows));
    sum += layer_->base_forward_no_bias(eye).to(at::kDouble).square().sum(0);
  }
  base_column_norms_sq_ = sum;
  base_bias_ = layer_->base_bias();
  cached_binding_ = binding;
}

at::Tensor DoraAdapterImpl::weight_norm() {
  TORCH_CHECK(layer_ != nullptr, "DoRA adapter is not attached to a base layer");
  at::NoGradGuard no_grad;
  // [DoRA norms on the executor], in double: the three terms may nearly cancel.
  at::Tensor column_norms_sq;
  if (layer_->is_virtual()) {
    cache_virtual_base();
    column_norms_sq = base_column_norms_sq_;
  } else {
    TORCH_CHECK(layer_->weight.defined(), "DoRA needs the base layer's weights (local or virtual) for its norm");
    // The map M is Wᵀ (Linear, W [out, in]) or W (Conv1D, W [in, out]): sum over the input dimension.
    column_norms_sq = layer_->weight.to(at::kDouble).square().sum(layer_->kind() == LayerKind::kLinear ? 1 : 0);
  }
  auto a = lora_A.detach();
  auto am = layer_->base_forward_no_bias(a).to(at::kDouble);  // [r, out] = A·M
  auto bd = lora_B.detach().to(at::kDouble);
  auto ad = a.to(at::kDouble);
  auto cross = (bd * am.t()).sum(1);
  auto lora_sq = (at::matmul(bd, at::matmul(ad, ad.t())) * bd).sum(1);
  auto norm_sq = column_norms_sq + 2 * scaling * cross + scaling * scaling * lora_sq;
  return norm_sq.clamp_min(0).sqrt().to(a.scalar_type());
}

at::Tensor DoraAdapterImpl::forward(const at::Tensor& x, const BaseFn& base) {
  TORCH_CHECK(layer_ != nullptr, "DoRA adapter is not attached to a base layer");
  ensure_magnitude();
  auto scale = lora_magnitude_vector / weight_norm();  // the norm is detached (DoRA §4.3)
  auto result = base(x);
  at::Tensor lora_input = x;
  at::Tensor base_no_bias;
  if (dropout > 0 && is_training()) {
    // PEFT: with active dropout the rescaled base term sees the dropped input too.
    lora_input = at::dropout(x, dropout, true);
    base_no_bias = layer_->base_forward_no_bias(lora_input);
  } else {
    at::Tensor bias;
    if (layer_->is_virtual()) {
      cache_virtual_base();
      bias = base_bias_;
    } else {
      bias = layer_->base_bias();
    }
    base_no_bias = bias.defined() ? result - bias.to(result.scalar_type()) : result;
  }
  auto lora = at::matmul(at::matmul(lora_input, lora_A.t()), lora_B.t());
  return result + (scale - 1) * base_no_bias + scale * lora * scaling;
}

}  // namespace symbiosis
