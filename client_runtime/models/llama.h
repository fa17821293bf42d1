#pragma once
// Llama (LlamaForCausalLM) with Hugging Face parameter names, so a checkpoint's tensors load by
// name and the executor's layer table (model.layers.3.self_attn.q_proj, ...) matches the client's
// module paths. The seven projections of each decoder layer and the untied lm_head are
// symbiosis::nn::Linear base layers; embeddings, norms, attention and RoPE are the client's.
// Computes what transformers' eager LlamaForCausalLM computes: grouped-query attention, RoPE
// (default or "llama3" scaling), SwiGLU, causal mask plus optional padding mask; norms and softmax
// in fp32, everything else in the model's dtype.
//
// [Llama family] Qwen2 (Qwen2ForCausalLM), Mistral (MistralForCausalLM) and Gemma 2
// (Gemma2ForCausalLM) are this model with other settings, as transformers derives their classes
// from Llama's: the same parameter names and computation, plus biases on q, k and v (Qwen2),
// sliding-window attention (Mistral; Qwen2 with use_sliding_window, in its layers from
// max_window_layers on; Gemma 2 in alternate layers), and for Gemma 2 ([Gemma 2] below) more.
// LlamaConfig::model_type says which.
//
// [Sliding window] In a sliding-window layer the token at index i (in its sequence, cache and
// virtual tokens counted) attends to keys j with i - sliding_window < j <= i: itself and at most
// sliding_window - 1 tokens before it, as transformers' sliding_window_overlay masks
// (kv_idx > q_idx - sliding_window), in prefill and in decode alike. The KV cache keeps every
// token (a window's worth would do for these layers; the cache does not yet shrink them).
//
// [Gemma 2] Gemma2ForCausalLM is Llama with: RMSNorm scaling by 1 + weight, the product taken in
// fp32 before the cast back (LlamaRMSNorm's unit_offset); a norm after attention and one on each
// side of the MLP (post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm:
// LlamaConfig::sandwich_norms); GeGLU (gelu with tanh) instead of SwiGLU; token embeddings scaled
// by sqrt(hidden_size) rounded to the model's dtype; attention scores scaled by
// query_pre_attn_scalar^-1/2 and soft-capped, the logits soft-capped ([Logit soft-capping] in
// models/attention.h); sliding windows in the layers layer_types names (by default the even ones);
// the head tied to the embeddings.
//
// [Phi-3] Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4-mini) is Llama with fused projections: each
// attention's q, k and v are one base layer, qkv_proj (its output q, then k, then v), and each MLP's
// gate and up are one, gate_up_proj (gate, then up): LlamaConfig::fused_projections. These fused
// layers are the base layers the executor serves and PEFT's adapters target by those names; RoPE
// may turn only the first partial_rotary_factor of each head's features (Phi-4-mini: 0.75), and
// every layer attends over sliding_window tokens when it is set, as Mistral's.
//
// [LongRoPE] Phi-3's "longrope" RoPE scaling (Phi-3-mini-128k, Phi-3.5): two sets of per-frequency
// divisors, short_factor and long_factor, over the default inverse frequencies (1 / (factor_i ·
// theta^(2i/d))), and cos and sin multiplied by an attention factor (the config's, else sqrt(1 +
// ln(s) / ln(original)), s = max_position_embeddings / original, 1 when s <= 1). Which set applies
// is transformers' choice, per forward call: the long one when the call's largest position + 1
// exceeds original_max_position_embeddings (Phi-3's top-level field, 4096 by default; transformers
// takes it over the one in rope_scaling), else the short one, for every token of the call. So
// forward() takes the batch's largest position, as transformers' forward does (its padded rows
// included). transformers' generate() keeps that rule for each sequence: once its length passes
// original, Phi3ForCausalLM.prepare_inputs_for_generation drops the cache and recomputes the whole
// sequence with the long factors, so each step's logits equal the uncached forward over the
// sequence so far. A cached step ([Cached step]) therefore picks the set per sequence, by the
// length it reaches in the step (start + length): a prompt longer than original is long from its
// prefill on, a sequence that ends at or before original is short throughout, and both equal
// transformers' generate of that sequence alone (a batched generate switches a whole batch by its
// longest row, which continuous batching cannot follow). A sequence that crosses original in decode
// (its token at position original, after a prefill within it) is recomputed as transformers
// recomputes it: where the cache holds more than original positions, the model records each slot's
// step inputs below original in the cache (KvCache::recorded_inputs: a position's embedding,
// hidden_size numbers against its keys' and values' 2 x layers x kv_heads x head_dim), and a step
// in which a sequence crosses runs that sequence again as one piece from its first own position
// (after prefix tuning's past) to original, long factors throughout, rewriting its keys and values;
// the other sequences of the step run beside it as they were. A captured decode step ([Captured
// decode] in inference/generator.h) is replayed without the model's code, so it cannot; it refuses
// to be captured where the cache holds more than original positions, and the generator decodes
// eagerly there. With [Multi-adapter batches] the recomputed step has other rows than the generator
// named adapters for, which the adapters' layers refuse, naming the counts.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "client_runtime/models/kv_cache.h"
#include "client_runtime/nn.h"
#include "client_runtime/peft/model_adapter.h"

namespace symbiosis {

class Checkpoint;

// The fields of a Llama (or Qwen2, Mistral, Gemma 2: [Llama family]) config.json that the forward
// pass depends on.
struct LlamaConfig {
  std::string model_type = "llama";  // "llama", "qwen2", "qwen3", "mistral", "gemma2" or "phi3"
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 4096;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // RoPE scaling: "default" (none), "llama3" with the four fields below, or "longrope" ([LongRoPE],
  // Phi-3 only) with original_max_position_embeddings, the two factor lists and the attention factor.
  std::string rope_type = "default";
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 8192;
  std::vector<double> rope_short_factor, rope_long_factor;  // [LongRoPE]: rotary_dim() / 2 each
  double rope_attention_factor = 1.0;                       // [LongRoPE]: multiplies cos and sin
  // RoPE turns the first rotary_dim() = head_dim x partial_rotary_factor features of each head and
  // passes the rest ([Phi-3]'s Phi-4-mini: 0.75).
  double partial_rotary_factor = 1.0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // biases on q, k, v and o (Llama's attention_bias)
  bool qkv_bias = false;        // biases on q, k and v only (Qwen2)
  bool qk_norm = false;         // [Qwen3]: each head's q and k RMS-normalized before the rotary embedding
  bool mlp_bias = false;
  bool fused_projections = false;  // [Phi-3]: qkv_proj for q, k and v; gate_up_proj for gate and up
  // [Sliding window]: the window in tokens, 0 for none, and each layer's attention,
  // "full_attention" or "sliding_attention" (transformers' layer_types); empty: every layer full.
  int64_t sliding_window = 0;
  std::vector<std::string> layer_types;
  // The MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma 2's hidden_activation).
  std::string hidden_act = "silu";
  // [Gemma 2]: norms scale by 1 + weight and sit on both sides of attention and of the MLP; the
  // token embeddings are scaled by sqrt(hidden_size).
  bool sandwich_norms = false;
  bool scale_embeddings = false;
  // Attention scores are scaled by query_pre_attn_scalar^-1/2 (0: head_dim^-1/2); soft caps on the
  // attention scores and on the final logits, 0 for none ([Logit soft-capping] in models/attention.h).
  double query_pre_attn_scalar = 0.0;
  double attn_logit_softcapping = 0.0;
  double final_logit_softcapping = 0.0;

  // Reads config.json (both the transformers 4 keys rope_theta/rope_scaling and the transformers 5
  // rope_parameters); throws naming the field for a missing or unsupported value.
  static LlamaConfig from_checkpoint(const Checkpoint& ckpt);
  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  // As transformers computes it: int(head_dim * partial_rotary_factor).
  int64_t rotary_dim() const { return static_cast<int64_t>(resolved_head_dim() * partial_rotary_factor); }
  // Layer `layer`'s attention window in tokens ([Sliding window]), 0 when it attends fully.
  int64_t window_of(int64_t layer) const;
  // How every layer's attention forms its scores.
  AttentionScores attention_scores() const;
  // Checks the sizes agree with each other (heads divide, and so on); throws naming the field.
  void validate() const;
};

// RMSNorm: x / sqrt(mean(x²) + eps) · weight, statistics in fp32 (see forward). unit_offset: scales
// by 1 + weight, all in fp32, as Gemma 2's norm does ([Gemma 2]); its weight starts at 0.
class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  LlamaRMSNormImpl(int64_t hidden_size, double eps, bool unit_offset = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
  bool unit_offset_;
};
TORCH_MODULE(LlamaRMSNorm);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, bool materialize_base);
  // x [B,T,H]; cos/sin [B,T,head_dim]; additive_mask [B,1,T,P+T] (0 or the dtype's lowest; for a
  // sliding-window layer, the window's mask: [Sliding window]);
  // past: keys and values [B,kv_heads,P,head_dim] prepended to this layer's (prefix tuning), or null.
  // cache: a [Cached step]'s packed tokens (B = 1) attend through the cache instead; mask and past
  // are then unused.
  // qkv_base: q, k and v's base outputs of x side by side, computed already ([MLP bridges]), or
  // undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& additive_mask,
                     const PastKeyValue* past = nullptr, const CachedLayer* cache = nullptr,
                     const at::Tensor& qkv_base = {});
  std::vector<nn::BaseLayerImpl*> qkv_layers();
  // q_proj, k_proj and v_proj, or, with fused_projections ([Phi-3]), qkv_proj alone.
  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, qkv_proj{nullptr}, o_proj{nullptr};
  LlamaRMSNorm q_norm{nullptr}, k_norm{nullptr};  // [Qwen3] only: over head_dim, the tenant's weights

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  AttentionScores scores_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& config, bool materialize_base);
  at::Tensor forward(const at::Tensor& x);  // down(silu(gate(x)) * up(x)), or gelu_tanh for GeGLU
  // [MLP bridges]: nn::forward_mlp_bridge of this MLP into `next`, the next layer's attention.
  at::Tensor forward_bridge(const at::Tensor& h, LlamaAttentionImpl& next);
  std::vector<nn::BaseLayerImpl*> gate_up_layers();
  // gate_proj and up_proj, or, with fused_projections ([Phi-3]), gate_up_proj alone.
  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, gate_up_proj{nullptr}, down_proj{nullptr};

 private:
  std::string activation_;  // LlamaConfig::hidden_act: SwiGLU, or GeGLU ([Gemma 2])
};
TORCH_MODULE(LlamaMLP);

// [MLP bridges] (base_executor/base_model.h): what the layer before gave this one through a bridge,
// its input norm's output and its q, k and v base outputs side by side; undefined when none.
struct Bridged {
  at::Tensor normed, qkv;
};

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, bool materialize_base);
  // bridged, when given: what the layer before gave this one (read), then what this one gives
  // `next`, the layer after it (written) ([MLP bridges]).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& additive_mask,
                     const PastKeyValue* past = nullptr, const CachedLayer* cache = nullptr, Bridged* bridged = nullptr,
                     LlamaDecoderLayerImpl* next = nullptr);
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  // [Gemma 2]'s norms around the MLP (post_attention_layernorm then normalizes attention's output);
  // null for the rest of the family.
  LlamaRMSNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// "model": embeddings, decoder layers, final norm. Returns the final hidden states [B,T,H].
class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl(const LlamaConfig& config, bool materialize_base);
  // adapter: a model-level PEFT adapter applied as [Model adapter conventions] say, or null.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {}, ModelAdapterImpl* adapter = nullptr);
  // [Cached step]: embeddings [1, N, hidden] of a step's packed tokens -> final hidden states.
  at::Tensor forward_cached(const at::Tensor& embeddings, const CachedStep& step);
  // Token embeddings of ids, scaled by sqrt(hidden_size) for Gemma 2 (LlamaConfig::scale_embeddings).
  at::Tensor embed(const at::Tensor& ids);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  LlamaRMSNorm norm{nullptr};

 private:
  // RoPE's cos and sin [..., head_dim] in `dtype` for int64 positions [...]; long: bool, true where
  // [LongRoPE]'s long factors apply (a scalar for all, or one a position), undefined for the others.
  std::pair<at::Tensor, at::Tensor> rotary_angles(const at::Tensor& positions, at::ScalarType dtype,
                                                  const at::Tensor& long_factors = {});
  // [LongRoPE] in a cached step: for each packed token, whether its sequence takes the long factors.
  at::Tensor long_factors_of(const CachedStep& step) const;
  // [LongRoPE]: records the step's inputs below original in the cache; where a sequence crosses
  // original in this step, the step's hidden states computed anew with that sequence's whole input
  // (none where no sequence crosses).
  std::optional<at::Tensor> recompute_crossing(const at::Tensor& embeddings, const CachedStep& step);
  // Decoder layer i; null past the last.
  LlamaDecoderLayerImpl* layer(size_t i) {
    return i < layers->size() ? layers[i]->as<LlamaDecoderLayerImpl>() : nullptr;
  }

  LlamaConfig config_;
  at::Tensor inv_freq_;       // [rotary_dim/2] fp32, not a parameter and not in checkpoints; [LongRoPE]: short
  at::Tensor long_inv_freq_;  // [LongRoPE]: the long factors' [rotary_dim/2]; undefined for the others
};
TORCH_MODULE(LlamaModel);

class LlamaForCausalLMImpl : public torch::nn::Module, public ModelAdapterHost, public CachedModel {
 public:
  // materialize_base=false allocates no base-layer weights (the projections and lm_head): load
  // them with load_weights() or virtualize the model before calling forward.
  explicit LlamaForCausalLMImpl(const LlamaConfig& config, bool materialize_base = true);
  // input_ids [B,T] int64; attention_mask [B,T] of 1 (token) / 0 (padding), optional;
  // position_ids [B,T] or [T], optional (default 0..T-1, as transformers' forward uses).
  // Returns logits [B,T,vocab] in the model's dtype (causal_lm_loss computes in fp32).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {});
  const LlamaConfig& config() const { return config_; }

  // ModelAdapterHost: prompt tuning, P-tuning, prefix tuning (peft/model_adapter.h).
  void set_model_adapter(std::shared_ptr<ModelAdapterImpl> adapter) override;
  std::shared_ptr<ModelAdapterImpl> model_adapter() const override { return adapter_; }
  ModelShape model_shape() const override;

  // CachedModel: generation with a KvCache (models/kv_cache.h). No position limit: like
  // transformers, Llama goes on past max_position_embeddings.
  const at::Tensor& token_embeddings() const override { return model->embed_tokens->weight; }
  at::Tensor embed(const at::Tensor& ids) override { return model->embed(ids); }
  at::Tensor forward_cached(const at::Tensor& embeddings, const CachedStep& step) override {
    return model->forward_cached(embeddings, step);
  }
  at::Tensor logits(const at::Tensor& hidden) override;
  std::optional<int64_t> max_positions() const override { return std::nullopt; }

  // [Served tied head] (base_executor/base_model.cpp): a head tied to the embeddings becomes a
  // module of its own, lm_head, without weights, for virtualize() to bind to the executor's layer
  // of that name; an untied head stays as it is.
  void untie_head();

  LlamaModel model{nullptr};
  // Null when tie_word_embeddings (the logits use embed_tokens' weight) and not served.
  nn::Linear lm_head{nullptr};

 private:
  LlamaConfig config_;
  std::shared_ptr<ModelAdapterImpl> adapter_;
};
TORCH_MODULE(LlamaForCausalLM);

namespace detail {
// RoPE inverse frequencies as transformers computes them ("default" or "llama3"; "longrope": the
// short factors', or with long_factors the long ones'). fp32 [rotary_dim/2].
at::Tensor llama_inv_freq(const LlamaConfig& config, bool long_factors = false);
// The default RoPE's inverse frequencies over `dim` features: theta^-(2i/dim), fp32 [dim/2].
at::Tensor rotary_inv_freq(int64_t dim, double theta);
// RoPE's cos and sin [..., 2 x inv_freq] in `dtype` for int64 positions [...]: the angles in fp32,
// as transformers' rotary embeddings compute them, times `scale` in fp32 (its attention_scaling).
// inv_freq [rotary_dim/2], or [..., rotary_dim/2] with one set of frequencies a position.
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                 at::ScalarType dtype, double scale = 1.0);
// RoPE on x [..., head_dim]: x·cos + rotate_half(x)·sin, one autograd node when x takes a gradient.
// When cos and sin are narrower than x (partial rotary), only x's first cos.size(-1) features turn;
// the rest pass as they are.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
}  // namespace detail

}  // namespace symbiosis
