#pragma once
// What computes a base layer for a VirtLayer: the client runtime's connection to an executor.
// Implementations are thread-safe: autograd may call backward from another thread.
#include <ATen/ATen.h>

#include "virt_layer/layer_info.h"

namespace symbiosis {

class LayerBackend {
 public:
  virtual ~LayerBackend() = default;
  // x: [tokens, in_features] in layer.dtype; returns [tokens, out_features] (bias added if asked).
  virtual at::Tensor forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias) = 0;
  // grad_out: [tokens, out_features]; returns grad_in = grad_out·W  ([tokens, in_features]).
  virtual at::Tensor backward_input(const LayerInfo& layer, const at::Tensor& grad_out) = 0;
};

}  // namespace symbiosis
