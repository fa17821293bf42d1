#include "client_runtime/nn.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <optional>

#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include "client_runtime/cpu_product.h"
#include "virt_layer/virt_layer_function.h"

namespace symbiosis::nn {

BaseLayerImpl::BaseLayerImpl(LayerKind kind, int64_t in_features, int64_t out_features, bool bias, bool materialize)
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

Linear untied_head(const at::Tensor& table) {
  return Linear(table.size(1), table.size(0), /*bias=*/false, /*materialize=*/false);
}

std::vector<int64_t> BaseLayerImpl::weight_shape() const {
  return kind_ == LayerKind::kLinear ? std::vector<int64_t>{out_features_, in_features_}
                                     : std::vector<int64_t>{in_features_, out_features_};
}

void BaseLayerImpl::set_weights(at::Tensor w, at::Tensor b) {
  TORCH_CHECK(!is_virtual(), "base layer is virtual: its weights live on the executor");
  TORCH_CHECK(w.sizes() == at::IntArrayRef(weight_shape()), layer_kind_name(kind_), " weight has shape ", w.sizes(),
              ", expected ", at::IntArrayRef(weight_shape()));
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

std::shared_ptr<LayerAdapterImpl> BaseLayerImpl::take_adapter() {
  if (!adapter_) return nullptr;
  unregister_module("adapter");
  return std::move(adapter_);
}

at::Tensor BaseLayerImpl::base_forward(const at::Tensor& x) {
  if (is_virtual()) return virt_->forward(x);
  TORCH_CHECK(weight.defined(), layer_kind_name(kind_),
              " has no weights: load them from a checkpoint or virtualize the model first");
  if (kind_ == LayerKind::kLinear)
    return bias.defined() ? at::linear(x, weight, bias) : detail::linear_no_bias(x, weight);
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
  return kind_ == LayerKind::kLinear ? detail::linear_no_bias(x, weight) : at::matmul(x, weight);
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

bool BaseLayerImpl::weights_stacked(const std::vector<BaseLayerImpl*>& siblings) const {
  if (!stacked_weight_.defined() || stacked_weight_.device() != weight.device() ||
      stacked_weight_.scalar_type() != weight.scalar_type()) {
    return false;
  }
  int64_t row = 0;
  for (const auto* layer : siblings) {
    const auto* expected =
        static_cast<const char*>(stacked_weight_.data_ptr()) + row * in_features_ * stacked_weight_.element_size();
    if (layer->weight.data_ptr() != expected) return false;
    row += layer->out_features_;
  }
  return true;
}

void BaseLayerImpl::stack_weights(const std::vector<BaseLayerImpl*>& siblings) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> weights, biases;
  for (const auto* layer : siblings) {
    weights.push_back(layer->weight);
    if (has_bias_) biases.push_back(layer->bias);
  }
  stacked_weight_ = at::cat(weights, 0);
  stacked_bias_ = has_bias_ ? at::cat(biases, 0) : at::Tensor();
  int64_t row = 0;
  for (auto* layer : siblings) {
    layer->weight.set_(stacked_weight_.narrow(0, row, layer->out_features_));
    if (has_bias_) layer->bias.set_(stacked_bias_.narrow(0, row, layer->out_features_));
    row += layer->out_features_;
  }
#ifdef SYMBIOSIS_WITH_CUDA
  // Give the layers' former weights back to CUDA (those that filled their allocator segments): the
  // stack replaces them, and cached they would double this model's weights, once.
  if (stacked_weight_.is_cuda() &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    c10::cuda::CUDACachingAllocator::emptyCache();
  }
#endif
}

at::Tensor BaseLayerImpl::stacked_base(const std::vector<BaseLayerImpl*>& siblings, const at::Tensor& x) {
  for (const auto* layer : siblings) {
    if (layer->kind_ != LayerKind::kLinear || layer->in_features_ != in_features_ || layer->has_bias_ != has_bias_ ||
        layer->is_virtual() != is_virtual()) {
      return {};
    }
  }
  if (is_virtual()) {
    std::vector<uint32_t> members;
    for (const auto* layer : siblings) {
      if (layer->virt_->backend() != virt_->backend()) return {};
      members.push_back(layer->virt_->info().id);
    }
    const auto binding = virt_->group_binding(members);
    return binding ? virt_layer_apply(x, binding, /*with_bias=*/true) : at::Tensor();
  }
  for (const auto* layer : siblings) {
    if (!layer->weight.defined() || layer->weight.device() != weight.device() ||
        layer->weight.scalar_type() != weight.scalar_type()) {
      return {};
    }
  }
  if (!weights_stacked(siblings)) stack_weights(siblings);
  return at::linear(x, stacked_weight_, stacked_bias_);
}

namespace {

// The id of the entry that gives `layers`' base outputs of one input side by side, all of them
// virtual on `backend`: the layer's own when one, else their group's; none when none is served.
std::optional<uint32_t> entry_id(const std::vector<BaseLayerImpl*>& layers,
                                 const std::shared_ptr<LayerBackend>& backend) {
  std::vector<uint32_t> members;
  for (const auto* layer : layers) {
    if (!layer->is_virtual() || layer->virt()->backend() != backend) return std::nullopt;
    members.push_back(layer->virt()->info().id);
  }
  if (members.size() == 1) return members[0];  // Phi-3's gate_up_proj or qkv_proj
  const auto group = layers[0]->virt().ptr()->group_binding(members);
  return group ? std::optional<uint32_t>(group->info.id) : std::nullopt;
}

// [MLP blocks]: the block's binding, null where the MLP cannot go as one.
c10::intrusive_ptr<VirtLayerBinding> mlp_block(const std::vector<BaseLayerImpl*>& gate_up, BaseLayerImpl* down,
                                               const std::string& activation, const at::Tensor& x) {
  if (!down->is_virtual() || down->adapter() || (at::GradMode::is_enabled() && x.requires_grad())) return {};
  for (const auto* layer : gate_up) {
    if (layer->adapter()) return {};
  }
  const auto first = entry_id(gate_up, down->virt()->backend());
  if (!first) return {};
  return down->virt().ptr()->block_binding({*first, down->virt()->info().id}, activation);
}

}  // namespace

at::Tensor forward_mlp_block(const std::vector<BaseLayerImpl*>& gate_up, BaseLayerImpl* down,
                             const std::string& activation, const at::Tensor& x) {
  const auto block = mlp_block(gate_up, down, activation, x);
  return block ? virt_layer_apply(x, block, /*with_bias=*/true) : at::Tensor();
}

at::Tensor forward_mlp_bridge(const std::vector<BaseLayerImpl*>& gate_up, BaseLayerImpl* down,
                              const std::string& activation, const std::vector<BaseLayerImpl*>& next_qkv,
                              const at::Tensor& h) {
  const auto block = mlp_block(gate_up, down, activation, h);
  if (!block || next_qkv.empty()) return {};
  const auto attention = entry_id(next_qkv, down->virt()->backend());
  if (!attention) return {};
  const auto bridge = next_qkv[0]->virt().ptr()->block_binding({block->info.id, *attention}, activation);
  if (!bridge || h.scalar_type() != bridge->info.dtype) return {};
  return virt_layer_apply(h, bridge, /*with_bias=*/true);
}

std::vector<at::Tensor> forward_siblings(const std::vector<BaseLayerImpl*>& layers, const at::Tensor& x,
                                         at::Tensor* stacked, const at::Tensor& given) {
  TORCH_CHECK(!layers.empty(), "forward_siblings needs layers");
  std::vector<at::Tensor> out;
  const auto base = given.defined() ? given : layers.size() > 1 ? layers[0]->stacked_base(layers, x) : at::Tensor();
  if (stacked != nullptr) *stacked = at::Tensor();
  if (!base.defined()) {
    for (auto* layer : layers) out.push_back(layer->forward(x));
    return out;
  }
  std::vector<int64_t> widths;
  bool adapted = false;
  for (const auto* layer : layers) {
    widths.push_back(layer->out_features());
    adapted = adapted || layer->adapter();
  }
  if (stacked != nullptr && !adapted) *stacked = base;
  if (adapted) {
    std::vector<LayerAdapterImpl*> adapters;
    for (const auto* layer : layers) adapters.push_back(layer->adapter().get());
    auto* first = *std::find_if(adapters.begin(), adapters.end(), [](auto* a) { return a != nullptr; });
    if (auto together = first->forward_group(x, base, adapters, widths); together.defined()) {
      if (stacked != nullptr) *stacked = together;
      return at::split_with_sizes(together, widths, -1);
    }
  }
  const auto parts = at::split_with_sizes(base, widths, -1);
  // [MLP bridges]: x may be columns of a bridge's result; each adapter below would copy it to rows of
  // their own ([Multi-adapter batches]' kernel, LoRA on the CPU), so it is copied once, here.
  const auto rows = given.defined() && adapted ? x.contiguous() : x;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto* layer = layers[i];
    const auto& part = parts[i];
    if (!layer->adapter()) {
      out.push_back(part);
      continue;
    }
    // The adapter asks for the base of x (its part), or of something else (computed alone).
    out.push_back(layer->adapter()->forward(
        rows, [&](const at::Tensor& in) { return in.is_same(rows) ? part : layer->base_forward(in); }));
  }
  return out;
}

}  // namespace symbiosis::nn
