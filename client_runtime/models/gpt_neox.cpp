#include "client_runtime/models/gpt_neox.h"

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

#include "client_runtime/cpu_product.h"
#include "client_runtime/models/attention.h"
#include "client_runtime/models/config_fields.h"
#include "client_runtime/models/llama.h"
#include "common/checkpoint.h"

namespace symbiosis {

namespace {

// OPT's positions are offset by 2 in its embedding table (OPTLearnedPositionalEmbedding).
constexpr int64_t kOptPositionOffset = 2;

torch::nn::LayerNorm layer_norm(const GPTNeoXConfig& c) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps));
}

// Registers `child` under the dotted `path` of `parent`, through plain modules for the parts before
// the last ("model.decoder": OPT's decoder inside its model).
template <typename Child>
Child register_at(torch::nn::Module& parent, const std::string& path, Child child) {
  const auto dot = path.find('.');
  if (dot == std::string::npos) return parent.register_module(path, child);
  auto outer = parent.register_module(path.substr(0, dot), std::make_shared<torch::nn::Module>(path.substr(0, dot)));
  return register_at(*outer, path.substr(dot + 1), std::move(child));
}

}  // namespace

const GPTNeoXNames& GPTNeoXNames::of(const std::string& model_type) {
  static const GPTNeoXNames gpt_neox = {"gpt_neox",
                                        "embed_in",
                                        "attention",
                                        "query_key_value",
                                        "dense",
                                        "input_layernorm",
                                        "post_attention_layernorm",
                                        "mlp",
                                        "dense_h_to_4h",
                                        "dense_4h_to_h",
                                        "final_layer_norm",
                                        "embed_out"};
  static const GPTNeoXNames phi = {"model", "embed_tokens", "self_attn", "",    "dense",           "input_layernorm",
                                   "",      "mlp",          "fc1",       "fc2", "final_layernorm", "lm_head"};
  static const GPTNeoXNames opt = {"model.decoder",
                                   "embed_tokens",
                                   "self_attn",
                                   "",
                                   "out_proj",
                                   "self_attn_layer_norm",
                                   "final_layer_norm",
                                   "",
                                   "fc1",
                                   "fc2",
                                   "final_layer_norm",
                                   ""};
  if (model_type == "phi") return phi;
  if (model_type == "opt") return opt;
  TORCH_CHECK(model_type == "gpt_neox", "GPT-NeoX family: model_type '", model_type,
              "' is not supported (expected 'gpt_neox', 'phi' or 'opt')");
  return gpt_neox;
}

GPTNeoXConfig GPTNeoXConfig::from_checkpoint(const Checkpoint& ckpt) {
  using detail::optional_int;
  using detail::required_int;
  const auto where = ckpt.dir() / "config.json";
  GPTNeoXConfig c;
  c.model_type = ckpt.config_string("model_type").value_or("gpt_neox");
  TORCH_CHECK(c.model_type == "gpt_neox" || c.model_type == "phi" || c.model_type == "opt", where, ": model_type is '",
              c.model_type, "', expected 'gpt_neox', 'phi' or 'opt' for the GPT-NeoX family");
  const bool opt = c.model_type == "opt", phi = c.model_type == "phi";
  c.vocab_size = required_int(ckpt, "vocab_size");
  c.hidden_size = required_int(ckpt, "hidden_size");
  c.intermediate_size = required_int(ckpt, opt ? "ffn_dim" : "intermediate_size");
  c.num_hidden_layers = required_int(ckpt, "num_hidden_layers");
  c.num_attention_heads = required_int(ckpt, "num_attention_heads");
  c.num_key_value_heads =
      phi ? optional_int(ckpt, "num_key_value_heads", c.num_attention_heads) : c.num_attention_heads;
  c.max_position_embeddings = optional_int(ckpt, "max_position_embeddings", c.max_position_embeddings);
  c.layer_norm_eps = ckpt.config_number("layer_norm_eps").value_or(1e-5);  // OPT's LayerNorms: the default
  c.tie_word_embeddings = ckpt.config_bool("tie_word_embeddings").value_or(opt);
  c.parallel_residual = phi || (!opt && ckpt.config_bool("use_parallel_residual").value_or(true));
  c.hidden_act = ckpt.config_string(opt ? "activation_function" : "hidden_act")
                     .value_or(opt   ? "relu"
                               : phi ? "gelu_new"
                                     : "gelu");
  if (c.hidden_act == "gelu_pytorch_tanh" || c.hidden_act == "gelu_fast")
    c.hidden_act = "gelu_new";  // the same tanh form
  if (opt) {
    c.partial_rotary_factor = 0.0;
    c.attention_bias = ckpt.config_bool("enable_bias").value_or(true);
    TORCH_CHECK(c.attention_bias, where, ": enable_bias=false is not supported");
    c.post_layer_norms = !ckpt.config_bool("do_layer_norm_before").value_or(true);  // [OPT projections]
    TORCH_CHECK(!ckpt.config_bool("_remove_final_layer_norm").value_or(false), where,
                ": _remove_final_layer_norm=true is not supported");
    TORCH_CHECK(ckpt.config_bool("layer_norm_elementwise_affine").value_or(true), where,
                ": layer_norm_elementwise_affine=false is not supported");
    c.word_embed_proj_dim = optional_int(ckpt, "word_embed_proj_dim", c.hidden_size);
    TORCH_CHECK(c.word_embed_proj_dim > 0, where, ": field 'word_embed_proj_dim' is ", c.word_embed_proj_dim,
                ", expected a positive width");
    c.validate();
    return c;
  }
  c.attention_bias = !phi ? ckpt.config_bool("attention_bias").value_or(true) : true;
  TORCH_CHECK(!ckpt.config_bool("qk_layernorm").value_or(false), where, ": qk_layernorm=true is not supported");
  // transformers 5 writes rope_parameters {rope_type, rope_theta, partial_rotary_factor}; transformers
  // 4 writes GPT-NeoX's rotary_pct and rotary_emb_base, Phi's partial_rotary_factor and rope_theta.
  const std::string rope = ckpt.config_has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  const auto rope_type =
      ckpt.config_string(rope + ".rope_type").value_or(ckpt.config_string(rope + ".type").value_or("default"));
  TORCH_CHECK(rope_type == "default", where, ": rope type '", rope_type, "' is not supported (expected 'default')");
  const double default_theta = ckpt.config_number(phi ? "rope_theta" : "rotary_emb_base").value_or(10000.0);
  c.rope_theta = ckpt.config_number(rope + ".rope_theta").value_or(default_theta);
  const double default_factor =
      phi ? ckpt.config_number("partial_rotary_factor").value_or(0.5) : ckpt.config_number("rotary_pct").value_or(0.25);
  c.partial_rotary_factor = ckpt.config_number(rope + ".partial_rotary_factor").value_or(default_factor);
  c.validate();
  return c;
}

void GPTNeoXConfig::validate() const {
  GPTNeoXNames::of(model_type);  // a known architecture
  TORCH_CHECK(vocab_size > 0 && hidden_size > 0 && intermediate_size > 0 && num_hidden_layers >= 0 &&
                  max_position_embeddings > 0,
              "GPT-NeoX config: vocab_size, hidden_size, intermediate_size, max_position_embeddings must be positive");
  TORCH_CHECK(num_attention_heads > 0 && hidden_size % num_attention_heads == 0, "GPT-NeoX config: hidden_size (",
              hidden_size, ") is not divisible by num_attention_heads (", num_attention_heads, ")");
  TORCH_CHECK(num_key_value_heads > 0 && num_attention_heads % num_key_value_heads == 0,
              "GPT-NeoX config: num_attention_heads (", num_attention_heads,
              ") must be a positive multiple of num_key_value_heads (", num_key_value_heads, ")");
  TORCH_CHECK(model_type == "phi" || num_key_value_heads == num_attention_heads, "GPT-NeoX config: ", model_type,
              " has no grouped-query attention (num_key_value_heads ", num_key_value_heads, ")");
  TORCH_CHECK(
      learned_positions() ? partial_rotary_factor == 0 : partial_rotary_factor > 0 && partial_rotary_factor <= 1,
      "GPT-NeoX config: partial_rotary_factor is ", partial_rotary_factor, ", expected more than 0 and at most 1",
      learned_positions() ? " (0 for OPT's learned positions)" : "");
  TORCH_CHECK(rotary_dim() % 2 == 0, "GPT-NeoX config: RoPE's dimension ", rotary_dim(), " (head_dim ", head_dim(),
              " x partial_rotary_factor ", partial_rotary_factor, ") must be even");
  TORCH_CHECK(hidden_act == "gelu" || hidden_act == "gelu_new" || hidden_act == "relu", "GPT-NeoX config: activation '",
              hidden_act, "' is not supported (expected 'gelu', 'gelu_new' or 'relu')");
  TORCH_CHECK(model_type != "opt" || tie_word_embeddings, "GPT-NeoX config: OPT's head is tied to its embeddings");
  TORCH_CHECK(model_type == "opt" || (!projected() && !post_layer_norms), "GPT-NeoX config: word_embed_proj_dim (",
              word_embed_proj_dim, ") and post-layer norms are OPT's ([OPT projections]), not ", model_type, "'s");
  TORCH_CHECK(!post_layer_norms || !parallel_residual,
              "GPT-NeoX config: post-layer norms need attention and MLP in sequence");
}

GPTNeoXAttentionImpl::GPTNeoXAttentionImpl(const GPTNeoXConfig& c, bool materialize_base)
    : num_heads_(c.num_attention_heads), num_kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim()) {
  const auto& names = GPTNeoXNames::of(c.model_type);
  const int64_t q_out = num_heads_ * head_dim_, kv_out = num_kv_heads_ * head_dim_;
  const bool bias = c.attention_bias;  // base weights: served with the layer
  if (!names.fused_qkv.empty()) {
    query_key_value =
        register_module(names.fused_qkv, nn::Linear(c.hidden_size, q_out + 2 * kv_out, bias, materialize_base));
  } else {
    q_proj = register_module("q_proj", nn::Linear(c.hidden_size, q_out, bias, materialize_base));
    k_proj = register_module("k_proj", nn::Linear(c.hidden_size, kv_out, bias, materialize_base));
    v_proj = register_module("v_proj", nn::Linear(c.hidden_size, kv_out, bias, materialize_base));
  }
  out = register_module(names.out, nn::Linear(q_out, c.hidden_size, bias, materialize_base));
}

at::Tensor GPTNeoXAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                         const at::Tensor& additive_mask, const PastKeyValue* past,
                                         const CachedLayer* cache) {
  const int64_t batch = x.size(0), length = x.size(1);
  at::Tensor q, k, v;
  if (query_key_value) {  // [..., head, (q k v)], as GPTNeoXAttention views it
    auto parts = query_key_value->forward(x)
                     .view({batch, length, num_heads_, 3 * head_dim_})
                     .transpose(1, 2)
                     .split(head_dim_, 3);
    q = parts[0], k = parts[1], v = parts[2];
  } else {  // [Layer groups]: q, k and v read x, and are one product where they can be
    const auto qkv = nn::forward_siblings({q_proj.get(), k_proj.get(), v_proj.get()}, x);
    q = qkv[0].view({batch, length, num_heads_, head_dim_}).transpose(1, 2);
    k = qkv[1].view({batch, length, num_kv_heads_, head_dim_}).transpose(1, 2);
    v = qkv[2].view({batch, length, num_kv_heads_, head_dim_}).transpose(1, 2);
  }
  if (cos.defined()) {  // RoPE over the first rotary_dim features (detail::apply_rotary)
    auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    q = detail::apply_rotary(q, c, s);
    k = detail::apply_rotary(k, c, s);
  }
  if (past != nullptr) {
    k = at::cat({past->key, k}, 2);
    v = at::cat({past->value, v}, 2);
  }
  auto heads = cache ? cache->attend(q, k, v) : detail::attention(q, k, v, additive_mask);
  return out->forward(heads.transpose(1, 2).reshape({batch, length, num_heads_ * head_dim_}));
}

GPTNeoXLayerImpl::GPTNeoXLayerImpl(const GPTNeoXConfig& c, bool materialize_base)
    : parallel_residual_(c.parallel_residual), post_layer_norms_(c.post_layer_norms), hidden_act_(c.hidden_act) {
  const auto& names = GPTNeoXNames::of(c.model_type);
  attention = register_module(names.attention, GPTNeoXAttention(c, materialize_base));
  input_norm = register_module(names.input_norm, layer_norm(c));
  if (!names.mlp_norm.empty()) mlp_norm = register_module(names.mlp_norm, layer_norm(c));
  // OPT's fc1 and fc2 are the layer's own; the others' sit in an mlp module.
  torch::nn::Module* mlp_parent = this;
  if (!names.mlp.empty()) mlp_parent = register_module(names.mlp, std::make_shared<torch::nn::Module>(names.mlp)).get();
  mlp_in = mlp_parent->register_module(names.mlp_in,
                                       nn::Linear(c.hidden_size, c.intermediate_size, /*bias=*/true, materialize_base));
  mlp_out = mlp_parent->register_module(
      names.mlp_out, nn::Linear(c.intermediate_size, c.hidden_size, /*bias=*/true, materialize_base));
}

at::Tensor GPTNeoXLayerImpl::mlp(const at::Tensor& x) {
  auto h = mlp_in->forward(x);
  if (hidden_act_ == "relu") {
    h = at::relu(h);
  } else {
    h = hidden_act_ == "gelu" ? at::gelu(h) : at::gelu(h, "tanh");  // gelu_new is GELU's tanh approximation
  }
  return mlp_out->forward(h);
}

at::Tensor GPTNeoXLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& additive_mask, const PastKeyValue* past,
                                     const CachedLayer* cache) {
  if (post_layer_norms_) {  // [OPT projections]: OPT-350m normalizes each sum (OPTDecoderLayer, 350m)
    const auto h = input_norm->forward(x + attention->forward(x, cos, sin, additive_mask, past, cache));
    return mlp_norm->forward(h + mlp(h));
  }
  const auto normed = input_norm->forward(x);
  auto attended = attention->forward(normed, cos, sin, additive_mask, past, cache);
  if (!parallel_residual_) {
    auto h = x + attended;
    return h + mlp(mlp_norm->forward(h));
  }
  // GPT-NeoX: mlp(post_attention_layernorm(x)) + attention + x; Phi: the MLP reads the same norm.
  return mlp(mlp_norm ? mlp_norm->forward(x) : normed) + attended + x;
}

GPTNeoXModelImpl::GPTNeoXModelImpl(const GPTNeoXConfig& c, bool materialize_base) : config_(c) {
  config_.validate();
  const auto& names = GPTNeoXNames::of(c.model_type);
  embed_tokens = register_module(names.embed, nn::unfilled_embedding(c.vocab_size, c.embedding_width()));
  if (c.projected()) {  // [OPT projections]: base layers, without biases
    project_in = register_module("project_in", nn::Linear(c.embedding_width(), c.hidden_size, false, materialize_base));
    project_out =
        register_module("project_out", nn::Linear(c.hidden_size, c.embedding_width(), false, materialize_base));
  }
  if (c.learned_positions()) {
    embed_positions = register_module(
        "embed_positions", nn::unfilled_embedding(c.max_position_embeddings + kOptPositionOffset, c.hidden_size));
  } else {
    inv_freq_ = detail::rotary_inv_freq(c.rotary_dim(), c.rope_theta);
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(GPTNeoXLayer(c, materialize_base));
  if (!c.post_layer_norms) final_norm = register_module(names.final_norm, layer_norm(c));
}

at::Tensor GPTNeoXModelImpl::run_layers(at::Tensor h, const at::Tensor& positions, const at::Tensor& additive_mask,
                                        const std::vector<PastKeyValue>& past, const CachedStep* step) {
  at::Tensor cos, sin;
  if (project_in) h = project_in->forward(h);  // [OPT projections]: the embeddings, virtual tokens included
  if (config_.learned_positions()) {
    h = h + embed_positions->forward(positions + kOptPositionOffset);
  } else {
    if (inv_freq_.device() != positions.device()) inv_freq_ = inv_freq_.to(positions.device());
    std::tie(cos, sin) = detail::rotary_cos_sin(positions, inv_freq_, h.scalar_type());
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    auto* layer = layers[i]->as<GPTNeoXLayerImpl>();
    if (step != nullptr) {
      const CachedLayer cache{step, static_cast<int64_t>(i)};
      h = layer->forward(h, cos, sin, {}, nullptr, &cache);
    } else {
      h = layer->forward(h, cos, sin, additive_mask, past.empty() ? nullptr : &past[i]);
    }
  }
  if (final_norm) h = final_norm->forward(h);
  return project_out ? project_out->forward(h) : h;
}

at::Tensor GPTNeoXModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                     const at::Tensor& position_ids, ModelAdapterImpl* adapter) {
  TORCH_CHECK(input_ids.dim() == 2, "input_ids has shape ", input_ids.sizes(), ", expected [batch, tokens]");
  const int64_t length = input_ids.size(1);
  auto positions = position_ids;
  if (!positions.defined() && attention_mask.defined() && config_.learned_positions()) {
    // OPT counts positions over the mask's tokens (padding at -1), as OPTDecoder does.
    const auto mask = attention_mask.to(at::kLong);
    positions = mask.cumsum(1) * mask - 1;
  }
  auto in = detail::adapt_inputs(adapter, embed_tokens->forward(input_ids), attention_mask, positions,
                                 config_.num_hidden_layers);
  if (config_.learned_positions()) {
    // Here, not in run_layers: a cached step's positions are the Generator's, held to max_positions()
    // when a request is submitted, and a captured step cannot read them back ([Captured decode]).
    const int64_t last = in.position_ids.numel() > 0 ? in.position_ids.max().item<int64_t>() : 0;
    TORCH_CHECK(last < config_.max_position_embeddings, config_.model_type, " input reaches position ", last,
                " (virtual tokens included), beyond max_position_embeddings (", config_.max_position_embeddings, ")");
  }
  auto h = run_layers(in.embeddings, in.position_ids, in.additive_mask, in.past, nullptr);
  return in.prompt_length > 0 ? h.narrow(1, in.prompt_length, length) : h;
}

at::Tensor GPTNeoXModelImpl::forward_cached(const at::Tensor& embeddings, const CachedStep& step) {
  return run_layers(embeddings, step.positions().unsqueeze(0), {}, {}, &step);
}

GPTNeoXForCausalLMImpl::GPTNeoXForCausalLMImpl(const GPTNeoXConfig& c, bool materialize_base) : config_(c) {
  const auto& names = GPTNeoXNames::of(c.model_type);
  model = register_at(*this, names.base, GPTNeoXModel(c, materialize_base));
  if (!c.tie_word_embeddings) {
    const bool bias = c.model_type == "phi";  // Phi's lm_head has one
    head = register_module(names.head.empty() ? "lm_head" : names.head,
                           nn::Linear(c.hidden_size, c.vocab_size, bias, materialize_base));
  }
}

at::Tensor GPTNeoXForCausalLMImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                           const at::Tensor& position_ids) {
  return logits(model->forward(input_ids, attention_mask, position_ids, adapter_.get()));
}

// In the model's dtype (see LlamaForCausalLM::logits); tied: [CPU decode product] where it applies.
at::Tensor GPTNeoXForCausalLMImpl::logits(const at::Tensor& hidden) {
  return head ? head->forward(hidden) : nn::detail::linear_no_bias(hidden, model->embed_tokens->weight);
}

void GPTNeoXForCausalLMImpl::untie_head() {
  if (!head) head = register_module("lm_head", nn::untied_head(model->embed_tokens->weight));
}

std::optional<int64_t> GPTNeoXForCausalLMImpl::max_positions() const {
  if (config_.learned_positions()) return config_.max_position_embeddings;
  return std::nullopt;
}

void GPTNeoXForCausalLMImpl::set_model_adapter(std::shared_ptr<ModelAdapterImpl> adapter) {
  TORCH_CHECK(!adapter_, "the model already has a model-level adapter");
  adapter_ = register_module("adapter", std::move(adapter));
}

// hidden_size: the token embeddings' width, what virtual tokens take ([OPT projections]).
ModelShape GPTNeoXForCausalLMImpl::model_shape() const {
  return {config_.model_type,          config_.num_hidden_layers,   config_.embedding_width(),
          config_.num_attention_heads, config_.num_key_value_heads, config_.head_dim()};
}

}  // namespace symbiosis
