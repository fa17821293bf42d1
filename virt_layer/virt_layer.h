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
#include <optional>
#include <vector>

#include "virt_layer/layer_backend.h"
#include "virt_layer/layer_info.h"

namespace symbiosis {

// The identity of a tensor at one moment: the same tensor, unchanged since (its version counter),
// in the same grad mode. Holds the tensor weakly, so a later tensor cannot take its address.
struct TensorIdentity {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor{
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  int64_t version = 0;
  bool grad_mode = false;

  static TensorIdentity of(const at::Tensor& x);
  bool matches(const at::Tensor& x) const;
};

// Which layer and which backend: all an autograd node of a base layer keeps.
struct VirtLayerBinding : torch::CustomClassHolder {
  LayerInfo info;
  std::shared_ptr<LayerBackend> backend;

  // [Sibling calls] (virt_layer/sibling_calls.h), guarded by the mutex there.
  std::vector<c10::intrusive_ptr<VirtLayerBinding>> siblings;  // learned: called with this layer's input
  bool is_sibling = false;     // a later member of another layer's group
  bool never_group = false;    // its group was unlearned once: it is called alone from now on
  at::Tensor waiting_result;   // its result from its group's call (wire form), until it is called for it
  std::optional<TensorIdentity> waiting_input;  // the input that result belongs to

  ~VirtLayerBinding() override;
};

class VirtLayerImpl : public torch::nn::Module {
 public:
  VirtLayerImpl(LayerInfo info, std::shared_ptr<LayerBackend> backend);
  at::Tensor forward(const at::Tensor& x);
  // x·W (no bias): used where an effect of the base layer without its bias is wanted.
  at::Tensor forward_no_bias(const at::Tensor& x);
  const LayerInfo& info() const { return info_; }

 private:
  LayerInfo info_;
  std::shared_ptr<LayerBackend> backend_;
  c10::intrusive_ptr<VirtLayerBinding> binding_;  // made once, shared by every call's autograd node
};
TORCH_MODULE(VirtLayer);

}  // namespace symbiosis
