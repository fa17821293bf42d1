#include "client_runtime/models/gpt2.h"

#include <ATen/ATen.h>

#include <utility>

#include "client_runtime/models/attention.h"
#include "client_runtime/models/config_fields.h"
#include "common/checkpoint.h"

namespace symbiosis {

GPT2Config GPT2Config::from_checkpoint(const Checkpoint& ckpt) {
  using detail::required_int;
  const auto where = ckpt.dir() / "config.json";
  GPT2Config c;
  c.model_type = ckpt.config_string("model_type").value_or("gpt2");
  TORCH_CHECK(c.model_type == "gpt2" || c.model_type == "gpt_bigcode", where, ": model_type is '", c.model_type,
              "', expected 'gpt2' or 'gpt_bigcode' for the GPT-2 family");
  const bool bigcode = c.model_type == "gpt_bigcode";
  c.multi_query = bigcode && ckpt.config_bool("multi_query").value_or(true);  // GPTBigCodeConfig's default
  c.vocab_size = required_int(ckpt, "vocab_size");
  c.n_positions = required_int(ckpt, "n_positions");
  c.n_embd = required_int(ckpt, "n_embd");
  c.n_layer = required_int(ckpt, "n_layer");
  c.n_head = required_int(ckpt, "n_head");
  c.n_inner = detail::optional_int(ckpt, "n_inner", c.n_inner);  // null reads as absent
  c.layer_norm_epsilon = ckpt.config_number("layer_norm_epsilon").value_or(1e-5);
  // Both are GELU's tanh approximation, what forward computes.
  auto act = ckpt.config_string("activation_function").value_or(bigcode ? "gelu_pytorch_tanh" : "gelu_new");
  TORCH_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", where, ": activation_function '", act,
              "' is not supported (expected 'gelu_new' or 'gelu_pytorch_tanh')");
  TORCH_CHECK(ckpt.config_bool("scale_attn_weights").value_or(true), where,
              ": scale_attn_weights=false is not supported");
  TORCH_CHECK(!ckpt.config_bool("scale_attn_by_inverse_layer_idx").value_or(false), where,
              ": scale_attn_by_inverse_layer_idx=true is not supported");
  TORCH_CHECK(!ckpt.config_bool("reorder_and_upcast_attn").value_or(false), where,
              ": reorder_and_upcast_attn=true is not supported");
  TORCH_CHECK(!ckpt.config_bool("add_cross_attention").value_or(false), where,
              ": add_cross_attention=true is not supported");
  TORCH_CHECK(ckpt.config_bool("tie_word_embeddings").value_or(true), where,
              ": tie_word_embeddings=false is not supported for the GPT-2 family");
  c.validate();
  return c;
}

void GPT2Config::validate() const {
  TORCH_CHECK(vocab_size > 0 && n_positions > 0 && n_embd > 0 && n_layer >= 0 && n_head > 0,
              "GPT-2 config: vocab_size, n_positions, n_embd, n_head must be positive");
  TORCH_CHECK(n_embd % n_head == 0, "GPT-2 config: n_embd (", n_embd, ") is not divisible by n_head (", n_head, ")");
  TORCH_CHECK(model_type == "gpt2" || model_type == "gpt_bigcode", "GPT-2 config: model_type '", model_type,
              "' is not supported (expected 'gpt2' or 'gpt_bigcode')");
  TORCH_CHECK(!multi_query || model_type == "gpt_bigcode", "GPT-2 config: multi_query is GPTBigCode's, not ",
              model_type, "'s");
}

GPT2AttentionImpl::GPT2AttentionImpl(const GPT2Config& c, bool materialize_base)
    : n_embd_(c.n_embd),
      n_head_(c.n_head),
      kv_heads_(c.kv_heads()),
      per_head_(c.model_type == "gpt_bigcode" && !c.multi_query) {
  const int64_t qkv_out = c.n_embd + 2 * kv_heads_ * c.head_dim();
  const auto kind = c.layer_kind();
  c_attn = register_module("c_attn", nn::BaseLayer(kind, c.n_embd, qkv_out, /*bias=*/true, materialize_base));
  c_proj = register_module("c_proj", nn::BaseLayer(kind, c.n_embd, c.n_embd, /*bias=*/true, materialize_base));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> GPT2AttentionImpl::split_heads(const at::Tensor& qkv) const {
  const int64_t batch = qkv.size(0), length = qkv.size(1), head_dim = n_embd_ / n_head_;
  if (per_head_) {  // [..., head, (q k v)] as GPTBigCodeAttention views it without multi_query
    auto parts = qkv.view({batch, length, n_head_, 3 * head_dim}).transpose(1, 2).split(head_dim, 3);
    return {parts[0], parts[1], parts[2]};
  }
  auto parts = qkv.split({n_embd_, kv_heads_ * head_dim, kv_heads_ * head_dim}, 2);
  auto heads = [&](const at::Tensor& t, int64_t count) {
    return t.view({batch, length, count, head_dim}).transpose(1, 2);
  };
  return {heads(parts[0], n_head_), heads(parts[1], kv_heads_), heads(parts[2], kv_heads_)};
}

at::Tensor GPT2AttentionImpl::forward(const at::Tensor& x, const at::Tensor& additive_mask, const PastKeyValue* past,
                                      const CachedLayer* cache) {
  const int64_t batch = x.size(0), length = x.size(1);
  // Multi-query attention ([GPT-2 family]) is grouped-query attention with one group.
  auto [q, k, v] = split_heads(c_attn->forward(x));
  if (past != nullptr) {
    k = at::cat({past->key, k}, 2);
    v = at::cat({past->value, v}, 2);
  }
  auto heads_out = cache ? cache->attend(q, k, v) : detail::attention(q, k, v, additive_mask);
  auto out = heads_out.transpose(1, 2).reshape({batch, length, n_embd_});
  return c_proj->forward(out);
}

GPT2MLPImpl::GPT2MLPImpl(const GPT2Config& c, bool materialize_base) {
  const auto kind = c.layer_kind();
  c_fc = register_module("c_fc", nn::BaseLayer(kind, c.n_embd, c.inner(), /*bias=*/true, materialize_base));
  c_proj = register_module("c_proj", nn::BaseLayer(kind, c.inner(), c.n_embd, /*bias=*/true, materialize_base));
}

at::Tensor GPT2MLPImpl::forward(const at::Tensor& x) {
  // gelu_new (and gelu_pytorch_tanh) is GELU's tanh approximation.
  return c_proj->forward(at::gelu(c_fc->forward(x), "tanh"));
}

GPT2BlockImpl::GPT2BlockImpl(const GPT2Config& c, bool materialize_base) {
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)); };
  ln_1 = register_module("ln_1", ln());
  attn = register_module("attn", GPT2Attention(c, materialize_base));
  ln_2 = register_module("ln_2", ln());
  mlp = register_module("mlp", GPT2MLP(c, materialize_base));
}

at::Tensor GPT2BlockImpl::forward(const at::Tensor& x, const at::Tensor& additive_mask, const PastKeyValue* past,
                                  const CachedLayer* cache) {
  auto h = x + attn->forward(ln_1->forward(x), additive_mask, past, cache);
  return h + mlp->forward(ln_2->forward(h));
}

GPT2ModelImpl::GPT2ModelImpl(const GPT2Config& c, bool materialize_base) : config_(c) {
  config_.validate();
  wte = register_module("wte", nn::unfilled_embedding(c.vocab_size, c.n_embd));
  wpe = register_module("wpe", nn::unfilled_embedding(c.n_positions, c.n_embd));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) h->push_back(GPT2Block(c, materialize_base));
  ln_f =
      register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)));
}

at::Tensor GPT2ModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                  const at::Tensor& position_ids, ModelAdapterImpl* adapter) {
  TORCH_CHECK(input_ids.dim() == 2, "input_ids has shape ", input_ids.sizes(), ", expected [batch, tokens]");
  const int64_t length = input_ids.size(1);
  auto in = detail::adapt_inputs(adapter, wte->forward(input_ids), attention_mask, position_ids, config_.n_layer);
  const int64_t last_position = in.position_ids.numel() > 0 ? in.position_ids.max().item<int64_t>() : 0;
  TORCH_CHECK(last_position < config_.n_positions, "GPT-2 input reaches position ", last_position,
              " (virtual tokens included), beyond n_positions (", config_.n_positions, ")");
  auto x = in.embeddings + wpe->forward(in.position_ids);
  for (size_t i = 0; i < h->size(); ++i) {
    const PastKeyValue* past = in.past.empty() ? nullptr : &in.past[i];
    x = h[i]->as<GPT2BlockImpl>()->forward(x, in.additive_mask, past);
  }
  x = ln_f->forward(x);
  return in.prompt_length > 0 ? x.narrow(1, in.prompt_length, length) : x;
}

at::Tensor GPT2ModelImpl::forward_cached(const at::Tensor& embeddings, const CachedStep& step) {
  auto x = embeddings + wpe->forward(step.positions()).unsqueeze(0);
  for (size_t i = 0; i < h->size(); ++i) {
    const CachedLayer cache{&step, static_cast<int64_t>(i)};
    x = h[i]->as<GPT2BlockImpl>()->forward(x, {}, nullptr, &cache);
  }
  return ln_f->forward(x);
}

GPT2LMHeadModelImpl::GPT2LMHeadModelImpl(const GPT2Config& c, bool materialize_base) : config_(c) {
  transformer = register_module("transformer", GPT2Model(c, materialize_base));
}

at::Tensor GPT2LMHeadModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                        const at::Tensor& position_ids) {
  // In the model's dtype (see LlamaForCausalLM::logits).
  return logits(transformer->forward(input_ids, attention_mask, position_ids, adapter_.get()));
}

void GPT2LMHeadModelImpl::untie_head() {
  if (!lm_head) lm_head = register_module("lm_head", nn::untied_head(transformer->wte->weight));
}

void GPT2LMHeadModelImpl::set_model_adapter(std::shared_ptr<ModelAdapterImpl> adapter) {
  TORCH_CHECK(!adapter_, "the model already has a model-level adapter");
  adapter_ = register_module("adapter", std::move(adapter));
}

ModelShape GPT2LMHeadModelImpl::model_shape() const {
  return {config_.model_type, config_.n_layer, config_.n_embd, config_.n_head, config_.kv_heads(), config_.head_dim()};
}

}  // namespace symbiosis
