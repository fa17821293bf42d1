#pragma once
// The executor's base layers: the frozen Linear (and GPT-2 Conv1D) weights of one checkpoint,
// chosen by a BaseLayerRule, on one device, in one dtype. Stateless: compute() saves nothing.
// Thread safety: immutable after load(); compute() may run from any thread.
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/checkpoint.h"
#include "virt_layer/layer_info.h"

namespace symbiosis {

enum class LayerOp { kForward, kBackwardInput, kForwardNoBias };

// Which checkpoint tensors are base layers. By default: every 2-D "<module>.weight" of the
// decoder blocks (model.layers.N.* for Llama-style, transformer.h.N.* for GPT-2), never
// embeddings or norms; lm_head only when asked.
struct BaseLayerRule {
  static constexpr const char* kDefaultPattern = R"(^(model\.layers|transformer\.h|model\.decoder\.layers)\.[0-9]+\..+$)";
  std::string pattern = kDefaultPattern;  // ECMAScript regex over the module name
  bool lm_head = false;
};

class BaseModel {
 public:
  // dtype: compute dtype; default the checkpoint's. Throws naming the checkpoint on bad input.
  static std::unique_ptr<BaseModel> load(const Checkpoint& checkpoint, const BaseLayerRule& rule,
                                         at::Device device, std::optional<at::ScalarType> dtype);

  const std::vector<LayerInfo>& layers() const { return layers_; }
  const std::string& model_hash() const { return model_hash_; }
  at::Device device() const { return device_; }
  size_t weight_bytes() const;

  // x: [tokens, in] (FORWARD*) or [tokens, out] (BACKWARD_INPUT), on device(), in the layer dtype.
  at::Tensor compute(uint32_t layer_id, LayerOp op, const at::Tensor& x) const;
  // The same, written into `out` ([tokens, out features], contiguous, on device()): a client's
  // payload buffer receives its result without a copy.
  void compute_into(uint32_t layer_id, LayerOp op, const at::Tensor& x, at::Tensor& out) const;

 private:
  std::pair<const at::Tensor&, const at::Tensor&> operands(uint32_t layer_id, LayerOp op) const;
  // out = x · matrix: on a GPU through cuBLAS directly where it applies ([Direct cuBLAS]).
  static void product_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out);
  struct Weights {
    at::Tensor weight;
    at::Tensor bias;
    // Views made once (a view per call costs a tensor allocation on every request): what x is
    // multiplied by forward ([in, out]) and backward ([out, in]).
    at::Tensor forward_matrix, backward_matrix;
  };
  at::Tensor no_bias_;  // undefined
  std::vector<LayerInfo> layers_;
  std::vector<Weights> weights_;
  std::string model_hash_;
  at::Device device_{at::kCPU};
};

}  // namespace symbiosis
