#pragma once
// One row of the executor's layer table: what a base layer is, named by its checkpoint name. Both
// sides use it (the executor, the transports, the client's virtual layers and privacy), so it lives
// here, header-only: layer_kind_name is inline, so that no library links another for one function
// (the executor and the transports do not link the client's autograd library, virt_layer/).
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace symbiosis {

enum class LayerKind {
  kLinear,  // weight [out, in]:  y = x·Wᵀ + b
  kConv1D,  // GPT-2 Conv1D, weight [in, out]:  y = x·W + b
};

enum class LatencyClass { kInferenceDecode, kInferencePrefill, kFineTuning };

struct LayerInfo {
  uint32_t id = 0;
  std::string name;  // e.g. "model.layers.3.self_attn.q_proj"
  LayerKind kind = LayerKind::kLinear;
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = false;
  c10::ScalarType dtype = c10::ScalarType::Float;  // what the executor computes in and expects
  // [Layer groups] (base_executor/base_model.h): for a group, the ids of the layers it stacks, in
  // order (its out_features is theirs summed); empty for a layer.
  std::vector<uint32_t> members;
  // [MLP blocks] (base_executor/base_model.h): for a block, members are its gate-and-up entry (a
  // group, or Phi-3's gate_up_proj) and its down projection, and this the activation between them,
  // as common/gated_activation.h names it; empty for a layer or a group.
  std::string activation;
};

// "Linear" or "Conv1D", as messages name a layer's kind.
inline const char* layer_kind_name(LayerKind kind) { return kind == LayerKind::kLinear ? "Linear" : "Conv1D"; }

}  // namespace symbiosis
