#pragma once
// Internal: the autograd function behind VirtLayer and virtual weights. Forward sends the
// activation to the backend; backward sends the output gradient and returns grad_in = grad_out·W.
// Nothing is saved between the two but the binding (which layer, which backend).
#include <ATen/ATen.h>

#include "virt_layer/virt_layer.h"

namespace symbiosis {

// Records an autograd node when x requires grad (and grad mode is on). A forward with bias may
// run together with the layer's siblings ([Sibling calls]).
at::Tensor virt_layer_apply(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding, bool with_bias);
// As virt_layer_apply, as a call of its own; or, where `computed` is defined, with that as the
// layer's result for x from the wire ([tokens, out_features], the layer's dtype): the autograd node
// is the same either way.
at::Tensor virt_layer_apply_computed(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding,
                                    bool with_bias, const at::Tensor& computed);
// Forward only, no autograd: for inference mode.
at::Tensor virt_layer_forward(const at::Tensor& x, const VirtLayerBinding& binding, bool with_bias);

// On the wire, activations and gradients are [tokens, features], contiguous, in the layer's dtype.
void check_layer_input(const at::Tensor& x, const LayerInfo& layer);
at::Tensor flatten_for_wire(const at::Tensor& x, int64_t features, at::ScalarType dtype);
// A result from the wire in the shape, dtype and device of `like` (last dimension: `features`).
at::Tensor unflatten(const at::Tensor& y, const at::Tensor& like, int64_t features);

}  // namespace symbiosis
