#pragma once
// A gated MLP's activation, act(gate) · up: "silu" (SwiGLU, the Llama family's) or
// "gelu_pytorch_tanh" (GeGLU, Gemma 2's). The client's models compute it with this, and so does the
// executor's [MLP blocks] (base_executor/base_model.h), so that a block gives what the tenant's own
// MLP gives: on a GPU, SwiGLU is one kernel ([Fused SwiGLU] in kernels/swiglu.h), whose rounding is
// its own. Header-only: whoever includes it on a CUDA build links symbiosis_client_kernels.
#include <ATen/ATen.h>

#include <string>

#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/swiglu.h"
#endif

namespace symbiosis {

inline bool is_gated_activation(const std::string& name) { return name == "silu" || name == "gelu_pytorch_tanh"; }

// gate, up: the same shape (the halves of one [..., 2n] tensor will do).
inline at::Tensor gated_activation(const std::string& name, const at::Tensor& gate, const at::Tensor& up) {
  if (name == "silu") {
#ifdef SYMBIOSIS_WITH_CUDA
    if (gate.is_cuda()) return kernels::swiglu_forward(gate, up);
#endif
    return at::silu(gate) * up;
  }
  TORCH_CHECK(name == "gelu_pytorch_tanh", "unknown gated activation '", name,
              "' (expected silu or gelu_pytorch_tanh)");
  return at::gelu(gate, "tanh") * up;
}

}  // namespace symbiosis
