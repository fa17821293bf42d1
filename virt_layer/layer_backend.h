#pragma once
// What computes a base layer for a VirtLayer: the client runtime's connection to an executor.
// Implementations are thread-safe: autograd may call backward from another thread.
#include <ATen/ATen.h>

#include <cstddef>
#include <vector>

#include "virt_layer/layer_info.h"

namespace symbiosis {

class LayerBackend {
 public:
  virtual ~LayerBackend() = default;
  // x: [tokens, in_features] in layer.dtype; returns [tokens, out_features] (bias added if asked).
  virtual at::Tensor forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias) = 0;
  // grad_out: [tokens, out_features]; returns grad_in = grad_out·W  ([tokens, in_features]).
  virtual at::Tensor backward_input(const LayerInfo& layer, const at::Tensor& grad_out) = 0;

  // Sibling layers, which read one input (see [Sibling calls] in virt_layer/sibling_calls.h), at
  // once: at most max_group_size() of them, of one dtype and in_features.
  // How many layers one group call may hold; 1 where a group would save nothing over single calls.
  virtual size_t max_group_size() const { return 1; }
  // Each layer's forward (with bias) of x; one result per layer, in order.
  virtual std::vector<at::Tensor> forward_group(const std::vector<const LayerInfo*>& layers, const at::Tensor& x);
};

}  // namespace symbiosis
