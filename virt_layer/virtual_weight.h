#pragma once
// [Virtual weights]
// How an existing torch::nn::Linear is made to compute on the executor without a change to the
// model's code. C++ binds a member's forward at compile time, so the module cannot be replaced;
// its weight can. The weight becomes a storage-less tensor on the PrivateUse1 device that carries
// the layer's binding (layer info + backend). torch::nn::functional::linear computes
// input.matmul(weight.t()) (the bias is removed from the module and added by the executor), and
// kernels registered for t and matmul on PrivateUse1 (and AutogradPrivateUse1) turn that into a
// VirtLayer call, with autograd, or without it under InferenceMode. _to_copy, detach and alias
// keep Module::to working (a virtual weight has no place of its own to move). Anything that needs
// the weight's data fails with "storage access" or "not implemented for PrivateUse1".
#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <memory>

#include "common/layer_info.h"
#include "virt_layer/layer_backend.h"

namespace symbiosis {

// Binds `linear` to executor layer `info`: its weight becomes virtual and its bias is dropped
// (the executor adds it). Throws if the shapes or the bias differ.
void virtualize_torch_linear(torch::nn::LinearImpl& linear, const LayerInfo& info,
                             const std::shared_ptr<LayerBackend>& backend);

bool is_virtual_weight(const at::Tensor& t);

}  // namespace symbiosis
