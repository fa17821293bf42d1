#pragma once
// AdaLoRA (Zhang et al. 2023, "Adaptive Budget Allocation for Parameter-Efficient Fine-Tuning") on
// base layers (virtual or local), as Hugging Face PEFT computes it: an SVD-form update
//   y = base(x) + dropout(x)·(A ⊙ E)ᵀ·Bᵀ · alpha / (ranknum + 1e-5),
// A [r, in] and B [out, r] the singular vectors, E [r, 1] the singular values, ranknum = init_r.
// AdaLoraAllocator is PEFT's RankAllocator: it scores every singular triplet by the smoothed
// sensitivity |p·∂L/∂p| times its uncertainty and zeroes the least important singular values
// until the model-wide rank budget (cubic schedule from init_r to target_r per layer) is met.
// adalora_orthogonal_regularization is the term PEFT adds to the loss.
//
// Files: adapter_config.json with peft_type "ADALORA" (and, after an allocation, rank_pattern:
// "<layer>.lora_E" → which of the init_r triplets are kept); adapter_model.safetensors with keys
// base_model.model.<layer>.lora_A / lora_B / lora_E holding only the kept triplets.
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "client_runtime/nn.h"

namespace symbiosis {

struct AdaLoraConfig {
  int64_t init_r = 12;   // every layer's starting rank
  int64_t target_r = 8;  // the average rank the budget ends at
  double alpha = 8;      // lora_alpha; the update is scaled by alpha / ranknum
  double dropout = 0.0;
  // A layer is targeted when its path equals a name or ends with ".<name>". Empty: PEFT's
  // defaults for the model type (Llama: q_proj, v_proj; GPT-2: c_attn).
  std::vector<std::string> target_modules;
  // PEFT's init_lora_weights: E = 0 and A, B ~ N(0, 0.02²); false draws all three from N(0, 1).
  bool init_lora_weights = true;
  // The schedule, in optimizer steps: the budget stays at the initial one for tinit steps, falls
  // cubically to the target until total_step − tfinal (an allocation every deltaT steps), and the
  // allocation then stays fixed.
  int64_t tinit = 0;
  int64_t tfinal = 0;
  int64_t deltaT = 1;
  int64_t total_step = 0;  // required
  double beta1 = 0.85;     // EMA of the sensitivity
  double beta2 = 0.85;     // EMA of the uncertainty
  double orth_reg_weight = 0.5;
  // The allocation: "<layer path>.lora_E" → for each triplet, whether it is kept. Written by
  // AdaLoraAllocator; a loaded adapter is resized to the kept triplets.
  std::map<std::string, std::vector<bool>> rank_pattern;

  void validate() const;  // throws naming the bad field
};

class AdaLoraAdapterImpl : public LayerAdapterImpl {
 public:
  AdaLoraAdapterImpl(int64_t in_features, int64_t out_features, const AdaLoraConfig& config);
  at::Tensor forward(const at::Tensor& x, const BaseFn& base) override;
  // Keeps only the triplets marked true (PEFT's resize by rank_pattern); ranknum is unchanged.
  // Replaces the parameters' data: call before an optimizer holds them.
  void keep_triplets(const std::vector<bool>& keep);
  int64_t rank() const { return lora_A.size(0); }

  at::Tensor lora_A;  // [r, in]
  at::Tensor lora_E;  // [r, 1]
  at::Tensor lora_B;  // [out, r]
  double scaling;     // lora_alpha
  double ranknum;     // init_r
  double dropout;
};

// Attaches an AdaLoRA adapter to each targeted base layer; returns the adapter parameters (per
// layer lora_A, lora_E, lora_B) in module order. Throws if no layer matches.
std::vector<at::Tensor> add_adalora(torch::nn::Module& model, const AdaLoraConfig& config);

// orth_reg_weight · mean over every A and B of ‖A·Aᵀ − I‖_F and ‖BᵀB − I‖_F; PEFT adds it to the
// training loss.
at::Tensor adalora_orthogonal_regularization(torch::nn::Module& model, const AdaLoraConfig& config);

// PEFT's RankAllocator and AdaLoraModel.update_and_allocate. Holds the importance statistics of
// one model's adapters; the model must outlive it. Not thread-safe.
class AdaLoraAllocator {
 public:
  AdaLoraAllocator(torch::nn::Module& model, AdaLoraConfig config);
  // Call after backward() and optimizer.step(), before zero_grad(), with the training step
  // (PEFT's global_step): updates the importance and masks singular values when the schedule says
  // so; after total_step − tfinal it re-applies the final allocation.
  void update_and_allocate(int64_t global_step);
  // The budget (kept triplets, model-wide) at a step and whether the step allocates.
  std::pair<int64_t, bool> budget_schedule(int64_t step) const;
  // The config with the latest rank_pattern: what save_adalora should write.
  const AdaLoraConfig& config() const { return config_; }

 private:
  struct Statistics {
    at::Tensor exp_avg_ipt, exp_avg_unc;
  };
  void update_importance();
  void mask_to_budget(int64_t budget);
  void mask_using_rank_pattern();

  AdaLoraConfig config_;
  std::vector<std::pair<std::string, std::shared_ptr<AdaLoraAdapterImpl>>> layers_;  // path, adapter
  std::vector<Statistics> statistics_;  // per layer: A, E, B (empty after a reset)
  int64_t initial_budget_ = 0;
  int64_t target_budget_ = 0;
};

// The AdaLoRA parameters by their PEFT key names, sliced to config.rank_pattern's kept triplets.
std::vector<std::pair<std::string, at::Tensor>> adalora_state(torch::nn::Module& model, const AdaLoraConfig& config);
void save_adalora(torch::nn::Module& model, const AdaLoraConfig& config, const std::filesystem::path& dir);
AdaLoraConfig read_adalora_config(const std::filesystem::path& dir);
// Attaches adapters as the saved config says (when the model has none yet), resizes them to its
// rank_pattern, and loads their weights.
AdaLoraConfig load_adalora(torch::nn::Module& model, const std::filesystem::path& dir);

}  // namespace symbiosis
