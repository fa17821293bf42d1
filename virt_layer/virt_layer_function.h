#pragma once
// Internal: the autograd function behind VirtLayer and virtual weights. Forward sends the
// activation to the backend; backward sends the output gradient and returns grad_in = grad_out·W.
// Nothing is saved between the two but the binding (which layer, which backend).
#include <ATen/ATen.h>

#include "virt_layer/virt_layer.h"

namespace symbiosis {

// Records an autograd node when x requires grad (and grad mode is on).
at::Tensor virt_layer_apply(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding, bool with_bias);
// Forward only, no autograd: for inference mode.
at::Tensor virt_layer_forward(const at::Tensor& x, const VirtLayerBinding& binding, bool with_bias);

}  // namespace symbiosis
