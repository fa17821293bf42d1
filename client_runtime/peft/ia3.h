#pragma once
// IA3 (Liu et al. 2022) on base layers (virtual or local), as Hugging Face PEFT computes it:
// a learned vector scales a layer's output, y = base(x) * l (l: ia3_l [out, 1]), or, on a
// feed-forward layer, its input, y = base(x * l) (l: ia3_l [1, in]). Saved and loaded in PEFT's
// format: adapter_config.json with peft_type "IA3", adapter_model.safetensors with keys
// base_model.model.<layer>.ia3_l.
#include <filesystem>
#include <string>
#include <vector>

#include "client_runtime/nn.h"

namespace symbiosis {

struct IA3Config {
  // Empty: PEFT's defaults for the model type (Llama: k_proj, v_proj, down_proj; GPT-2: c_attn,
  // mlp.c_proj). A layer is targeted when its path equals a name or ends with ".<name>".
  std::vector<std::string> target_modules;
  // Layers whose input (not output) is scaled; must be among target_modules. Empty with empty
  // target_modules: PEFT's defaults (Llama: down_proj; GPT-2: mlp.c_proj). A layer is feed-forward
  // when its path ends with one of these (PEFT's rule).
  std::vector<std::string> feedforward_modules;
  // PEFT initializes l to ones (a no-op adapter); false draws it from N(0, 1) (useful in tests).
  bool init_ia3_weights = true;

  void validate() const;  // throws naming the bad field
  // The defaults filled in for the model (LlamaForCausalLM or GPT2LMHeadModel).
  IA3Config resolved_for(torch::nn::Module& model) const;
};

class IA3AdapterImpl : public LayerAdapterImpl {
 public:
  IA3AdapterImpl(int64_t in_features, int64_t out_features, bool feedforward, bool init_ones);
  at::Tensor forward(const at::Tensor& x, const BaseFn& base) override;

  at::Tensor ia3_l;  // [1, in] when feedforward, else [out, 1]
  bool feedforward;
};

// Attaches an IA3 adapter to each targeted base layer; returns the adapter vectors (the only
// trainable parameters) in module order. Throws if no layer matches.
std::vector<at::Tensor> add_ia3(torch::nn::Module& model, const IA3Config& config = {});
// The IA3 vectors of a model by their PEFT key names.
std::vector<std::pair<std::string, at::Tensor>> ia3_state(torch::nn::Module& model);
void save_ia3(torch::nn::Module& model, const IA3Config& config, const std::filesystem::path& dir);
// Refuses, naming the field, what this implementation does not support (modules_to_save,
// layers_to_transform, exclude_modules, a regex target_modules, ...).
IA3Config read_ia3_config(const std::filesystem::path& dir);
// Attaches adapters as the saved config says (when the model has none yet) and loads their vectors.
IA3Config load_ia3(torch::nn::Module& model, const std::filesystem::path& dir);

}  // namespace symbiosis
