#include "client_runtime/nn.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>

namespace symbiosis::nn {

BaseLayerImpl::BaseLayerImpl(LayerKind kind, int64_t in_features, int64_t out_features, bool bias,
                             bool materialize)
    : kind_(kind), in_features_(in_features), out_features_(out_features), has_bias_(bias) {
  TORCH_CHECK(in_features > 0 && out_features > 0, "base layer needs positive sizes, got in=", in_features,
              " out=", out_features);
  if (!materialize) return;
  // torch::nn::Linear's initialization, so a fresh monolithic model behaves like one.
  auto w = at::empty(weight_shape());
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  w.uniform_(-bound, bound);
  at::Tensor b;
  if (bias) b = at::empty({out_features}).uniform_(-bound, bound);
  set_weights(w, b);
}

torch::nn::Embedding unfilled_embedding(int64_t num_embeddings, int64_t embedding_dim) {
  return torch::nn::Embedding(
      torch::nn::EmbeddingOptions(num_embeddings, embedding_dim)._weight(at::empty({num_embeddings, embedding_dim})));
}

std::vector<int64_t> BaseLayerImpl::weight_shape() const {
  return kind_ == LayerKind::kLinear ? std::vector<int64_t>{out_features_, in_features_}
                                     : std::vector<int64_t>{in_features_, out_features_};
}

void BaseLayerImpl::set_weights(at::Tensor w, at::Tensor b) {
  TORCH_CHECK(!is_virtual(), "base layer is virtual: its weights live on the executor");
  TORCH_CHECK(w.sizes() == at::IntArrayRef(weight_shape()), layer_kind_name(kind_), " weight has shape ",
              w.sizes(), ", expected ", at::IntArrayRef(weight_shape()));
  TORCH_CHECK(b.defined() == has_bias_, layer_kind_name(kind_), has_bias_ ? " needs a bias" : " has no bias");
  if (b.defined()) {
    TORCH_CHECK(b.sizes() == at::IntArrayRef({out_features_}), "bias has shape ", b.sizes(), ", expected [",
                out_features_, "]");
  }
  if (named_parameters(false).contains("weight")) {
    weight.set_data(w);
    if (b.defined()) bias.set_data(b);
    return;
  }
  weight = register_parameter("weight", w, /*requires_grad=*/false);
  if (b.defined()) bias = register_parameter("bias", b, /*requires_grad=*/false);
}

void BaseLayerImpl::bind(VirtLayer virt) {
  const auto& info = virt->info();
  TORCH_CHECK(info.kind == kind_ && info.in_features == in_features_ && info.out_features == out_features_ &&
                  info.bias == has_bias_,
              "cannot virtualize ", layer_kind_name(kind_), "(in=", in_features_, ", out=", out_features_,
              ", bias=", has_bias_, ") as executor layer '", info.name, "', which is ", layer_kind_name(info.kind),
              "(in=", info.in_features, ", out=", info.out_features, ", bias=", info.bias, ")");
  // Drop the local weights: the executor holds them.
  weight = at::Tensor();
  bias = at::Tensor();
  if (named_parameters(false).contains("weight")) {
    // Module offers no unregister_parameter; replace the registry entries with empty tensors.
    for (auto& p : named_parameters(false)) p.value().set_data(at::empty({0}));
  }
  virt_ = register_module("virt", virt);
}

void BaseLayerImpl::set_adapter(std::shared_ptr<LayerAdapterImpl> adapter) {
  TORCH_CHECK(!adapter_, "base layer already has an adapter");
  adapter_ = register_module("adapter", std::move(adapter));
  adapter_->attach(this);
}

at::Tensor BaseLayerImpl::base_forward(const at::Tensor& x) {
  if (is_virtual()) return virt_->forward(x);
  TORCH_CHECK(weight.defined(), layer_kind_name(kind_),
              " has no weights: load them from a checkpoint or virtualize the model first");
  if (kind_ == LayerKind::kLinear) return at::linear(x, weight, bias);
  if (!bias.defined()) return at::matmul(x, weight);
  // Conv1D: x·W + b in one addmm, as transformers' Conv1D and the executor compute it (a product
  // and a separate add round differently).
  auto shape = x.sizes().vec();
  shape.back() = out_features_;
  return at::addmm(bias, x.reshape({-1, in_features_}), weight).view(shape);
}

at::Tensor BaseLayerImpl::base_forward_no_bias(const at::Tensor& x) {
  if (is_virtual()) return virt_->forward_no_bias(x);
  TORCH_CHECK(weight.defined(), layer_kind_name(kind_),
              " has no weights: load them from a checkpoint or virtualize the model first");
  return kind_ == LayerKind::kLinear ? at::linear(x, weight) : at::matmul(x, weight);
}

at::Tensor BaseLayerImpl::base_bias() {
  if (!has_bias_) return at::Tensor();
  if (!is_virtual()) return bias;
  at::NoGradGuard no_grad;
  return virt_->forward(at::zeros({1, in_features_})).reshape({out_features_});
}

at::Tensor BaseLayerImpl::forward(const at::Tensor& x) {
  if (!adapter_) return base_forward(x);
  return adapter_->forward(x, [this](const at::Tensor& in) { return base_forward(in); });
}

}  // namespace symbiosis::nn
