#pragma once
// The base layers a model is built from: symbiosis::nn::Linear (weight [out, in]) and the
// GPT-2-style Conv1D (weight [in, out]). Each computes its frozen base with local weights
// (monolithic execution) or, once bound to a VirtLayer by virtualize(), on the executor; the
// model's code does not change between the two. An optional LayerAdapter (LoRA, IA3, ...) wraps
// the base computation.
//
// Why not torch::nn::Linear itself: a C++ module calls its members' forward statically, so no
// library can redirect an existing torch::nn::Linear member after construction. These layers keep
// torch::nn::Linear's interface (forward, weight, bias, options-like fields) and add the binding.
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/layer_info.h"
#include "virt_layer/virt_layer.h"

namespace symbiosis {

namespace nn {
class BaseLayerImpl;
}

// Wraps a base layer's computation: forward(x, base) where base(x) is the frozen layer.
class LayerAdapterImpl : public torch::nn::Module {
 public:
  using BaseFn = std::function<at::Tensor(const at::Tensor&)>;
  virtual at::Tensor forward(const at::Tensor& x, const BaseFn& base) = 0;
  // Called once by BaseLayerImpl::set_adapter with the layer that now holds this adapter. Most
  // adapters need only BaseFn; one that needs more of the base (DoRA: its output without bias, its
  // bias, its weight norms) keeps the pointer, valid for as long as that layer holds the adapter.
  virtual void attach(nn::BaseLayerImpl* /*layer*/) {}
  // For layers that nn::forward_siblings computes together: their outputs side by side, as
  // stacked_base is their bases side by side (widths[i] columns each), with each one's adapter
  // (adapters[i], or null) applied, all at once; undefined when this kind of adapter cannot do that
  // for these, and each adapter then wraps its own part (the default).
  virtual at::Tensor forward_group(const at::Tensor& /*x*/, const at::Tensor& /*stacked_base*/,
                                   const std::vector<LayerAdapterImpl*>& /*adapters*/,
                                   const std::vector<int64_t>& /*widths*/) {
    return {};
  }
};

namespace nn {

class BaseLayerImpl : public torch::nn::Module {
 public:
  // materialize=false builds the layer without weights: it must be virtualized (or loaded with
  // set_weights) before use, so a client never allocates base weights it does not hold.
  BaseLayerImpl(LayerKind kind, int64_t in_features, int64_t out_features, bool bias, bool materialize);

  at::Tensor forward(const at::Tensor& x);
  // The frozen layer alone, without the adapter.
  at::Tensor base_forward(const at::Tensor& x);
  // The frozen layer without its bias: x·Wᵀ (Linear) or x·W (Conv1D); on the executor
  // (FORWARD_NO_BIAS) when virtual. Differentiable in x like base_forward.
  at::Tensor base_forward_no_bias(const at::Tensor& x);
  // The bias [out], undefined when the layer has none. When virtual it is computed by one executor
  // call on a zero row (0·W + b = b exactly), without autograd; callers that need it often cache it.
  at::Tensor base_bias();

  // Computes the base on the executor from now on; drops local weights.
  void bind(VirtLayer virt);
  bool is_virtual() const { return !virt_.is_empty(); }
  const VirtLayer& virt() const { return virt_; }

  // Local weights (monolithic): shape [out, in] for Linear, [in, out] for Conv1D. Frozen.
  void set_weights(at::Tensor weight, at::Tensor bias);

  void set_adapter(std::shared_ptr<LayerAdapterImpl> adapter);  // registered as child "adapter"
  // Removes the adapter (the child "adapter") and returns it; null when the layer has none. What
  // wraps an adapter for a while ([Multi-adapter batches] in peft/lora_bank.h) puts it back with
  // set_adapter.
  std::shared_ptr<LayerAdapterImpl> take_adapter();
  const std::shared_ptr<LayerAdapterImpl>& adapter() const { return adapter_; }

  LayerKind kind() const { return kind_; }
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  bool has_bias() const { return has_bias_; }
  std::vector<int64_t> weight_shape() const;

  at::Tensor weight;  // undefined when virtual or not materialized
  at::Tensor bias;

 private:
  friend std::vector<at::Tensor> forward_siblings(const std::vector<BaseLayerImpl*>& layers, const at::Tensor& x,
                                                  at::Tensor* stacked, const at::Tensor& base);
  // forward_siblings' product of x and the siblings' weights stacked (this layer first), biases
  // added; undefined when they cannot be computed so.
  at::Tensor stacked_base(const std::vector<BaseLayerImpl*>& siblings, const at::Tensor& x);
  // Monolithic: whether the siblings' weights are the row blocks of stacked_weight_, as
  // stack_weights() left them (moving the model to another device or dtype undoes it).
  bool weights_stacked(const std::vector<BaseLayerImpl*>& siblings) const;
  void stack_weights(const std::vector<BaseLayerImpl*>& siblings);

  LayerKind kind_;
  int64_t in_features_;
  int64_t out_features_;
  bool has_bias_;
  VirtLayer virt_{nullptr};
  std::shared_ptr<LayerAdapterImpl> adapter_;
  // Held by the first of siblings that forward_siblings computes together, monolithic: their
  // weights and biases stacked, of which theirs are views.
  at::Tensor stacked_weight_, stacked_bias_;
};

// [Layer groups] (base_executor/base_model.h): what each layer's forward(x) gives, for layers that
// read one input x (a Llama attention's q, k and v projections; its MLP's gate and up), with their
// base computed as one product of their weights stacked: on the executor, one call of the group it
// serves for them; monolithic, one GEMM of their weights, stacked once (theirs become views of the
// stack, so memory stays the same). Each layer's adapter then wraps its own part, as forward(x)
// would, unless their adapters apply themselves together (LayerAdapterImpl::forward_group). Layers
// that cannot be stacked (not all Linear of one input width, dtype and bias, not all on one
// backend, or no such group on the executor) compute one by one. `stacked`, when given, is set to
// the outputs side by side ([..., sum of out]), of which they are views, when no adapter changed
// them or their adapters went together; undefined otherwise. `base`, when defined, is their base
// outputs of x side by side, computed already ([MLP bridges]): only their adapters are applied.
std::vector<at::Tensor> forward_siblings(const std::vector<BaseLayerImpl*>& layers, const at::Tensor& x,
                                         at::Tensor* stacked = nullptr, const at::Tensor& base = {});

// [MLP blocks] (base_executor/base_model.h): down(act(gate(x)) · up(x)) in one executor call, for a
// gated MLP whose gate and up are `gate_up` (gate_proj and up_proj, or Phi-3's gate_up_proj) and
// whose down projection is `down`, `activation` as common/gated_activation.h names it. Undefined
// where the MLP cannot go so, and the caller then computes it layer by layer: a layer monolithic or
// with an adapter, x needing a gradient (a block has no backward), no such block served, or a
// backend that masks its calls.
at::Tensor forward_mlp_block(const std::vector<BaseLayerImpl*>& gate_up, BaseLayerImpl* down,
                             const std::string& activation, const at::Tensor& x);

// [MLP bridges] (base_executor/base_model.h): for h, a layer's hidden state after its attention's
// residual, [h2 | n2 | qkv] in one executor call: h2 = h + the MLP of its post-attention norm (the
// layer's output), n2 = the next layer's input norm of h2, qkv = the base outputs of n2 of that
// layer's q, k and v (`next_qkv`: q_proj, k_proj and v_proj, or Phi-3's qkv_proj) side by side,
// their adapters not applied. Undefined where forward_mlp_block is, or where no such bridge is served
// or h is not in its dtype; the caller then computes the layer's MLP as before. The norms are the
// checkpoint's: the caller asks only when its own are (frozen, without a unit offset).
at::Tensor forward_mlp_bridge(const std::vector<BaseLayerImpl*>& gate_up, BaseLayerImpl* down,
                              const std::string& activation, const std::vector<BaseLayerImpl*>& next_qkv,
                              const at::Tensor& h);

// A base layer of either kind, chosen when the model is built (GPT-2's Conv1D, GPTBigCode's Linear:
// [GPT-2 family] in models/gpt2.h).
TORCH_MODULE(BaseLayer);

class LinearImpl : public BaseLayerImpl {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true, bool materialize = true)
      : BaseLayerImpl(LayerKind::kLinear, in_features, out_features, bias, materialize) {}
};
TORCH_MODULE(Linear);

class Conv1DImpl : public BaseLayerImpl {
 public:
  Conv1DImpl(int64_t in_features, int64_t out_features, bool bias = true, bool materialize = true)
      : BaseLayerImpl(LayerKind::kConv1D, in_features, out_features, bias, materialize) {}
};
TORCH_MODULE(Conv1D);

// An embedding table whose values come from a checkpoint: allocated, never initialized randomly
// (a random draw of a 128k x 2k table costs seconds, every time a client starts).
torch::nn::Embedding unfilled_embedding(int64_t num_embeddings, int64_t embedding_dim);

// [Served tied head] (base_executor/base_model.cpp): a head tied to the embedding table `table`,
// made a Linear of its own without weights ([out, in] the table's shape, no bias), for
// virtualize() to bind to the executor's lm_head.
Linear untied_head(const at::Tensor& table);

}  // namespace nn
}  // namespace symbiosis
