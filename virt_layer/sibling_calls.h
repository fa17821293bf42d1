#pragma once
// Internal to virt_layer: base layers that read one input go to the executor together.
//
// [Sibling calls]
// q, k and v of an attention read one input, and so do gate and up of a gated MLP. Sent one by
// one, each forward pays a hand-off to the executor and back (on one GPU, tens of microseconds of
// two processes' host time, and under load the wait for a batch); sent as one group they pay it
// once and share one copy of the input.
//
// The model's code does not change (DESIGN.md's model transparency) and the executor still knows
// layers by name: the client runtime learns the groups from the model's own calls. A layer called
// with the very tensor its predecessor was called with (same tensor, unchanged since, same grad
// mode) becomes that predecessor's sibling. From then on, calling the group's first layer computes
// the whole group in one hand-off; each sibling's result waits in its binding until that layer is
// called with that same input, unchanged, and is handed out then. A result nobody called for
// unlearns the group for good.
//
// Each layer still gets its own autograd node, made when the layer is called, exactly as a call
// of its own makes it, and its result is the one its own call would return: the autograd graph,
// and so every gradient and the order autograd sums them in, is bit for bit what it is without
// groups. Backward calls therefore stay one per layer: summing siblings' input gradients in one
// call would change that order (and the last bits of a resumed or compared run).
//
// Groups form only where the backend gains from them (LayerBackend::max_group_size() > 1), for
// forwards with bias, outside inference mode (inference tensors keep no version counter).
#include <ATen/ATen.h>

#include "virt_layer/virt_layer.h"

namespace symbiosis {

// VirtLayer's forward (with bias) of x through `binding`, in a group with its siblings where one
// has been learned.
at::Tensor call_with_siblings(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding);

}  // namespace symbiosis
