#pragma once
// LoRA on base layers (virtual or local): y = base(x) + dropout(x)·Aᵀ·Bᵀ·(alpha/r).
// Adapters are saved and loaded in Hugging Face PEFT's format (adapter_config.json +
// adapter_model.safetensors with keys base_model.model.<layer>.lora_A.weight).
#include <filesystem>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "client_runtime/nn.h"

namespace symbiosis {

struct LoraConfig {
  int64_t r = 8;
  double alpha = 16;
  double dropout = 0.0;
  // A base layer is targeted when its name ends with ".<target>" (or equals it); "all-linear"
  // targets every base layer except lm_head.
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};
  // PEFT initializes B to zero (the adapter starts as a no-op); false draws B like A, which
  // makes every gradient non-zero from the first step (useful in tests).
  bool init_b_zero = true;
  // rsLoRA: scaling alpha/sqrt(r) instead of alpha/r.
  bool use_rslora = false;
  // Per-layer rank and alpha, PEFT's rank_pattern/alpha_pattern: a key applies to a layer whose path
  // matches the regular expression "(.*\.)?(key)" whole; the first matching key (in key order) wins.
  std::map<std::string, int64_t> rank_pattern;
  std::map<std::string, double> alpha_pattern;
  // Only "none" (no trainable biases) is supported.
  std::string bias = "none";
  // DoRA (dora.h): a learned per-row magnitude over the normalized adapted weight.
  bool use_dora = false;

  void validate() const;  // throws naming the bad field
  // The rank and alpha of the layer at this path, after the patterns.
  int64_t rank_for(const std::string& path) const;
  double alpha_for(const std::string& path) const;
};

// Whether config targets the base layer at `path`: PEFT's matching (peft::matches_module), where
// "all-linear" names every base layer but the output head (get_output_embeddings: lm_head,
// GPT-NeoX's embed_out).
bool lora_targets(const std::string& path, const LoraConfig& config);

// LoRA's scaling of a layer of rank r: alpha/r, or alpha/sqrt(r) with rsLoRA.
double lora_scaling(double alpha, int64_t r, bool use_rslora);

class LoraAdapterImpl : public LayerAdapterImpl {
 public:
  LoraAdapterImpl(int64_t in_features, int64_t out_features, const LoraConfig& config);
  at::Tensor forward(const at::Tensor& x, const BaseFn& base) override;
  // [Grouped LoRA] (lora.cpp): on a GPU, plain LoRA adapters without dropout, in the model's dtype,
  // apply themselves together (LayerAdapterImpl::forward_group).
  at::Tensor forward_group(const at::Tensor& x, const at::Tensor& stacked_base,
                           const std::vector<LayerAdapterImpl*>& adapters, const std::vector<int64_t>& widths) override;

  at::Tensor lora_A;  // [r, in]
  at::Tensor lora_B;  // [out, r]
  double scaling;
  double dropout;
};

// Attaches a LoRA adapter (a DoraAdapterImpl when config.use_dora) to each targeted base layer of
// the model; returns the adapter parameters (the only trainable ones) in a stable order: per layer
// lora_A, lora_B and, with DoRA, lora_magnitude_vector. Throws if no layer matches.
std::vector<at::Tensor> add_lora(torch::nn::Module& model, const LoraConfig& config);

// The LoRA parameters of a model, by their PEFT key names (with DoRA also
// base_model.model.<layer>.lora_magnitude_vector).
std::vector<std::pair<std::string, at::Tensor>> lora_state(torch::nn::Module& model);

// What PEFT targets when LoraConfig.target_modules is None: its defaults for the model's type
// (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: q_proj and v_proj for the Llama family,
// c_attn for GPT-2 and StarCoder). Throws naming the model when PEFT has none for it.
std::vector<std::string> default_lora_targets(torch::nn::Module& model);
// Throws naming the first entry of `targets` that names no base layer of the model ("all-linear"
// aside) and the names its base layers have. PEFT accepts such an entry silently when another
// matches; the tenant tools refuse it (a typo would train fewer layers than asked).
void require_every_lora_target_matches(torch::nn::Module& model, const std::vector<std::string>& targets);

void save_lora(torch::nn::Module& model, const LoraConfig& config, const std::filesystem::path& dir);
LoraConfig read_lora_config(const std::filesystem::path& dir);
// The same from adapter_config.json's contents, `config`, already in memory (its messages name the
// file in `dir`).
LoraConfig parse_lora_config(const nlohmann::json& config, const std::filesystem::path& dir);
// Attaches adapters as the saved config says (when the model has none yet) and loads their weights.
LoraConfig load_lora(torch::nn::Module& model, const std::filesystem::path& dir);

}  // namespace symbiosis
