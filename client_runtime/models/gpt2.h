#pragma once
// GPT-2 (GPT2LMHeadModel) with Hugging Face parameter names (transformer.h.3.attn.c_attn, ...).
// The four Conv1D layers of each block are symbiosis::nn::Conv1D base layers (weight [in, out]);
// embeddings, layer norms and attention are the client's. The LM head is tied to wte.
// Computes what transformers' eager GPT2LMHeadModel computes ("gelu_new" activation).
//
// [GPT-2 family] GPTBigCode (GPTBigCodeForCausalLM: StarCoder, SantaCoder) is this model with other
// settings, as transformers writes it after GPT-2's: the same config fields, parameter names and
// computation (learned positions, layer norms, GELU's tanh approximation, the head tied to wte), but
// its four layers of a block are Linear base layers (weight [out, in]), and with multi_query (its
// default) attention is multi-query: c_attn gives the queries [n_embd] then one key and one value
// head [head_dim] each. Without multi_query, c_attn's columns hold each head's q, k and v side by
// side. GPT2Config::model_type says which.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "client_runtime/models/kv_cache.h"
#include "client_runtime/nn.h"
#include "client_runtime/peft/model_adapter.h"

namespace symbiosis {

class Checkpoint;

// The fields of a GPT-2 (or GPTBigCode: [GPT-2 family]) config.json that the forward pass depends on.
struct GPT2Config {
  std::string model_type = "gpt2";  // "gpt2" or "gpt_bigcode"
  bool multi_query = false;         // GPTBigCode's one key/value head
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;
  int64_t n_embd = 768;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_inner = 0;  // 0 (null in config.json): 4 * n_embd
  double layer_norm_epsilon = 1e-5;

  // Reads config.json; throws naming the field for a missing or unsupported value (only
  // activation_function "gelu_new" or "gelu_pytorch_tanh", scale_attn_weights true, no
  // inverse-layer-idx scaling, no cross-attention).
  static GPT2Config from_checkpoint(const Checkpoint& ckpt);
  int64_t inner() const { return n_inner > 0 ? n_inner : 4 * n_embd; }
  int64_t head_dim() const { return n_embd / n_head; }
  int64_t kv_heads() const { return multi_query ? 1 : n_head; }
  // The base layers' kind: Conv1D for GPT-2, Linear for GPTBigCode.
  LayerKind layer_kind() const { return model_type == "gpt2" ? LayerKind::kConv1D : LayerKind::kLinear; }
  void validate() const;
};

class GPT2AttentionImpl : public torch::nn::Module {
 public:
  GPT2AttentionImpl(const GPT2Config& config, bool materialize_base);
  // x [B,T,E]; additive_mask [B,1,T,P+T]; past: keys and values [B,heads,P,head_dim] prepended to
  // this layer's (prefix tuning), or null. cache: a [Cached step]'s packed tokens (B = 1) attend
  // through the cache instead; mask and past are then unused.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& additive_mask, const PastKeyValue* past = nullptr,
                     const CachedLayer* cache = nullptr);
  nn::BaseLayer c_attn{nullptr}, c_proj{nullptr};  // Conv1D (GPT-2) or Linear (GPTBigCode)

 private:
  // q [B, n_head, T, head_dim], k and v [B, kv_heads, T, head_dim] of c_attn's output [B, T, ...].
  std::tuple<at::Tensor, at::Tensor, at::Tensor> split_heads(const at::Tensor& qkv) const;
  int64_t n_embd_, n_head_, kv_heads_;
  bool per_head_;  // c_attn's columns grouped by head (GPTBigCode without multi_query)
};
TORCH_MODULE(GPT2Attention);

class GPT2MLPImpl : public torch::nn::Module {
 public:
  GPT2MLPImpl(const GPT2Config& config, bool materialize_base);
  at::Tensor forward(const at::Tensor& x);  // c_proj(gelu_new(c_fc(x)))
  nn::BaseLayer c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(GPT2MLP);

class GPT2BlockImpl : public torch::nn::Module {
 public:
  GPT2BlockImpl(const GPT2Config& config, bool materialize_base);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& additive_mask, const PastKeyValue* past = nullptr,
                     const CachedLayer* cache = nullptr);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  GPT2Attention attn{nullptr};
  GPT2MLP mlp{nullptr};
};
TORCH_MODULE(GPT2Block);

// "transformer": embeddings, blocks, final layer norm. Returns the final hidden states [B,T,E].
class GPT2ModelImpl : public torch::nn::Module {
 public:
  GPT2ModelImpl(const GPT2Config& config, bool materialize_base);
  // adapter: a model-level PEFT adapter applied as [Model adapter conventions] say, or null.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {}, ModelAdapterImpl* adapter = nullptr);
  // [Cached step]: token embeddings [1, N, n_embd] of a step's packed tokens (positions not yet
  // added) -> final hidden states.
  at::Tensor forward_cached(const at::Tensor& embeddings, const CachedStep& step);
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  GPT2Config config_;
};
TORCH_MODULE(GPT2Model);

class GPT2LMHeadModelImpl : public torch::nn::Module, public ModelAdapterHost, public CachedModel {
 public:
  // materialize_base=false allocates no base-layer (Conv1D or Linear) weights: load them with
  // load_weights() or virtualize the model before calling forward.
  explicit GPT2LMHeadModelImpl(const GPT2Config& config, bool materialize_base = true);
  // input_ids [B,T] int64; attention_mask [B,T] of 1/0, optional; position_ids [B,T] or [T],
  // optional (default 0..T-1). Returns logits [B,T,vocab] in the model's dtype (lm_head tied to wte).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {});
  const GPT2Config& config() const { return config_; }

  // ModelAdapterHost: prompt tuning, P-tuning, prefix tuning (peft/model_adapter.h).
  void set_model_adapter(std::shared_ptr<ModelAdapterImpl> adapter) override;
  std::shared_ptr<ModelAdapterImpl> model_adapter() const override { return adapter_; }
  ModelShape model_shape() const override;

  // CachedModel: generation with a KvCache (models/kv_cache.h), up to n_positions.
  const at::Tensor& token_embeddings() const override { return transformer->wte->weight; }
  at::Tensor embed(const at::Tensor& ids) override { return transformer->wte->forward(ids); }
  at::Tensor forward_cached(const at::Tensor& embeddings, const CachedStep& step) override {
    return transformer->forward_cached(embeddings, step);
  }
  at::Tensor logits(const at::Tensor& hidden) override {
    return lm_head ? lm_head->forward(hidden) : at::linear(hidden, transformer->wte->weight);
  }
  std::optional<int64_t> max_positions() const override { return config_.n_positions; }

  // [Served tied head]: as LlamaForCausalLM's.
  void untie_head();

  GPT2Model transformer{nullptr};
  nn::Linear lm_head{nullptr};  // only where the executor serves the head tied to wte

 private:
  GPT2Config config_;
  std::shared_ptr<ModelAdapterImpl> adapter_;
};
TORCH_MODULE(GPT2LMHeadModel);

}  // namespace symbiosis
