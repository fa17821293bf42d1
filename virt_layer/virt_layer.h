#pragma once
// VirtLayer: a parameter-free torch::nn::Module standing in for one frozen base layer. Its forward
// sends the activation to the executor; its backward sends the output gradient and returns
// grad_in = grad_out·W. Nothing is saved between forward and backward (the executor is stateless).
// Inputs of any leading shape [..., in] are flattened to [tokens, in] on the wire and cast to the
// layer's dtype; results come back in the input's dtype and device.
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <ATen/core/custom_class.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>

#include "common/layer_info.h"
#include "virt_layer/layer_backend.h"

namespace symbiosis {

// Which layer and which backend: all an autograd node of a base layer keeps.
struct VirtLayerBinding : torch::CustomClassHolder {
  LayerInfo info;
  std::shared_ptr<LayerBackend> backend;
};

class VirtLayerImpl : public torch::nn::Module {
 public:
  VirtLayerImpl(LayerInfo info, std::shared_ptr<LayerBackend> backend);
  at::Tensor forward(const at::Tensor& x);
  // x·W (no bias): used where an effect of the base layer without its bias is wanted.
  at::Tensor forward_no_bias(const at::Tensor& x);
  const LayerInfo& info() const { return info_; }
  const std::shared_ptr<LayerBackend>& backend() const { return backend_; }
  // [Layer groups] (base_executor/base_model.h): the binding of the group that stacks `members`
  // (this layer's id first) on this layer's backend, found once; null when the backend serves none.
  // A group is called like a layer (virt_layer_apply).
  c10::intrusive_ptr<VirtLayerBinding> group_binding(const std::vector<uint32_t>& members);
  // [MLP blocks] (base_executor/base_model.h): the binding of the block of `members` (a gate-and-up
  // entry, then this layer's id) applying `activation`, found once; null when none is served. Also
  // [MLP bridges], looked up on the next layer's q_proj (or qkv_proj): `members` a block, then that
  // layer's q, k and v entry.
  c10::intrusive_ptr<VirtLayerBinding> block_binding(const std::vector<uint32_t>& members,
                                                     const std::string& activation);

 private:
  LayerInfo info_;
  std::shared_ptr<LayerBackend> backend_;
  c10::intrusive_ptr<VirtLayerBinding> binding_;  // made once, shared by every call's autograd node
  // What group_binding() and block_binding() last looked up, and what they found.
  struct Lookup {
    std::vector<uint32_t> members;
    std::string activation;
    c10::intrusive_ptr<VirtLayerBinding> binding;
  };
  Lookup group_, block_;
  c10::intrusive_ptr<VirtLayerBinding> find(Lookup& lookup, const std::vector<uint32_t>& members,
                                            const std::string& activation);
};
TORCH_MODULE(VirtLayer);

// [Decode halves] (client_runtime/inference/generator.h): while a BackendRedirect lives, the base
// layers its thread calls on `from` are called on `to` instead: another connection to the same
// executor, which serves the same layers under the same ids. One at a time on a thread; with `to`
// null it redirects nothing.
class BackendRedirect {
 public:
  BackendRedirect(const LayerBackend* from, LayerBackend* to);
  ~BackendRedirect();
  BackendRedirect(const BackendRedirect&) = delete;
  BackendRedirect& operator=(const BackendRedirect&) = delete;

 private:
  LayerBackend* to_ = nullptr;  // null: this one redirects nothing
};

}  // namespace symbiosis
