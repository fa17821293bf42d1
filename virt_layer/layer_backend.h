#pragma once
// What computes a base layer for a VirtLayer: the client runtime's connection to an executor.
// Implementations are thread-safe: autograd may call backward from another thread.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "common/layer_info.h"

namespace symbiosis {

class LayerBackend {
 public:
  virtual ~LayerBackend() = default;
  // x: [tokens, in_features] in layer.dtype; returns [tokens, out_features] (bias added if asked).
  virtual at::Tensor forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias) = 0;
  // grad_out: [tokens, out_features]; returns grad_in = grad_out·W  ([tokens, in_features]).
  virtual at::Tensor backward_input(const LayerInfo& layer, const at::Tensor& grad_out) = 0;
  // [Layer groups] (base_executor/base_model.h): the group that stacks exactly these layers, in
  // this order, called like a layer by forward and backward_input; nullptr when none is served.
  // With an activation, [MLP blocks]: the block of these two entries applying it, called like a
  // layer by forward alone; nullptr also where this backend cannot send it whole (noise masking).
  virtual const LayerInfo* group(const std::vector<uint32_t>& /*members*/, const std::string& /*activation*/) const {
    return nullptr;
  }
};

}  // namespace symbiosis
