#include "client_runtime/models/llama.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "client_runtime/cpu_product.h"
#include "client_runtime/models/attention.h"
#include "client_runtime/models/config_fields.h"
#include "common/checkpoint.h"
#include "common/gated_activation.h"
#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include "kernels/rotary.h"
#include "kernels/swiglu.h"
#endif

namespace symbiosis {

namespace {

// silu(gate) · up: one kernel on a GPU ([Fused SwiGLU] in kernels/swiglu.h), ATen's elsewhere.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) { return gated_activation("silu", gate, up); }

// Its gradients for an upstream gradient `grad`, written into grad_gate and grad_up.
void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, at::Tensor grad_gate,
                     at::Tensor grad_up) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (gate.is_cuda()) return kernels::swiglu_backward(grad, gate, up, grad_gate, grad_up);
#endif
  at::silu_backward_out(grad_gate, grad * up, gate);
  at::mul_out(grad_up, grad, at::silu(gate));
}

// silu(gate) · up, keeping only gate and up for backward (autograd alone would also keep silu(gate):
// a third [tokens, intermediate] tensor per layer, 1.1 GB for a Llama-2-13B step of 1024 tokens).
// The gradients are the ones autograd computes: silu_backward and a product with silu(gate).
class SwiGLU : public torch::autograd::Function<SwiGLU> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return swiglu(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &up = saved[1];
    auto grad_gate = at::empty_like(gate, at::MemoryFormat::Contiguous);
    auto grad_up = at::empty_like(up, at::MemoryFormat::Contiguous);
    swiglu_backward(grads[0], gate, up, grad_gate, grad_up);
    return {grad_gate, grad_up};
  }
};

// [..., 2n] -> its two halves [..., n] (views).
std::pair<at::Tensor, at::Tensor> halves(const at::Tensor& t) {
  const int64_t n = t.size(-1) / 2;
  return {t.narrow(-1, 0, n), t.narrow(-1, n, n)};
}

// SwiGLU of gate and up side by side in one tensor ([..., 2 x intermediate], what a [Layer groups]
// call of gate_proj and up_proj gives): its gradient is written side by side too, so the group's
// backward call reads it as it lies, without the two halves first concatenated (a pass over
// 2 x [tokens, intermediate] a layer).
class StackedSwiGLU : public torch::autograd::Function<StackedSwiGLU> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    ctx->save_for_backward({gate_up});
    const auto [gate, up] = halves(gate_up);
    return swiglu(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto gate_up = ctx->get_saved_variables()[0];
    const auto [gate, up] = halves(gate_up);
    auto grad_gate_up = at::empty_like(gate_up, at::MemoryFormat::Contiguous);
    const auto [grad_gate, grad_up] = halves(grad_gate_up);
    swiglu_backward(grads[0], gate, up, grad_gate, grad_up);
    return {grad_gate_up};
  }
};

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// x·cos + rotate_half(x)·sin, or its transpose g·cos - rotate_half(g·sin) (backward): one kernel on
// a GPU ([Fused rotary embedding] in kernels/rotary.h), ATen's expression elsewhere.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (x.is_cuda() && x.dim() == 4 && x.stride(3) == 1 && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
      cos.scalar_type() == x.scalar_type()) {
    return kernels::rotary(x, cos, sin, backward);
  }
#endif
  return backward ? x * cos - rotate_half(x * sin) : x * cos + rotate_half(x) * sin;
}

// RoPE, x·cos + rotate_half(x)·sin, as one autograd node. Left to autograd it is eight nodes per
// tensor, two of them slice backwards that each fill a zero tensor of x's size: the largest share
// of a client's host time after the base-layer calls (docs/benchmarks-history.md, [Op profile]).
// The gradient is the one autograd computes: rotate_half's transpose is -rotate_half, so
// dx = g·cos - rotate_half(g·sin). cos and sin take no gradient.
class Rotary : public torch::autograd::Function<Rotary> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotary(x, cos, sin, /*backward=*/false);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {rotary(grads[0], saved[0], saved[1], /*backward=*/true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

namespace detail {
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t turned = cos.size(-1);
  if (turned < x.size(-1)) {  // partial rotary: the first `turned` features, then the rest as they are
    return at::cat({apply_rotary(x.narrow(-1, 0, turned), cos, sin), x.narrow(-1, turned, x.size(-1) - turned)}, -1);
  }
  if (at::GradMode::is_enabled() && x.requires_grad()) return Rotary::apply(x, cos, sin);
  return rotary(x, cos, sin, /*backward=*/false);
}
}  // namespace detail

LlamaConfig LlamaConfig::from_checkpoint(const Checkpoint& ckpt) {
  using detail::optional_int;
  using detail::required_int;
  const auto where = ckpt.dir() / "config.json";
  LlamaConfig c;
  c.model_type = ckpt.config_string("model_type").value_or("llama");
  const bool known = c.model_type == "llama" || c.model_type == "qwen2" || c.model_type == "qwen3" ||
                     c.model_type == "mistral" || c.model_type == "gemma2" || c.model_type == "phi3";
  TORCH_CHECK(known, where, ": model_type is '", c.model_type,
              "', expected 'llama', 'qwen2', 'qwen3', 'mistral', 'gemma2' or 'phi3' for the Llama family");
  const bool gemma2 = c.model_type == "gemma2";
  const bool qwen = c.model_type == "qwen2" || c.model_type == "qwen3";
  c.vocab_size = required_int(ckpt, "vocab_size");
  c.hidden_size = required_int(ckpt, "hidden_size");
  c.intermediate_size = required_int(ckpt, "intermediate_size");
  c.num_hidden_layers = required_int(ckpt, "num_hidden_layers");
  c.num_attention_heads = required_int(ckpt, "num_attention_heads");
  c.num_key_value_heads = optional_int(ckpt, "num_key_value_heads", c.num_attention_heads);
  c.head_dim = optional_int(ckpt, "head_dim", gemma2 ? 256 : c.head_dim);  // Gemma2Config's default
  c.max_position_embeddings = optional_int(ckpt, "max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = ckpt.config_number("rms_norm_eps").value_or(1e-6);
  c.tie_word_embeddings = ckpt.config_bool("tie_word_embeddings").value_or(gemma2);
  c.attention_bias = ckpt.config_bool("attention_bias").value_or(false);
  c.qkv_bias = c.model_type == "qwen2";  // Qwen2Attention: q, k and v with biases, o without
  c.qk_norm = c.model_type == "qwen3";   // [Qwen3]: Qwen3Attention's q_norm and k_norm (biases: attention_bias)
  c.mlp_bias = !gemma2 && ckpt.config_bool("mlp_bias").value_or(false);  // Gemma2MLP has none
  c.fused_projections = c.model_type == "phi3";  // [Phi-3]: qkv_proj and gate_up_proj, no biases
  // [Sliding window], as transformers' configs read it: Mistral's every layer when sliding_window
  // is set; Qwen2's and Qwen3's layers from max_window_layers on when use_sliding_window; Gemma 2's even
  // layers (a window of 4096 unless given); or, any of them, the layer_types that transformers 5
  // writes.
  if (gemma2) c.sliding_window = 4096;
  if (c.model_type != "llama" && ckpt.config_has("sliding_window")) {
    c.sliding_window = required_int(ckpt, "sliding_window");
    TORCH_CHECK(c.sliding_window > 0, where, ": field 'sliding_window' is ", c.sliding_window,
                ", expected a positive number of tokens or null");
  }
  if (qwen && !ckpt.config_bool("use_sliding_window").value_or(false)) c.sliding_window = 0;
  if (c.sliding_window > 0) {
    if (ckpt.config_has("layer_types")) {
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        const auto field = "layer_types." + std::to_string(i);
        auto type = ckpt.config_string(field);
        TORCH_CHECK(type == "full_attention" || type == "sliding_attention", where, ": field '", field, "' is '",
                    type.value_or("(missing)"), "', expected 'full_attention' or 'sliding_attention'");
        c.layer_types.push_back(*type);
      }
    } else {
      const int64_t first_sliding = qwen ? optional_int(ckpt, "max_window_layers", 28) : 0;
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        const bool sliding = gemma2 ? i % 2 == 0 : i >= first_sliding;
        c.layer_types.push_back(sliding ? "sliding_attention" : "full_attention");
      }
    }
  }
  if (gemma2) {
    // [Gemma 2]: Gemma2MLP reads hidden_activation (older configs also carry hidden_act, unused).
    c.hidden_act = ckpt.config_string("hidden_activation").value_or("gelu_pytorch_tanh");
    TORCH_CHECK(c.hidden_act == "gelu_pytorch_tanh", where, ": hidden_activation '", c.hidden_act,
                "' is not supported (expected 'gelu_pytorch_tanh')");
    c.sandwich_norms = true;
    c.scale_embeddings = true;
    c.query_pre_attn_scalar = ckpt.config_number("query_pre_attn_scalar").value_or(256.0);
    TORCH_CHECK(c.query_pre_attn_scalar > 0, where, ": field 'query_pre_attn_scalar' is ", c.query_pre_attn_scalar,
                ", expected a positive number");
    c.attn_logit_softcapping = detail::number_or_off(ckpt, "attn_logit_softcapping", 50.0);
    c.final_logit_softcapping = detail::number_or_off(ckpt, "final_logit_softcapping", 30.0);
    TORCH_CHECK(!ckpt.config_bool("use_bidirectional_attention").value_or(false), where,
                ": use_bidirectional_attention=true is not supported (the client's models are causal)");
  } else if (auto act = ckpt.config_string("hidden_act")) {
    TORCH_CHECK(*act == "silu", where, ": hidden_act '", *act, "' is not supported (expected 'silu')");
  }
  // transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; transformers 4 writes
  // rope_theta next to an optional rope_scaling {rope_type (or "type"), factor, ...}.
  const std::string rope = ckpt.config_has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  c.rope_theta = ckpt.config_number(rope + ".rope_theta").value_or(ckpt.config_number("rope_theta").value_or(10000.0));
  c.partial_rotary_factor = ckpt.config_number(rope + ".partial_rotary_factor")
                                .value_or(ckpt.config_number("partial_rotary_factor").value_or(1.0));
  if (ckpt.config_has(rope)) {
    c.rope_type =
        ckpt.config_string(rope + ".rope_type").value_or(ckpt.config_string(rope + ".type").value_or("default"));
    // Phi3Config reads Phi-3's older names, "su" and "yarn", as "longrope".
    if (c.model_type == "phi3" && (c.rope_type == "su" || c.rope_type == "yarn")) c.rope_type = "longrope";
    TORCH_CHECK(c.rope_type != "longrope" || c.model_type == "phi3", where, ": rope type 'longrope' is supported ",
                "for Phi-3 (model_type 'phi3') only, not '", c.model_type, "'");
    if (c.rope_type == "longrope") {  // [LongRoPE], as _compute_longrope_parameters reads it
      // Phi3Config's own original_max_position_embeddings (4096 unless given) wins over rope_scaling's.
      c.rope_original_max_position_embeddings = optional_int(ckpt, "original_max_position_embeddings", 4096);
      TORCH_CHECK(c.rope_original_max_position_embeddings > 0, where, ": field 'original_max_position_embeddings' is ",
                  c.rope_original_max_position_embeddings, ", expected a positive number of positions");
      const int64_t frequencies = static_cast<int64_t>(c.resolved_head_dim() * c.partial_rotary_factor) / 2;
      c.rope_short_factor = detail::number_list(ckpt, rope + ".short_factor", frequencies);
      c.rope_long_factor = detail::number_list(ckpt, rope + ".long_factor", frequencies);
      const double original = static_cast<double>(c.rope_original_max_position_embeddings);
      const double factor = ckpt.config_number(rope + ".factor").value_or(c.max_position_embeddings / original);
      c.rope_attention_factor =
          ckpt.config_number(rope + ".attention_factor")
              .value_or(factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(original)));
    }
    if (c.rope_type == "llama3") {
      auto field = [&](const std::string& name) {
        auto v = ckpt.config_number(rope + "." + name);
        TORCH_CHECK(v.has_value(), where, ": rope type llama3 needs field '", rope, ".", name, "'");
        return *v;
      };
      c.rope_factor = field("factor");
      c.rope_low_freq_factor = field("low_freq_factor");
      c.rope_high_freq_factor = field("high_freq_factor");
      c.rope_original_max_position_embeddings = static_cast<int64_t>(
          ckpt.config_number(rope + ".original_max_position_embeddings").value_or(c.max_position_embeddings));
    }
  }
  c.validate();
  return c;
}

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab_size > 0 && hidden_size > 0 && intermediate_size > 0 && num_hidden_layers >= 0,
              "Llama config: vocab_size, hidden_size, intermediate_size must be positive");
  TORCH_CHECK(num_attention_heads > 0 && num_key_value_heads > 0 && num_attention_heads % num_key_value_heads == 0,
              "Llama config: num_attention_heads (", num_attention_heads,
              ") must be a positive multiple of num_key_value_heads (", num_key_value_heads, ")");
  TORCH_CHECK(head_dim > 0 || hidden_size % num_attention_heads == 0, "Llama config: hidden_size (", hidden_size,
              ") is not divisible by num_attention_heads (", num_attention_heads, ") and no head_dim is given");
  TORCH_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1, "Llama config: partial_rotary_factor is ",
              partial_rotary_factor, ", expected more than 0 and at most 1");
  TORCH_CHECK(rotary_dim() % 2 == 0, "Llama config: RoPE's dimension ", rotary_dim(), " (head_dim ",
              resolved_head_dim(), " x partial_rotary_factor ", partial_rotary_factor, ") must be even");
  TORCH_CHECK(rope_type == "default" || rope_type == "llama3" || rope_type == "longrope", "Llama config: rope type '",
              rope_type, "' is not supported (expected 'default', 'llama3' or 'longrope')");
  if (rope_type == "longrope") {  // [LongRoPE]
    const auto frequencies = static_cast<size_t>(rotary_dim() / 2);
    TORCH_CHECK(rope_short_factor.size() == frequencies && rope_long_factor.size() == frequencies,
                "Llama config: longrope needs ", frequencies, " short and long factors (rotary_dim / 2), got ",
                rope_short_factor.size(), " and ", rope_long_factor.size());
    TORCH_CHECK(rope_original_max_position_embeddings > 0,
                "Llama config: longrope's original_max_position_embeddings is ", rope_original_max_position_embeddings,
                ", expected a positive number of positions");
  }
  TORCH_CHECK(rope_type != "llama3" || rope_high_freq_factor != rope_low_freq_factor,
              "Llama config: llama3 rope needs high_freq_factor != low_freq_factor");
  TORCH_CHECK(sliding_window >= 0, "Llama config: sliding_window is ", sliding_window, ", expected 0 (none) or more");
  TORCH_CHECK(layer_types.empty() || static_cast<int64_t>(layer_types.size()) == num_hidden_layers,
              "Llama config: layer_types has ", layer_types.size(), " entries, expected one per layer (",
              num_hidden_layers, ")");
  for (const auto& type : layer_types) {
    TORCH_CHECK(type == "full_attention" || (type == "sliding_attention" && sliding_window > 0),
                "Llama config: layer type '", type, "' is not supported (expected 'full_attention', or ",
                "'sliding_attention' with a sliding_window)");
  }
  TORCH_CHECK(hidden_act == "silu" || hidden_act == "gelu_pytorch_tanh", "Llama config: activation '", hidden_act,
              "' is not supported (expected 'silu' or 'gelu_pytorch_tanh')");
  TORCH_CHECK(query_pre_attn_scalar >= 0 && attn_logit_softcapping >= 0 && final_logit_softcapping >= 0,
              "Llama config: query_pre_attn_scalar (", query_pre_attn_scalar, "), attn_logit_softcapping (",
              attn_logit_softcapping, ") and final_logit_softcapping (", final_logit_softcapping,
              ") must be 0 (unset) or positive");
}

int64_t LlamaConfig::window_of(int64_t layer) const {
  return !layer_types.empty() && layer_types.at(layer) == "sliding_attention" ? sliding_window : 0;
}

AttentionScores LlamaConfig::attention_scores() const {
  return {query_pre_attn_scalar > 0 ? 1.0 / std::sqrt(query_pre_attn_scalar) : 0.0, attn_logit_softcapping};
}

namespace detail {

at::Tensor rotary_inv_freq(int64_t dim, double theta) {
  // Same operations, in fp32, as transformers' _compute_default_rope_parameters.
  auto exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  return at::pow(theta, exponent).reciprocal();
}

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                 at::ScalarType dtype, double scale) {
  auto freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq;
  auto emb = at::cat({freqs, freqs}, -1);
  if (scale == 1.0) return {emb.cos().to(dtype), emb.sin().to(dtype)};
  return {(emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)};
}

at::Tensor llama_inv_freq(const LlamaConfig& config, bool long_factors) {
  if (config.rope_type == "longrope") {
    // [LongRoPE]: _compute_longrope_parameters, 1 / (factor · theta^(2i/d)) in fp32.
    const int64_t dim = config.rotary_dim();
    const auto& factors = long_factors ? config.rope_long_factor : config.rope_short_factor;
    const auto ext = at::tensor(factors, at::kDouble).to(at::kFloat);
    const auto exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
    return (ext * at::pow(config.rope_theta, exponent)).reciprocal();
  }
  auto inv_freq = rotary_inv_freq(config.rotary_dim(), config.rope_theta);
  if (config.rope_type != "llama3") return inv_freq;
  // _compute_llama3_parameters.
  const double factor = config.rope_factor;
  const double low = config.rope_low_freq_factor;
  const double high = config.rope_high_freq_factor;
  const double old_context_len = static_cast<double>(config.rope_original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / low;
  const double high_freq_wavelen = old_context_len / high;
  auto wavelen = inv_freq.reciprocal() * (2 * M_PI);
  auto scaled = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  auto smooth = (wavelen.reciprocal() * old_context_len - low) / (high - low);
  auto smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  auto medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return at::where(medium, smoothed, scaled);
}

}  // namespace detail

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t hidden_size, double eps, bool unit_offset)
    : eps_(eps), unit_offset_(unit_offset) {
  weight = register_parameter("weight", unit_offset ? at::zeros({hidden_size}) : at::ones({hidden_size}));
}

// LibTorch's rms_norm (one fused kernel on a GPU, fp32 statistics for reduced-precision inputs):
// transformers' LlamaRMSNorm, but for where bf16/fp16 results round once instead of twice. With a
// unit offset, Gemma2RMSNorm: x and 1 + weight in fp32, the product cast back once.
at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  if (!unit_offset_) return at::rms_norm(x, {x.size(-1)}, weight, eps_);
  return at::rms_norm(x.to(at::kFloat), {x.size(-1)}, weight.to(at::kFloat) + 1.0, eps_).to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c, bool materialize_base)
    : num_heads_(c.num_attention_heads),
      num_kv_heads_(c.num_key_value_heads),
      head_dim_(c.resolved_head_dim()),
      scores_(c.attention_scores()) {
  const int64_t q_out = num_heads_ * head_dim_;
  const int64_t kv_out = num_kv_heads_ * head_dim_;
  const bool qkv_bias = c.attention_bias || c.qkv_bias;  // base weights: served with the layer
  if (c.fused_projections) {                             // [Phi-3]
    qkv_proj = register_module("qkv_proj", nn::Linear(c.hidden_size, q_out + 2 * kv_out, qkv_bias, materialize_base));
  } else {
    q_proj = register_module("q_proj", nn::Linear(c.hidden_size, q_out, qkv_bias, materialize_base));
    k_proj = register_module("k_proj", nn::Linear(c.hidden_size, kv_out, qkv_bias, materialize_base));
    v_proj = register_module("v_proj", nn::Linear(c.hidden_size, kv_out, qkv_bias, materialize_base));
  }
  o_proj = register_module("o_proj", nn::Linear(q_out, c.hidden_size, c.attention_bias, materialize_base));
  if (c.qk_norm) {  // [Qwen3]
    q_norm = register_module("q_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps));
    k_norm = register_module("k_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps));
  }
}

std::vector<nn::BaseLayerImpl*> LlamaAttentionImpl::qkv_layers() {
  if (qkv_proj) return {qkv_proj.get()};
  return {q_proj.get(), k_proj.get(), v_proj.get()};
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                       const at::Tensor& additive_mask, const PastKeyValue* past,
                                       const CachedLayer* cache, const at::Tensor& qkv_base) {
  const int64_t batch = x.size(0), length = x.size(1);
  // [Layer groups]: q, k and v read x, and are one product where they can be; [Phi-3]: one layer.
  const int64_t q_out = num_heads_ * head_dim_, kv_out = num_kv_heads_ * head_dim_;
  auto qkv = nn::forward_siblings(qkv_layers(), x, nullptr, qkv_base);
  if (qkv_proj) qkv = qkv[0].split({q_out, kv_out, kv_out}, -1);
  auto q = qkv[0].view({batch, length, num_heads_, head_dim_});
  auto k = qkv[1].view({batch, length, num_kv_heads_, head_dim_});
  if (q_norm) {  // [Qwen3]: over each head's features, before the rotary embedding (and the cache)
    q = q_norm->forward(q);
    k = k_norm->forward(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  // Where qkv are column slices of the group's one result, attention would keep that result whole
  // for its backward through v (q and k are rotated into tensors of their own): while training, v
  // becomes its own copy, so only its columns stay (Llama-2-13B: 20 MiB a layer at 1 024 tokens).
  auto v_rows = qkv[2];
  if (at::GradMode::is_enabled() && !v_rows.is_contiguous()) v_rows = v_rows.contiguous();
  auto v = v_rows.view({batch, length, num_kv_heads_, head_dim_}).transpose(1, 2);
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  q = detail::apply_rotary(q, c, s);
  k = detail::apply_rotary(k, c, s);
  if (past != nullptr) {  // a cache's keys are stored rotated already: prefix keys are used as they are
    k = at::cat({past->key, k}, 2);
    v = at::cat({past->value, v}, 2);
  }
  // Grouped-query attention: each key/value head serves num_heads / num_kv_heads query heads.
  auto heads = cache ? cache->attend(q, k, v, scores_) : detail::attention(q, k, v, additive_mask, scores_);
  auto out = heads.transpose(1, 2).reshape({batch, length, num_heads_ * head_dim_});
  return o_proj->forward(out);
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, bool materialize_base) : activation_(c.hidden_act) {
  if (c.fused_projections) {  // [Phi-3]
    gate_up_proj = register_module("gate_up_proj",
                                   nn::Linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias, materialize_base));
  } else {
    gate_proj =
        register_module("gate_proj", nn::Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, materialize_base));
    up_proj = register_module("up_proj", nn::Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, materialize_base));
  }
  down_proj =
      register_module("down_proj", nn::Linear(c.intermediate_size, c.hidden_size, c.mlp_bias, materialize_base));
}

std::vector<nn::BaseLayerImpl*> LlamaMLPImpl::gate_up_layers() {
  if (gate_up_proj) return {gate_up_proj.get()};
  return {gate_proj.get(), up_proj.get()};
}

at::Tensor LlamaMLPImpl::forward_bridge(const at::Tensor& h, LlamaAttentionImpl& next) {
  return nn::forward_mlp_bridge(gate_up_layers(), down_proj.get(), activation_, next.qkv_layers(), h);
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  if (auto whole = nn::forward_mlp_block(gate_up_layers(), down_proj.get(), activation_, x); whole.defined()) {
    return whole;  // [MLP blocks]: one call
  }
  at::Tensor stacked;  // [Layer groups]: gate and up side by side, when nothing changed them apart
  std::vector<at::Tensor> gate_up;
  if (gate_up_proj) {  // [Phi-3]: one layer gives them side by side
    stacked = gate_up_proj->forward(x);
    const auto [gate, up] = halves(stacked);
    gate_up = {gate, up};
  } else {
    gate_up = nn::forward_siblings({gate_proj.get(), up_proj.get()}, x, &stacked);
  }
  const auto &gate = gate_up[0], &up = gate_up[1];
  if (activation_ != "silu") return down_proj->forward(gated_activation(activation_, gate, up));  // GeGLU ([Gemma 2])
  const bool differentiable = at::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad());
  if (!differentiable) return down_proj->forward(swiglu(gate, up));
  return down_proj->forward(stacked.defined() ? StackedSwiGLU::apply(stacked) : SwiGLU::apply(gate, up));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, bool materialize_base) {
  self_attn = register_module("self_attn", LlamaAttention(c, materialize_base));
  mlp = register_module("mlp", LlamaMLP(c, materialize_base));
  auto norm = [&] { return LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, /*unit_offset=*/c.sandwich_norms); };
  input_layernorm = register_module("input_layernorm", norm());
  post_attention_layernorm = register_module("post_attention_layernorm", norm());
  if (c.sandwich_norms) {
    pre_feedforward_layernorm = register_module("pre_feedforward_layernorm", norm());
    post_feedforward_layernorm = register_module("post_feedforward_layernorm", norm());
  }
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                          const at::Tensor& additive_mask, const PastKeyValue* past,
                                          const CachedLayer* cache, Bridged* bridged, LlamaDecoderLayerImpl* next) {
  Bridged in;
  if (bridged != nullptr) std::swap(in, *bridged);
  auto attended = self_attn->forward(in.normed.defined() ? in.normed : input_layernorm->forward(x), cos, sin,
                                     additive_mask, past, cache, in.qkv);
  if (pre_feedforward_layernorm) {  // [Gemma 2]
    auto h = x + post_attention_layernorm->forward(attended);
    return h + post_feedforward_layernorm->forward(mlp->forward(pre_feedforward_layernorm->forward(h)));
  }
  auto h = x + attended;
  // [MLP bridges]: the executor's norms are the checkpoint's, so only while both of these are.
  if (bridged != nullptr && next != nullptr && !post_attention_layernorm->weight.requires_grad() &&
      !next->input_layernorm->weight.requires_grad()) {
    if (auto out = mlp->forward_bridge(h, *next->self_attn); out.defined()) {
      const int64_t hidden = h.size(-1);
      *bridged = {out.narrow(-1, hidden, hidden), out.narrow(-1, 2 * hidden, out.size(-1) - 2 * hidden)};
      return out.narrow(-1, 0, hidden);
    }
  }
  return h + mlp->forward(post_attention_layernorm->forward(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, bool materialize_base) : config_(c) {
  config_.validate();
  embed_tokens = register_module("embed_tokens", nn::unfilled_embedding(c.vocab_size, c.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(LlamaDecoderLayer(c, materialize_base));
  norm = register_module("norm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, /*unit_offset=*/c.sandwich_norms));
  inv_freq_ = detail::llama_inv_freq(c);
  if (c.rope_type == "longrope") long_inv_freq_ = detail::llama_inv_freq(c, /*long_factors=*/true);
}

at::Tensor LlamaModelImpl::embed(const at::Tensor& ids) {
  auto embeddings = embed_tokens->forward(ids);
  if (!config_.scale_embeddings) return embeddings;
  // [Gemma 2]: sqrt(hidden_size) in fp32, then in the model's dtype, as Gemma2TextScaledWordEmbedding.
  const auto scale = at::scalar_tensor(std::sqrt(static_cast<double>(config_.hidden_size)), at::kFloat);
  return embeddings * scale.to(embeddings.scalar_type());
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                   const at::Tensor& position_ids, ModelAdapterImpl* adapter) {
  TORCH_CHECK(input_ids.dim() == 2, "input_ids has shape ", input_ids.sizes(), ", expected [batch, tokens]");
  const int64_t length = input_ids.size(1);
  auto in = detail::adapt_inputs(adapter, embed(input_ids), attention_mask, position_ids, config_.num_hidden_layers,
                                 config_.sliding_window);
  auto h = in.embeddings;
  at::Tensor long_factors;  // [LongRoPE]: the call's largest position decides, as in transformers (on the device)
  if (long_inv_freq_.defined())
    long_factors = in.position_ids.max() + 1 > config_.rope_original_max_position_embeddings;
  const auto [cos, sin] = rotary_angles(in.position_ids, h.scalar_type(), long_factors);
  Bridged bridged;
  for (size_t i = 0; i < layers->size(); ++i) {
    const PastKeyValue* past = in.past.empty() ? nullptr : &in.past[i];
    const auto& mask = config_.window_of(static_cast<int64_t>(i)) > 0 ? in.sliding_mask : in.additive_mask;
    h = layer(i)->forward(h, cos, sin, mask, past, nullptr, &bridged, layer(i + 1));
  }
  h = norm->forward(h);
  return in.prompt_length > 0 ? h.narrow(1, in.prompt_length, length) : h;
}

at::Tensor LlamaModelImpl::forward_cached(const at::Tensor& embeddings, const CachedStep& step) {
  if (long_inv_freq_.defined() && step.cache_tokens() > config_.rope_original_max_position_embeddings) {
    if (auto recomputed = recompute_crossing(embeddings, step)) return *recomputed;
  }
  const auto long_factors = long_inv_freq_.defined() ? long_factors_of(step).unsqueeze(0) : at::Tensor();
  const auto [cos, sin] = rotary_angles(step.positions().unsqueeze(0), embeddings.scalar_type(), long_factors);
  auto h = embeddings;
  Bridged bridged;
  for (size_t i = 0; i < layers->size(); ++i) {
    const CachedLayer cache{&step, static_cast<int64_t>(i), config_.window_of(static_cast<int64_t>(i))};
    h = layer(i)->forward(h, cos, sin, {}, nullptr, &cache, &bridged, layer(i + 1));
  }
  return norm->forward(h);
}

std::pair<at::Tensor, at::Tensor> LlamaModelImpl::rotary_angles(const at::Tensor& positions, at::ScalarType dtype,
                                                                const at::Tensor& long_factors) {
  // RoPE angles in fp32, then cos/sin in the model's dtype (transformers' LlamaRotaryEmbedding).
  if (inv_freq_.device() != positions.device()) inv_freq_ = inv_freq_.to(positions.device());
  if (!long_factors.defined()) return detail::rotary_cos_sin(positions, inv_freq_, dtype);
  // [LongRoPE]: the long or the short frequencies, chosen on the device as transformers' torch.where does.
  if (long_inv_freq_.device() != positions.device()) long_inv_freq_ = long_inv_freq_.to(positions.device());
  const auto inv_freq = at::where(long_factors.unsqueeze(-1), long_inv_freq_, inv_freq_);
  return detail::rotary_cos_sin(positions, inv_freq, dtype, config_.rope_attention_factor);
}

namespace {
// Whether the calling thread's CUDA stream is capturing a graph ([Captured decode]).
bool capturing_on(const at::Tensor& t) {
#ifdef SYMBIOSIS_WITH_CUDA
  return t.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)t;
  return false;
#endif
}
}  // namespace

at::Tensor LlamaModelImpl::long_factors_of(const CachedStep& step) const {
  const int64_t original = config_.rope_original_max_position_embeddings;
  if (step.fixed()) {
    // A fixed decode step: one token a sequence, its position on the device only. Captured, it is
    // replayed without this model's code, so it may be only where no sequence can cross original.
    TORCH_CHECK(!capturing_on(step.positions()) || step.cache_tokens() <= original,
                "Phi-3 longrope: a captured decode step cannot recompute a sequence that crosses ",
                "original_max_position_embeddings (", original, ") in a cache of ", step.cache_tokens(),
                " positions ([LongRoPE] in models/llama.h); decode it eagerly");
    return step.positions() + 1 > original;
  }
  // Each sequence's tokens take the set its length after the step picks.
  std::vector<int64_t> lengths;  // a token's sequence's length after the step
  lengths.reserve(step.tokens());
  for (const auto& s : step.sequences()) lengths.insert(lengths.end(), s.length, s.start + s.length);
  return at::tensor(lengths, at::kLong).to(step.positions().device()) > original;
}

std::optional<at::Tensor> LlamaModelImpl::recompute_crossing(const at::Tensor& embeddings, const CachedStep& step) {
  const int64_t original = config_.rope_original_max_position_embeddings;
  if (capturing_on(step.positions())) return std::nullopt;  // refused by long_factors_of
  auto& cache = step.cache();
  // The step's sequences and the rows of `embeddings` they take; a fixed decode step's from the
  // device (its padding rows, in spare slots, left out).
  std::vector<StepSequence> sequences = step.sequences();
  std::vector<int64_t> first_rows;
  if (step.fixed()) {
    const auto slots = step.fixed_slots().cpu(), starts = step.positions().cpu();
    for (int64_t i = 0; i < slots.size(0); ++i) {
      const int64_t slot = slots[i].item<int64_t>();
      if (slot >= cache.sequences()) continue;
      sequences.push_back({slot, starts[i].item<int64_t>(), 1});
      first_rows.push_back(i);
    }
  } else {
    int64_t row = 0;
    for (const auto& s : sequences) {
      first_rows.push_back(row);
      row += s.length;
    }
  }
  auto& recorded = cache.recorded_inputs(original, embeddings.size(-1), embeddings.scalar_type());
  const auto rows = embeddings[0];
  std::vector<bool> crossing(sequences.size(), false);
  for (size_t i = 0; i < sequences.size(); ++i) {
    const auto& s = sequences[i];
    auto& from = cache.recorded_from(s.slot);
    if (from < 0) from = s.start;  // the slot's first step: its own tokens begin here
    const int64_t below = std::min(s.start + s.length, original) - s.start;
    if (below > 0) recorded[s.slot].narrow(0, s.start, below).copy_(rows.narrow(0, first_rows[i], below));
    crossing[i] = s.length == 1 && s.start == original && from < original;
  }
  if (std::find(crossing.begin(), crossing.end(), true) == crossing.end()) return std::nullopt;
  // The step again as packed pieces: a crossing sequence from its first own position, the others as they were.
  std::vector<StepSequence> pieces;
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> picked;  // for each of the step's rows (in its order), its row among the pieces'
  int64_t packed = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    auto s = sequences[i];
    auto input = rows.narrow(0, first_rows[i], s.length);
    if (crossing[i]) {
      const int64_t from = cache.recorded_from(s.slot);
      input = at::cat({recorded[s.slot].narrow(0, from, original - from).to(input.device()), input});
      s = {s.slot, from, original + 1 - from};
    }
    for (int64_t j = 0; j < sequences[i].length; ++j) picked.push_back(packed + s.length - sequences[i].length + j);
    packed += s.length;
    pieces.push_back(s);
    inputs.push_back(input);
  }
  const auto hidden = forward_cached(at::cat(inputs).unsqueeze(0), CachedStep(cache, pieces, embeddings.device()))
                          .index_select(1, at::tensor(picked, at::kLong).to(embeddings.device()));
  if (!step.fixed()) return hidden;
  // A fixed step's rows: each sequence's where it was, padding rows zero (their logits are dropped).
  auto all = at::zeros({1, embeddings.size(1), hidden.size(2)}, hidden.options());
  return all.index_copy_(1, at::tensor(first_rows, at::kLong).to(hidden.device()), hidden);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c, bool materialize_base) : config_(c) {
  model = register_module("model", LlamaModel(c, materialize_base));
  if (!c.tie_word_embeddings) {
    lm_head = register_module("lm_head", nn::Linear(c.hidden_size, c.vocab_size, /*bias=*/false, materialize_base));
  }
}

void LlamaForCausalLMImpl::untie_head() {
  if (!lm_head) lm_head = register_module("lm_head", nn::untied_head(model->embed_tokens->weight));
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                         const at::Tensor& position_ids) {
  return logits(model->forward(input_ids, attention_mask, position_ids, adapter_.get()));
}

// In the model's dtype, as transformers returns them: the loss reads them in fp32 without a copy
// ([Fused cross-entropy] in kernels/cross_entropy.h), which at 1 024 tokens of Llama 3's vocabulary
// would be 0.5 GB written forward and again backward.
at::Tensor LlamaForCausalLMImpl::logits(const at::Tensor& hidden) {
  // Tied to the embeddings: [CPU decode product] where it applies (client_runtime/cpu_product.h), as an lm_head's.
  auto logits = lm_head ? lm_head->forward(hidden) : nn::detail::linear_no_bias(hidden, model->embed_tokens->weight);
  return detail::soft_cap(logits, config_.final_logit_softcapping);  // [Logit soft-capping]: Gemma 2
}

void LlamaForCausalLMImpl::set_model_adapter(std::shared_ptr<ModelAdapterImpl> adapter) {
  TORCH_CHECK(!adapter_, "the model already has a model-level adapter");
  adapter_ = register_module("adapter", std::move(adapter));
}

ModelShape LlamaForCausalLMImpl::model_shape() const {
  return {config_.model_type,          config_.num_hidden_layers,   config_.hidden_size,
          config_.num_attention_heads, config_.num_key_value_heads, config_.resolved_head_dim()};
}

}  // namespace symbiosis
