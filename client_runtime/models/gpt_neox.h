#pragma once
// GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B) with Hugging Face parameter names
// (gpt_neox.layers.3.attention.query_key_value, ...): each layer's linear layers are
// symbiosis::nn::Linear base layers; embeddings, layer norms, attention and RoPE are the client's.
// Computes what transformers' eager GPTNeoXForCausalLM computes: RoPE over the first
// partial_rotary_factor (rotary_pct) of each head's features, q, k and v from one query_key_value
// layer whose columns hold each head's q, k and v side by side, attention and MLP in parallel from
// two layer norms (use_parallel_residual) or in sequence, exact GELU, an untied head (embed_out).
//
// [GPT-NeoX family] Phi (PhiForCausalLM: phi-1, phi-1.5, phi-2) and OPT (OPTForCausalLM) are this
// model with other settings and other names for the same parts (GPTNeoXNames): decoders of layer
// norms with biases, linear layers with biases, a plain (ungated) MLP. Phi: q, k and v are layers
// of their own (grouped-query attention possible), attention and a gelu_new MLP read one layer norm
// in parallel, RoPE over partial_rotary_factor, the head (lm_head) has a bias. OPT: learned positions
// offset by 2 (and, without position_ids, counted over the attention mask's tokens as transformers
// counts them, so a left-padded row starts at 0), q, k and v of their own, attention then a ReLU MLP
// in sequence (its fc1 and fc2 are the layer's own modules, not an mlp's), the head tied to the
// token embeddings. GPTNeoXConfig::model_type says which. Phi's qk_layernorm is refused.
//
// [OPT projections] OPT-350m's token embeddings are narrower than its decoder (word_embed_proj_dim
// 512, hidden_size 1024): project_in widens them (virtual tokens of prompt learning included, as
// they are prepended to the embeddings first) before the learned positions are added, and
// project_out narrows the decoder's output back to the tied head's width. Both are linear layers
// without biases of the base model, so they are base layers (model.decoder.project_in and
// .project_out, which LoRA may target by those names, as PEFT does); the executor's default layer
// pattern serves the decoder layers alone, so the client computes them unless a --layer-pattern
// names them. ModelShape::hidden_size is then the embeddings' width, what prompt learning's virtual
// tokens take. OPT-350m also normalizes after attention and after the MLP rather than before
// (do_layer_norm_before false: GPTNeoXConfig::post_layer_norms), and has no final layer norm.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <utility>

#include "client_runtime/models/kv_cache.h"
#include "client_runtime/nn.h"
#include "client_runtime/peft/model_adapter.h"

namespace symbiosis {

class Checkpoint;

// The fields of a GPT-NeoX (or Phi, OPT: [GPT-NeoX family]) config.json that the forward pass
// depends on.
struct GPTNeoXConfig {
  std::string model_type = "gpt_neox";  // "gpt_neox", "phi" or "opt"
  int64_t vocab_size = 50432;
  int64_t hidden_size = 6144;
  int64_t intermediate_size = 24576;  // OPT's ffn_dim
  int64_t num_hidden_layers = 44;
  int64_t num_attention_heads = 64;
  int64_t num_key_value_heads = 64;  // fewer for Phi's grouped-query attention only
  int64_t max_position_embeddings = 2048;
  double layer_norm_eps = 1e-5;
  // RoPE over the first rotary_dim() features of each head; 0 for OPT, whose positions are learned.
  double partial_rotary_factor = 0.25;
  double rope_theta = 10000.0;
  bool parallel_residual = true;    // attention and MLP both from the layer's input, added together
  bool attention_bias = true;       // biases on the attention's layers (the MLP's and norms' always have them)
  std::string hidden_act = "gelu";  // "gelu" (exact), "gelu_new" (tanh approximation) or "relu"
  bool tie_word_embeddings = false;
  // OPT only ([OPT projections]): the token embeddings' width, 0 for hidden_size; layer norms after
  // attention and after the MLP (do_layer_norm_before false), and no final norm.
  int64_t word_embed_proj_dim = 0;
  bool post_layer_norms = false;

  // Reads config.json (transformers 4's rotary_pct and rotary_emb_base, or partial_rotary_factor
  // and rope_theta, or transformers 5's rope_parameters); throws naming the field for a missing or
  // unsupported value.
  static GPTNeoXConfig from_checkpoint(const Checkpoint& ckpt);
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // As transformers computes it: int(head_dim * partial_rotary_factor).
  int64_t rotary_dim() const { return static_cast<int64_t>(head_dim() * partial_rotary_factor); }
  bool learned_positions() const { return model_type == "opt"; }
  // The token embeddings' width: word_embed_proj_dim where it is set ([OPT projections]), else hidden_size.
  int64_t embedding_width() const { return word_embed_proj_dim > 0 ? word_embed_proj_dim : hidden_size; }
  bool projected() const { return embedding_width() != hidden_size; }
  void validate() const;
};

// The names one architecture of the [GPT-NeoX family] gives its parts (its checkpoints' names). An
// empty name: the architecture has no such part.
struct GPTNeoXNames {
  std::string base;        // the decoder stack's path: "gpt_neox", "model" or "model.decoder"
  std::string embed;       // token embeddings
  std::string attention;   // a layer's attention
  std::string fused_qkv;   // q, k and v as one layer, each head's side by side (GPT-NeoX)
  std::string out;         // the attention's output layer
  std::string input_norm;  // before attention (and, without mlp_norm, before the MLP too)
  std::string mlp_norm;    // before the MLP
  std::string mlp;         // the MLP's module; empty: its layers are the layer's own (OPT)
  std::string mlp_in, mlp_out;
  std::string final_norm;
  std::string head;  // the untied head; empty when tied to the token embeddings
  static const GPTNeoXNames& of(const std::string& model_type);
};

class GPTNeoXAttentionImpl : public torch::nn::Module {
 public:
  GPTNeoXAttentionImpl(const GPTNeoXConfig& config, bool materialize_base);
  // x [B,T,H]; cos/sin [B,T,rotary_dim], undefined for learned positions; additive_mask
  // [B,1,T,P+T]; past: keys and values [B,kv_heads,P,head_dim] prepended to this layer's (prefix
  // tuning), or null. cache: a [Cached step]'s packed tokens (B = 1) attend through the cache
  // instead; mask and past are then unused.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& additive_mask,
                     const PastKeyValue* past = nullptr, const CachedLayer* cache = nullptr);
  // query_key_value (GPT-NeoX), or q_proj, k_proj and v_proj (Phi, OPT); out: dense or out_proj.
  nn::Linear query_key_value{nullptr}, q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out{nullptr};

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
};
TORCH_MODULE(GPTNeoXAttention);

class GPTNeoXLayerImpl : public torch::nn::Module {
 public:
  GPTNeoXLayerImpl(const GPTNeoXConfig& config, bool materialize_base);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& additive_mask,
                     const PastKeyValue* past = nullptr, const CachedLayer* cache = nullptr);
  GPTNeoXAttention attention{nullptr};
  torch::nn::LayerNorm input_norm{nullptr};
  torch::nn::LayerNorm mlp_norm{nullptr};  // null for Phi, whose MLP reads input_norm's output
  nn::Linear mlp_in{nullptr}, mlp_out{nullptr};

 private:
  at::Tensor mlp(const at::Tensor& x);
  bool parallel_residual_;
  bool post_layer_norms_;  // [OPT projections]: OPT-350m's norms after attention and after the MLP
  std::string hidden_act_;
};
TORCH_MODULE(GPTNeoXLayer);

// The decoder stack (GPTNeoXNames::base): embeddings, layers, final layer norm. Returns the final
// hidden states [B,T,H] (OPT-350m: projected out to the embeddings' width, [OPT projections]).
class GPTNeoXModelImpl : public torch::nn::Module {
 public:
  GPTNeoXModelImpl(const GPTNeoXConfig& config, bool materialize_base);
  // adapter: a model-level PEFT adapter applied as [Model adapter conventions] say, or null.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {}, ModelAdapterImpl* adapter = nullptr);
  // [Cached step]: token embeddings [1, N, hidden] of a step's packed tokens (learned positions not
  // yet added) -> final hidden states.
  at::Tensor forward_cached(const at::Tensor& embeddings, const CachedStep& step);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::Embedding embed_positions{nullptr};  // OPT only: [max_position_embeddings + 2, hidden]
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};              // null with OPT-350m's post-layer norms
  nn::Linear project_in{nullptr}, project_out{nullptr};  // [OPT projections]; null for the others

 private:
  // Runs the layers over h at int64 positions [B,T]: learned positions added, or RoPE's angles.
  at::Tensor run_layers(at::Tensor h, const at::Tensor& positions, const at::Tensor& additive_mask,
                        const std::vector<PastKeyValue>& past, const CachedStep* step);

  GPTNeoXConfig config_;
  at::Tensor inv_freq_;  // [rotary_dim/2] fp32, not a parameter; undefined for learned positions
};
TORCH_MODULE(GPTNeoXModel);

class GPTNeoXForCausalLMImpl : public torch::nn::Module, public ModelAdapterHost, public CachedModel {
 public:
  // materialize_base=false allocates no base-layer weights: load them with load_weights() or
  // virtualize the model before calling forward.
  explicit GPTNeoXForCausalLMImpl(const GPTNeoXConfig& config, bool materialize_base = true);
  // input_ids [B,T] int64; attention_mask [B,T] of 1/0, optional; position_ids [B,T] or [T],
  // optional (default 0..T-1; for OPT, counted over the mask's tokens). Returns logits [B,T,vocab]
  // in the model's dtype.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {});
  const GPTNeoXConfig& config() const { return config_; }

  // ModelAdapterHost: prompt tuning, P-tuning, prefix tuning (peft/model_adapter.h).
  void set_model_adapter(std::shared_ptr<ModelAdapterImpl> adapter) override;
  // [Served tied head]: as LlamaForCausalLM's (OPT's head, tied, becomes lm_head).
  void untie_head();
  std::shared_ptr<ModelAdapterImpl> model_adapter() const override { return adapter_; }
  ModelShape model_shape() const override;

  // CachedModel: generation with a KvCache (models/kv_cache.h); OPT's learned positions end at
  // max_position_embeddings, RoPE's do not.
  const at::Tensor& token_embeddings() const override { return model->embed_tokens->weight; }
  at::Tensor embed(const at::Tensor& ids) override { return model->embed_tokens->forward(ids); }
  at::Tensor forward_cached(const at::Tensor& embeddings, const CachedStep& step) override {
    return model->forward_cached(embeddings, step);
  }
  at::Tensor logits(const at::Tensor& hidden) override;
  std::optional<int64_t> max_positions() const override;

  GPTNeoXModel model{nullptr};
  // embed_out or lm_head; null when tied to the token embeddings (OPT) and not served
  nn::Linear head{nullptr};

 private:
  GPTNeoXConfig config_;
  std::shared_ptr<ModelAdapterImpl> adapter_;
};
TORCH_MODULE(GPTNeoXForCausalLM);

}  // namespace symbiosis
