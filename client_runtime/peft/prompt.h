#pragma once
// Prompt-learning PEFT methods, model-level adapters (model_adapter.h) computed wholly on the
// client: prompt tuning (virtual token embeddings), P-tuning (virtual token embeddings through an
// MLP prompt encoder) and prefix tuning (per-layer past keys and values, optionally through a
// reparametrization MLP). They compute what Hugging Face PEFT's PeftModelForCausalLM computes.
//
// [Prompt-learning adapter files] PEFT saves one tensor, "prompt_embeddings": the encoder's
// *output* ([P, hidden] for prompt tuning and P-tuning; [P, layers*2*kv_heads*head_dim] for prefix
// tuning), never the encoder's weights. A loaded adapter is therefore in table form, as PEFT's
// inference mode is: the table is the prompt (or the past keys and values) itself, and further
// training trains the table. Saving a table-form adapter writes the same file.
#include <filesystem>
#include <string>
#include <vector>

#include <torch/nn/modules/linear.h>

#include "client_runtime/peft/model_adapter.h"

namespace symbiosis {

struct PromptTuningConfig {
  int64_t num_virtual_tokens = 20;
  void validate() const;  // throws naming the bad field
};

struct PTuningConfig {
  int64_t num_virtual_tokens = 20;
  int64_t encoder_hidden_size = 0;  // 0: the model's hidden size (PEFT's default)
  void validate() const;
};

struct PrefixTuningConfig {
  int64_t num_virtual_tokens = 20;
  bool prefix_projection = false;   // the reparametrization MLP: Linear, tanh, Linear
  int64_t encoder_hidden_size = 0;  // 0: the prefix's token_dim (kv_heads * head_dim, PEFT's default)
  void validate() const;
};

// What every prompt-learning adapter offers for saving, whatever its method.
class PromptLearningAdapterImpl : public ModelAdapterImpl {
 public:
  PromptLearningAdapterImpl(std::string peft_type, ModelShape shape, int64_t num_virtual_tokens)
      : peft_type_(std::move(peft_type)), shape_(std::move(shape)), num_virtual_tokens_(num_virtual_tokens) {}
  const std::string& peft_type() const { return peft_type_; }  // "PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"
  const ModelShape& shape() const { return shape_; }
  int64_t num_virtual_tokens() const { return num_virtual_tokens_; }
  // PEFT's "prompt_embeddings": the encoder's output (see [Prompt-learning adapter files]).
  virtual at::Tensor saved_embeddings() = 0;
  // PEFT's token_dim: hidden size, or kv_heads * head_dim for prefix tuning.
  virtual int64_t token_dim() const { return shape_.hidden_size; }
  int64_t encoder_hidden_size = 0;  // recorded in the config; 0 when the method has no encoder
  bool prefix_projection = false;

 private:
  std::string peft_type_;
  ModelShape shape_;
  int64_t num_virtual_tokens_;
};

class PromptTuningAdapterImpl : public PromptLearningAdapterImpl {
 public:
  // peft_type "PROMPT_TUNING", or "P_TUNING" for a P-tuning adapter in table form.
  PromptTuningAdapterImpl(const ModelShape& shape, int64_t num_virtual_tokens,
                          const std::string& peft_type = "PROMPT_TUNING");
  at::Tensor prompt_embeddings() override { return embedding; }
  at::Tensor saved_embeddings() override { return embedding; }
  at::Tensor embedding;  // [P, hidden], N(0, 1) as PEFT's RANDOM init
};

class PTuningAdapterImpl : public PromptLearningAdapterImpl {
 public:
  PTuningAdapterImpl(const ModelShape& shape, const PTuningConfig& config);
  // mlp_head(embedding): Linear(hidden, enc), ReLU, Linear(enc, enc), ReLU, Linear(enc, hidden).
  at::Tensor prompt_embeddings() override;
  at::Tensor saved_embeddings() override { return prompt_embeddings(); }
  at::Tensor embedding;                                              // [P, hidden]
  torch::nn::Linear mlp_0{nullptr}, mlp_2{nullptr}, mlp_4{nullptr};  // PEFT's mlp_head.0/.2/.4
};

class PrefixTuningAdapterImpl : public PromptLearningAdapterImpl {
 public:
  PrefixTuningAdapterImpl(const ModelShape& shape, const PrefixTuningConfig& config);
  std::vector<PastKeyValue> past_key_values() override;
  at::Tensor saved_embeddings() override { return encode(); }
  int64_t token_dim() const override { return shape().num_key_value_heads * shape().head_dim; }
  // [P, layers*2*token_dim]: embedding, or transform(embedding) with prefix_projection.
  at::Tensor encode();
  at::Tensor embedding;  // [P, layers*2*token_dim], or [P, token_dim] with prefix_projection
  torch::nn::Linear transform_0{nullptr}, transform_2{nullptr};  // PEFT's transform.0/.2 (tanh between)
};

// Each attaches its adapter to the model (a ModelAdapterHost) and returns the trainable tensors.
std::vector<at::Tensor> add_prompt_tuning(torch::nn::Module& model, const PromptTuningConfig& config);
std::vector<at::Tensor> add_p_tuning(torch::nn::Module& model, const PTuningConfig& config);
std::vector<at::Tensor> add_prefix_tuning(torch::nn::Module& model, const PrefixTuningConfig& config);

// The model's prompt-learning adapter, or null.
std::shared_ptr<PromptLearningAdapterImpl> prompt_learning_adapter(torch::nn::Module& model);
// Saves it in PEFT's format; throws when the model has none.
void save_prompt_learning(torch::nn::Module& model, const std::filesystem::path& dir);
// Attaches a table-form adapter (see [Prompt-learning adapter files]) for a saved PROMPT_TUNING,
// P_TUNING or PREFIX_TUNING adapter, after checking its config against the model (token_dim,
// num_layers, num_attention_heads, num_transformer_submodules; refusals name the field). Returns
// the trainable tensors.
std::vector<at::Tensor> load_prompt_learning(torch::nn::Module& model, const std::filesystem::path& dir);

}  // namespace symbiosis
