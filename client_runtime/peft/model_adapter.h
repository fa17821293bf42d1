#pragma once
// The one hook through which model-level PEFT methods (prompt tuning, P-tuning, prefix tuning, and
// any later one) act on a model, next to LayerAdapterImpl (nn.h) for layer-level methods (LoRA,
// IA3). A model that offers the hook implements ModelAdapterHost; a method implements
// ModelAdapterImpl. Adding a method touches no model, transport or executor code.
//
// [Model adapter conventions] (Hugging Face PEFT's, PeftModelForCausalLM.forward):
//  - Prompts [P, hidden] are prepended to the token embeddings; the attention mask, when given, is
//    extended with P ones in front; positions run 0..P+T-1 (given position_ids are shifted by P
//    behind 0..P-1; PEFT drops them instead, which agrees whenever they are the default). The
//    model drops the P prompt positions from its output, so logits stay [B, T, vocab] and labels
//    need no change (PEFT returns them and labels them -100: the same loss).
//  - Past keys and values [kv_heads, P, head_dim] per decoder layer are prepended to that layer's
//    keys and values as they are (no RoPE on them, as in a transformers KV cache); every token
//    attends to all of them; the mask, when given, is extended with P ones; the tokens' positions
//    are shifted by P (P..P+T-1 by default), as transformers does after a cache of length P.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace symbiosis {

struct PastKeyValue {
  at::Tensor key;    // [kv_heads, P, head_dim] (unbatched) or [B, kv_heads, P, head_dim]
  at::Tensor value;  // the same shape
};

// The sizes a model-level method needs to shape its tensors.
struct ModelShape {
  std::string model_type;  // config.json's: "llama", "qwen2", "mistral", "gemma2", "gpt2", "gpt_bigcode"
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
};

// A model-level adapter. Both hooks are optional; a method overrides what it needs. Called once
// per model forward, so an encoder (P-tuning's MLP, prefix tuning's projection) runs once.
class ModelAdapterImpl : public torch::nn::Module {
 public:
  // Virtual token embeddings [P, hidden] prepended to the input, or undefined for none.
  virtual at::Tensor prompt_embeddings() { return {}; }
  // One entry per decoder layer, or empty for none.
  virtual std::vector<PastKeyValue> past_key_values() { return {}; }
};

// Implemented by models that accept a ModelAdapterImpl (LlamaForCausalLM, GPT2LMHeadModel).
class ModelAdapterHost {
 public:
  virtual ~ModelAdapterHost() = default;
  // Registers the adapter as a child module named "adapter" (so load_weights leaves it alone).
  // Throws if the model already has one.
  virtual void set_model_adapter(std::shared_ptr<ModelAdapterImpl> adapter) = 0;
  virtual std::shared_ptr<ModelAdapterImpl> model_adapter() const = 0;
  virtual ModelShape model_shape() const = 0;
};

// The model's ModelAdapterHost; throws naming the module's type when it is not one.
ModelAdapterHost& model_adapter_host(torch::nn::Module& model);

namespace detail {

// The inputs of a model's decoder stack once the adapter (possibly null) has been applied; see
// [Model adapter conventions].
struct AdaptedInputs {
  at::Tensor embeddings;    // [B, P+T, hidden]
  at::Tensor position_ids;  // [B, P+T] int64
  // [B, 1, P+T, past+P+T] in the embeddings' dtype; undefined when attention is plainly causal
  // (no padding, no past keys), see detail::attention.
  at::Tensor additive_mask;
  // The same for a sliding-window layer ([Sliding window] in models/llama.h), also masking keys
  // sliding_window or more indices before the query; undefined when sliding_window is 0.
  at::Tensor sliding_mask;
  std::vector<PastKeyValue> past;  // per layer [B, kv_heads, past, head_dim]; empty for none
  int64_t prompt_length = 0;       // leading positions to drop from the output
};

// embeddings [B,T,hidden]; attention_mask [B,T] or undefined; position_ids [B,T], [T] or undefined.
AdaptedInputs adapt_inputs(ModelAdapterImpl* adapter, const at::Tensor& embeddings, const at::Tensor& attention_mask,
                           const at::Tensor& position_ids, int64_t num_layers, int64_t sliding_window = 0);

}  // namespace detail
}  // namespace symbiosis
