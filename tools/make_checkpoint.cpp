// symbiosis-make-checkpoint: writes a Hugging Face checkpoint (config.json plus model.safetensors,
// or shards and model.safetensors.index.json) with random weights in the shapes of a preset model,
// exactly as transformers' save_pretrained lays them out. For tests and benchmarks: no download is
// needed, and the weights are deterministic in (seed, tensor name), whatever the dtype or sharding,
// so a bf16 or sharded checkpoint holds the same values as the fp32 single-file one.
//
// Tensors are generated and written one at a time, so the 13B shapes need only one tensor's memory.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/checkpoint.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

enum class Init {
  kMatrix,      // normal(0, 0.02): projections and embeddings
  kNorm,        // 1 + 0.1 * normal: norm scales
  kOffsetNorm,  // 0.1 * normal: norm scales stored as their offset from 1 (Gemma's 1 + weight)
  kBias,        // 0.02 * normal
  kProjection,  // normal(0, in^-1/2): keeps its input's scale (OPT's embedding projections)
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
};

struct ModelSpec {
  json config;  // without torch_dtype
  std::vector<TensorSpec> tensors;
};

struct LlamaShape {
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, max_positions;
  double rms_eps, rope_theta;
  json rope_scaling;  // null or {rope_type: llama3, ...}
  bool tied;
  int64_t bos, eos;
};

// head_dim 0: hidden / heads.
ModelSpec llama_spec(const LlamaShape& s, int64_t head_dim = 0) {
  if (head_dim == 0) head_dim = s.hidden / s.heads;
  ModelSpec m;
  m.config = {{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"bos_token_id", s.bos},
              {"eos_token_id", s.eos},
              {"head_dim", head_dim},
              {"hidden_act", "silu"},
              {"hidden_size", s.hidden},
              {"initializer_range", 0.02},
              {"intermediate_size", s.intermediate},
              {"max_position_embeddings", s.max_positions},
              {"mlp_bias", false},
              {"num_attention_heads", s.heads},
              {"num_hidden_layers", s.layers},
              {"num_key_value_heads", s.kv_heads},
              {"pretraining_tp", 1},
              {"rms_norm_eps", s.rms_eps},
              {"rope_scaling", s.rope_scaling},
              {"rope_theta", s.rope_theta},
              {"tie_word_embeddings", s.tied},
              {"transformers_version", "4.45.0"},
              {"use_cache", true},
              {"vocab_size", s.vocab}};
  auto& t = m.tensors;
  t.push_back({"model.embed_tokens.weight", {s.vocab, s.hidden}, Init::kMatrix});
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t.push_back({p + "input_layernorm.weight", {s.hidden}, Init::kNorm});
    t.push_back({p + "self_attn.q_proj.weight", {s.heads * head_dim, s.hidden}, Init::kMatrix});
    t.push_back({p + "self_attn.k_proj.weight", {s.kv_heads * head_dim, s.hidden}, Init::kMatrix});
    t.push_back({p + "self_attn.v_proj.weight", {s.kv_heads * head_dim, s.hidden}, Init::kMatrix});
    t.push_back({p + "self_attn.o_proj.weight", {s.hidden, s.heads * head_dim}, Init::kMatrix});
    t.push_back({p + "post_attention_layernorm.weight", {s.hidden}, Init::kNorm});
    t.push_back({p + "mlp.gate_proj.weight", {s.intermediate, s.hidden}, Init::kMatrix});
    t.push_back({p + "mlp.up_proj.weight", {s.intermediate, s.hidden}, Init::kMatrix});
    t.push_back({p + "mlp.down_proj.weight", {s.hidden, s.intermediate}, Init::kMatrix});
  }
  t.push_back({"model.norm.weight", {s.hidden}, Init::kNorm});
  if (!s.tied) t.push_back({"lm_head.weight", {s.vocab, s.hidden}, Init::kMatrix});
  return m;
}

// Qwen2 (Qwen2ForCausalLM): Llama's tensors plus biases of q, k and v. Its config.json as
// Qwen/Qwen2-0.5B writes it; sliding_window > 0 turns on sliding-window attention in the layers
// from max_window_layers on (use_sliding_window), as transformers reads those fields.
ModelSpec qwen2_spec(const LlamaShape& s, int64_t sliding_window, int64_t max_window_layers) {
  ModelSpec m = llama_spec(s);
  m.config = {{"architectures", {"Qwen2ForCausalLM"}},
              {"model_type", "qwen2"},
              {"attention_dropout", 0.0},
              {"bos_token_id", s.bos},
              {"eos_token_id", s.eos},
              {"hidden_act", "silu"},
              {"hidden_size", s.hidden},
              {"initializer_range", 0.02},
              {"intermediate_size", s.intermediate},
              {"max_position_embeddings", s.max_positions},
              {"max_window_layers", max_window_layers},
              {"num_attention_heads", s.heads},
              {"num_hidden_layers", s.layers},
              {"num_key_value_heads", s.kv_heads},
              {"rms_norm_eps", s.rms_eps},
              {"rope_scaling", nullptr},
              {"rope_theta", s.rope_theta},
              {"sliding_window", sliding_window > 0 ? json(sliding_window) : json(nullptr)},
              {"tie_word_embeddings", s.tied},
              {"transformers_version", "4.45.0"},
              {"use_cache", true},
              {"use_sliding_window", sliding_window > 0},
              {"vocab_size", s.vocab}};
  // Each of q, k and v gets its bias, [out features].
  std::vector<TensorSpec> tensors;
  for (const auto& t : m.tensors) {
    tensors.push_back(t);
    const bool qkv = t.name.find(".self_attn.") != std::string::npos && t.name.find(".o_proj.") == std::string::npos;
    if (qkv)
      tensors.push_back(
          {t.name.substr(0, t.name.size() - std::string("weight").size()) + "bias", {t.shape[0]}, Init::kBias});
  }
  m.tensors = std::move(tensors);
  return m;
}

// Qwen3 (Qwen3ForCausalLM): Llama's tensors with a head_dim of its own, plus each attention's q_norm
// and k_norm ([head_dim]); no biases (attention_bias false). Its config.json as Qwen/Qwen3-0.6B
// writes it; sliding_window as Qwen2's.
ModelSpec qwen3_spec(const LlamaShape& s, int64_t head_dim, int64_t sliding_window, int64_t max_window_layers) {
  ModelSpec m = llama_spec(s, head_dim);
  m.config = qwen2_spec(s, sliding_window, max_window_layers).config;
  m.config["architectures"] = {"Qwen3ForCausalLM"};
  m.config["model_type"] = "qwen3";
  m.config["attention_bias"] = false;
  m.config["head_dim"] = head_dim;
  m.config["transformers_version"] = "4.51.0";
  std::vector<TensorSpec> tensors;
  for (const auto& t : m.tensors) {
    tensors.push_back(t);
    const auto at = t.name.find(".self_attn.k_proj.weight");
    if (at == std::string::npos) continue;
    const std::string attention = t.name.substr(0, at) + ".self_attn.";
    tensors.push_back({attention + "q_norm.weight", {head_dim}, Init::kNorm});
    tensors.push_back({attention + "k_norm.weight", {head_dim}, Init::kNorm});
  }
  m.tensors = std::move(tensors);
  return m;
}

// Mistral (MistralForCausalLM): Llama's tensors, attention over at most sliding_window tokens.
// Its config.json as mistralai/Mistral-7B-v0.1 writes it.
ModelSpec mistral_spec(const LlamaShape& s, int64_t sliding_window) {
  ModelSpec m = llama_spec(s);
  m.config = {{"architectures", {"MistralForCausalLM"}},
              {"model_type", "mistral"},
              {"attention_dropout", 0.0},
              {"bos_token_id", s.bos},
              {"eos_token_id", s.eos},
              {"head_dim", s.hidden / s.heads},
              {"hidden_act", "silu"},
              {"hidden_size", s.hidden},
              {"initializer_range", 0.02},
              {"intermediate_size", s.intermediate},
              {"max_position_embeddings", s.max_positions},
              {"num_attention_heads", s.heads},
              {"num_hidden_layers", s.layers},
              {"num_key_value_heads", s.kv_heads},
              {"rms_norm_eps", s.rms_eps},
              {"rope_theta", s.rope_theta},
              {"sliding_window", sliding_window},
              {"tie_word_embeddings", s.tied},
              {"transformers_version", "4.45.0"},
              {"use_cache", true},
              {"vocab_size", s.vocab}};
  return m;
}

// Phi-3 (Phi3ForCausalLM): Llama's tensors with each attention's q, k and v fused into qkv_proj
// (rows q, then k, then v) and each MLP's gate and up into gate_up_proj (gate, then up). Its
// config.json as microsoft/Phi-3-mini-4k-instruct writes it (a window over every layer), with
// Phi-4-mini's partial_rotary_factor.
ModelSpec phi3_spec(const LlamaShape& s, int64_t sliding_window, double partial_rotary_factor) {
  ModelSpec m = llama_spec(s);
  m.config = mistral_spec(s, sliding_window).config;
  m.config.erase("head_dim");
  m.config["architectures"] = {"Phi3ForCausalLM"};
  m.config["model_type"] = "phi3";
  m.config.update({{"attention_bias", false},
                   {"embd_pdrop", 0.0},
                   {"original_max_position_embeddings", s.max_positions},
                   {"pad_token_id", 0},
                   {"partial_rotary_factor", partial_rotary_factor},
                   {"resid_pdrop", 0.0},
                   {"rope_scaling", nullptr}});
  std::vector<TensorSpec> tensors;
  for (auto t : m.tensors) {
    const auto fuse = [&](const std::string& first, const std::string& fused, int64_t rows) {
      const auto at = t.name.find(first);
      if (at != std::string::npos) t = {t.name.substr(0, at) + fused + ".weight", {rows, s.hidden}, Init::kMatrix};
      return at != std::string::npos;
    };
    const int64_t head_dim = s.hidden / s.heads;
    if (t.name.find(".k_proj.") != std::string::npos || t.name.find(".v_proj.") != std::string::npos ||
        t.name.find(".up_proj.") != std::string::npos) {
      continue;  // in the fused layer
    }
    if (!fuse("q_proj.weight", "qkv_proj", (s.heads + 2 * s.kv_heads) * head_dim)) {
      fuse("gate_proj.weight", "gate_up_proj", 2 * s.intermediate);
    }
    tensors.push_back(t);
  }
  m.tensors = std::move(tensors);
  return m;
}

// A LayerNorm's weight and bias.
void layer_norm(std::vector<TensorSpec>& t, const std::string& name, int64_t size) {
  t.push_back({name + ".weight", {size}, Init::kNorm});
  t.push_back({name + ".bias", {size}, Init::kBias});
}

// A Linear layer's weight [out, in] and bias [out].
void linear(std::vector<TensorSpec>& t, const std::string& name, int64_t in, int64_t out) {
  t.push_back({name + ".weight", {out, in}, Init::kMatrix});
  t.push_back({name + ".bias", {out}, Init::kBias});
}

struct LayerNormShape {
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, max_positions;
};

// OPT (OPTForCausalLM): learned positions (offset by 2), pre-layer norms, q, k, v and out_proj with
// biases, a ReLU MLP of fc1 and fc2 in the layer itself, the head tied. Its config.json as
// facebook/opt-125m writes it. word_embed_proj_dim other than hidden: as facebook/opt-350m's, token
// embeddings of that width, project_in and project_out (no biases) around the decoder, the norms
// after attention and MLP (do_layer_norm_before false) and no final norm.
ModelSpec opt_spec(const LayerNormShape& s, int64_t word_embed_proj_dim = 0) {
  const int64_t embed = word_embed_proj_dim > 0 ? word_embed_proj_dim : s.hidden;
  const bool projected = embed != s.hidden;
  ModelSpec m;
  m.config = {{"architectures", {"OPTForCausalLM"}},
              {"model_type", "opt"},
              {"_remove_final_layer_norm", false},
              {"activation_dropout", 0.0},
              {"activation_function", "relu"},
              {"attention_dropout", 0.0},
              {"bos_token_id", 2},
              {"do_layer_norm_before", !projected},
              {"dropout", 0.1},
              {"enable_bias", true},
              {"eos_token_id", 2},
              {"ffn_dim", s.intermediate},
              {"hidden_size", s.hidden},
              {"init_std", 0.02},
              {"layer_norm_elementwise_affine", true},
              {"layerdrop", 0.0},
              {"max_position_embeddings", s.max_positions},
              {"num_attention_heads", s.heads},
              {"num_hidden_layers", s.layers},
              {"pad_token_id", 1},
              {"prefix", "</s>"},
              {"tie_word_embeddings", true},
              {"transformers_version", "4.45.0"},
              {"use_cache", true},
              {"vocab_size", s.vocab},
              {"word_embed_proj_dim", embed}};
  auto& t = m.tensors;
  t.push_back({"model.decoder.embed_tokens.weight", {s.vocab, embed}, Init::kMatrix});
  t.push_back({"model.decoder.embed_positions.weight", {s.max_positions + 2, s.hidden}, Init::kMatrix});
  if (projected) {
    t.push_back({"model.decoder.project_out.weight", {embed, s.hidden}, Init::kProjection});
    t.push_back({"model.decoder.project_in.weight", {s.hidden, embed}, Init::kProjection});
  }
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.decoder.layers." + std::to_string(i) + ".";
    for (const char* proj : {"k_proj", "v_proj", "q_proj", "out_proj"})
      linear(t, p + "self_attn." + proj, s.hidden, s.hidden);
    layer_norm(t, p + "self_attn_layer_norm", s.hidden);
    linear(t, p + "fc1", s.hidden, s.intermediate);
    linear(t, p + "fc2", s.intermediate, s.hidden);
    layer_norm(t, p + "final_layer_norm", s.hidden);
  }
  if (!projected) layer_norm(t, "model.decoder.final_layer_norm", s.hidden);
  return m;
}

// The config.json fields GPT-NeoX and Phi name alike: sizes and the layer norms' epsilon.
json layer_norm_decoder_config(const LayerNormShape& s) {
  return {{"hidden_size", s.hidden},
          {"initializer_range", 0.02},
          {"intermediate_size", s.intermediate},
          {"layer_norm_eps", 1e-5},
          {"max_position_embeddings", s.max_positions},
          {"num_attention_heads", s.heads},
          {"num_hidden_layers", s.layers},
          {"vocab_size", s.vocab}};
}

// GPT-NeoX (GPTNeoXForCausalLM, Pythia): RoPE over rotary_pct of each head, q, k and v in one
// query_key_value layer (each head's q, k and v side by side), attention and MLP in parallel from
// two layer norms (use_parallel_residual), exact GELU, an untied embed_out. Its config.json as
// EleutherAI/pythia-70m writes it.
ModelSpec gpt_neox_spec(const LayerNormShape& s, double rotary_pct, bool parallel_residual) {
  ModelSpec m;
  m.config = {{"architectures", {"GPTNeoXForCausalLM"}},
              {"model_type", "gpt_neox"},
              {"attention_bias", true},
              {"attention_dropout", 0.0},
              {"bos_token_id", 0},
              {"classifier_dropout", 0.1},
              {"eos_token_id", 0},
              {"hidden_act", "gelu"},
              {"hidden_dropout", 0.0},
              {"rope_scaling", nullptr},
              {"rotary_emb_base", 10000},
              {"rotary_pct", rotary_pct},
              {"tie_word_embeddings", false},
              {"transformers_version", "4.45.0"},
              {"use_cache", true},
              {"use_parallel_residual", parallel_residual}};
  m.config.update(layer_norm_decoder_config(s));
  auto& t = m.tensors;
  t.push_back({"gpt_neox.embed_in.weight", {s.vocab, s.hidden}, Init::kMatrix});
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "gpt_neox.layers." + std::to_string(i) + ".";
    layer_norm(t, p + "input_layernorm", s.hidden);
    layer_norm(t, p + "post_attention_layernorm", s.hidden);
    linear(t, p + "attention.query_key_value", s.hidden, 3 * s.hidden);
    linear(t, p + "attention.dense", s.hidden, s.hidden);
    linear(t, p + "mlp.dense_h_to_4h", s.hidden, s.intermediate);
    linear(t, p + "mlp.dense_4h_to_h", s.intermediate, s.hidden);
  }
  layer_norm(t, "gpt_neox.final_layer_norm", s.hidden);
  t.push_back({"embed_out.weight", {s.vocab, s.hidden}, Init::kMatrix});
  return m;
}

// Phi (PhiForCausalLM, phi-1 and phi-2): RoPE over partial_rotary_factor of each head, q, k, v and
// dense with biases, attention and a gelu_new MLP (fc1, fc2) in parallel from one layer norm, an
// untied lm_head with a bias. Its config.json as microsoft/phi-2 writes it.
ModelSpec phi_spec(const LayerNormShape& s, double partial_rotary_factor) {
  ModelSpec m;
  m.config = {{"architectures", {"PhiForCausalLM"}},
              {"model_type", "phi"},
              {"attention_dropout", 0.0},
              {"bos_token_id", 1},
              {"embd_pdrop", 0.0},
              {"eos_token_id", 2},
              {"hidden_act", "gelu_new"},
              {"num_key_value_heads", s.kv_heads},
              {"partial_rotary_factor", partial_rotary_factor},
              {"qk_layernorm", false},
              {"resid_pdrop", 0.1},
              {"rope_scaling", nullptr},
              {"rope_theta", 10000.0},
              {"tie_word_embeddings", false},
              {"transformers_version", "4.45.0"},
              {"use_cache", true}};
  const int64_t head_dim = s.hidden / s.heads;
  m.config.update(layer_norm_decoder_config(s));
  auto& t = m.tensors;
  t.push_back({"model.embed_tokens.weight", {s.vocab, s.hidden}, Init::kMatrix});
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    layer_norm(t, p + "input_layernorm", s.hidden);
    linear(t, p + "self_attn.q_proj", s.hidden, s.heads * head_dim);
    linear(t, p + "self_attn.k_proj", s.hidden, s.kv_heads * head_dim);
    linear(t, p + "self_attn.v_proj", s.hidden, s.kv_heads * head_dim);
    linear(t, p + "self_attn.dense", s.heads * head_dim, s.hidden);
    linear(t, p + "mlp.fc1", s.hidden, s.intermediate);
    linear(t, p + "mlp.fc2", s.intermediate, s.hidden);
  }
  layer_norm(t, "model.final_layernorm", s.hidden);
  linear(t, "lm_head", s.hidden, s.vocab);
  return m;
}

struct Gemma2Settings {
  int64_t head_dim, sliding_window;
  int64_t query_pre_attn_scalar;  // an integer: transformers' Gemma2Config refuses another number
  double attn_logit_softcapping, final_logit_softcapping;
};

// Gemma 2 (Gemma2ForCausalLM): Llama's tensors plus a norm on each side of the MLP, norms stored as
// offsets from 1, the head tied. Its config.json as transformers 5 writes google/gemma-2-2b's:
// sliding windows in the even layers (layer_types), soft caps on attention scores and logits.
ModelSpec gemma2_spec(const LlamaShape& s, const Gemma2Settings& g) {
  ModelSpec m = llama_spec(s, g.head_dim);
  json layer_types = json::array();
  for (int64_t i = 0; i < s.layers; ++i) layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  m.config = {{"architectures", {"Gemma2ForCausalLM"}},
              {"model_type", "gemma2"},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"attn_logit_softcapping", g.attn_logit_softcapping},
              {"bos_token_id", s.bos},
              {"eos_token_id", s.eos},
              {"final_logit_softcapping", g.final_logit_softcapping},
              {"head_dim", g.head_dim},
              {"hidden_activation", "gelu_pytorch_tanh"},
              {"hidden_size", s.hidden},
              {"initializer_range", 0.02},
              {"intermediate_size", s.intermediate},
              {"layer_types", layer_types},
              {"max_position_embeddings", s.max_positions},
              {"num_attention_heads", s.heads},
              {"num_hidden_layers", s.layers},
              {"num_key_value_heads", s.kv_heads},
              {"pad_token_id", 0},
              {"query_pre_attn_scalar", g.query_pre_attn_scalar},
              {"rms_norm_eps", s.rms_eps},
              {"rope_parameters", {{"rope_theta", s.rope_theta}, {"rope_type", "default"}}},
              {"sliding_window", g.sliding_window},
              {"tie_word_embeddings", true},
              {"transformers_version", "5.24.0"},
              {"use_cache", true},
              {"vocab_size", s.vocab}};
  std::vector<TensorSpec> tensors;
  for (auto t : m.tensors) {
    if (t.init == Init::kNorm) t.init = Init::kOffsetNorm;
    tensors.push_back(t);
    const std::string post_attention = "post_attention_layernorm.weight";
    if (t.name.ends_with(post_attention)) {
      const auto layer = t.name.substr(0, t.name.size() - post_attention.size());
      tensors.push_back({layer + "pre_feedforward_layernorm.weight", t.shape, Init::kOffsetNorm});
      tensors.push_back({layer + "post_feedforward_layernorm.weight", t.shape, Init::kOffsetNorm});
    }
  }
  m.tensors = std::move(tensors);
  return m;
}

// Phi-3's longrope scaling as microsoft/Phi-3-mini-128k-instruct writes it (transformers 4's
// rope_scaling with "type"), with `frequencies` short and long factors of its shape: short ones
// near 1, long ones growing with the wavelength.
json longrope(int64_t frequencies) {
  json short_factor = json::array(), long_factor = json::array();
  for (int64_t i = 0; i < frequencies; ++i) {
    short_factor.push_back(1.0 + 0.05 * static_cast<double>(i));
    long_factor.push_back(std::pow(1.5, static_cast<double>(i)));
  }
  return {{"type", "longrope"}, {"short_factor", short_factor}, {"long_factor", long_factor}};
}

json llama3_rope(double factor, double low, double high, int64_t original) {
  return {{"rope_type", "llama3"},
          {"factor", factor},
          {"low_freq_factor", low},
          {"high_freq_factor", high},
          {"original_max_position_embeddings", original}};
}

struct GPT2Shape {
  int64_t vocab, positions, embd, layers, heads;
  int64_t bos_eos;
};

// hub_layout: tensors named as the Hub's GPT-2 checkpoints name them, without "transformer."
// (h.0.attn.c_attn.weight, wte.weight; [Checkpoint layouts] in client_runtime/models/model_io.h).
ModelSpec gpt2_spec(const GPT2Shape& s, bool hub_layout = false) {
  ModelSpec m;
  m.config = {{"architectures", {"GPT2LMHeadModel"}},
              {"model_type", "gpt2"},
              {"activation_function", "gelu_new"},
              {"attn_pdrop", 0.1},
              {"bos_token_id", s.bos_eos},
              {"eos_token_id", s.bos_eos},
              {"embd_pdrop", 0.1},
              {"initializer_range", 0.02},
              {"layer_norm_epsilon", 1e-5},
              {"n_ctx", s.positions},
              {"n_embd", s.embd},
              {"n_head", s.heads},
              {"n_inner", nullptr},
              {"n_layer", s.layers},
              {"n_positions", s.positions},
              {"reorder_and_upcast_attn", false},
              {"resid_pdrop", 0.1},
              {"scale_attn_by_inverse_layer_idx", false},
              {"scale_attn_weights", true},
              {"summary_activation", nullptr},
              {"summary_first_dropout", 0.1},
              {"summary_proj_to_labels", true},
              {"summary_type", "cls_index"},
              {"summary_use_proj", true},
              {"tie_word_embeddings", true},
              {"transformers_version", "4.45.0"},
              {"use_cache", true},
              {"vocab_size", s.vocab}};
  const int64_t e = s.embd, inner = 4 * s.embd;
  auto& t = m.tensors;
  t.push_back({"transformer.wte.weight", {s.vocab, e}, Init::kMatrix});
  t.push_back({"transformer.wpe.weight", {s.positions, e}, Init::kMatrix});
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    t.push_back({p + "ln_1.weight", {e}, Init::kNorm});
    t.push_back({p + "ln_1.bias", {e}, Init::kBias});
    t.push_back({p + "attn.c_attn.weight", {e, 3 * e}, Init::kMatrix});  // Conv1D: [in, out]
    t.push_back({p + "attn.c_attn.bias", {3 * e}, Init::kBias});
    t.push_back({p + "attn.c_proj.weight", {e, e}, Init::kMatrix});
    t.push_back({p + "attn.c_proj.bias", {e}, Init::kBias});
    t.push_back({p + "ln_2.weight", {e}, Init::kNorm});
    t.push_back({p + "ln_2.bias", {e}, Init::kBias});
    t.push_back({p + "mlp.c_fc.weight", {e, inner}, Init::kMatrix});
    t.push_back({p + "mlp.c_fc.bias", {inner}, Init::kBias});
    t.push_back({p + "mlp.c_proj.weight", {inner, e}, Init::kMatrix});
    t.push_back({p + "mlp.c_proj.bias", {e}, Init::kBias});
  }
  t.push_back({"transformer.ln_f.weight", {e}, Init::kNorm});
  t.push_back({"transformer.ln_f.bias", {e}, Init::kBias});
  if (hub_layout) {
    for (auto& tensor : t) tensor.name = tensor.name.substr(std::string("transformer.").size());
  }
  return m;
}

// GPTBigCode (GPTBigCodeForCausalLM, StarCoder): GPT-2's tensors as Linear layers ([out, in]), c_attn
// giving the queries then one key and one value head with multi_query (else every head's). Its
// config.json as transformers 5 writes bigcode/starcoderbase's.
ModelSpec gpt_bigcode_spec(const GPT2Shape& s, bool multi_query) {
  ModelSpec m = gpt2_spec(s);
  m.config = {{"architectures", {"GPTBigCodeForCausalLM"}},
              {"model_type", "gpt_bigcode"},
              {"activation_function", "gelu_pytorch_tanh"},
              {"attention_softmax_in_fp32", true},
              {"attn_pdrop", 0.1},
              {"bos_token_id", s.bos_eos},
              {"embd_pdrop", 0.1},
              {"eos_token_id", s.bos_eos},
              {"initializer_range", 0.02},
              {"layer_norm_epsilon", 1e-5},
              {"multi_query", multi_query},
              {"n_embd", s.embd},
              {"n_head", s.heads},
              {"n_inner", nullptr},
              {"n_layer", s.layers},
              {"n_positions", s.positions},
              {"resid_pdrop", 0.1},
              {"scale_attention_softmax_in_fp32", true},
              {"scale_attn_weights", true},
              {"tie_word_embeddings", true},
              {"transformers_version", "5.24.0"},
              {"use_cache", true},
              {"vocab_size", s.vocab}};
  const int64_t kv = multi_query ? s.embd / s.heads : s.embd;
  for (auto& t : m.tensors) {
    if (t.name.find(".attn.c_attn.") != std::string::npos) t.shape.back() = s.embd + 2 * kv;
    if (t.name.find(".h.") != std::string::npos && t.shape.size() == 2) std::swap(t.shape[0], t.shape[1]);
  }
  return m;
}

const std::vector<std::string> kPresets = {"tiny-llama",
                                           "tiny-llama-tied",
                                           "tiny-gpt2",
                                           "tiny-gpt2-hub",
                                           "tiny-qwen2",
                                           "tiny-qwen3",
                                           "tiny-mistral",
                                           "tiny-gemma2",
                                           "tiny-gpt-bigcode",
                                           "tiny-phi3",
                                           "tiny-phi3-longrope",
                                           "tiny-opt",
                                           "tiny-opt-projected",
                                           "tiny-gpt-neox",
                                           "tiny-gpt-neox-sequential",
                                           "tiny-phi",
                                           "tiny-gpt-bigcode-mha",
                                           "llama-3.2-1b",
                                           "llama-2-7b",
                                           "llama-2-13b",
                                           "gemma-2-27b",
                                           "gpt2-xl"};

// Presets' configs follow the Hub's config.json of each model (meta-llama/Llama-3.2-1B,
// meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-13b-hf, google/gemma-2-27b, openai-community/gpt2-xl). layers >= 0
// overrides the number of layers.
ModelSpec preset_spec(const std::string& name, int64_t layers) {
  auto n = [&](int64_t preset_layers) { return layers >= 0 ? layers : preset_layers; };
  if (name == "tiny-llama") {
    // llama3 RoPE scaling with a small original context, so all three frequency bands occur.
    return llama_spec({256, 64, 128, n(2), 4, 2, 256, 1e-5, 10000.0, llama3_rope(8.0, 1.0, 4.0, 32), false, 1, 2});
  }
  if (name == "tiny-llama-tied") {
    return llama_spec({256, 64, 128, n(2), 4, 2, 256, 1e-6, 10000.0, nullptr, true, 1, 2});
  }
  if (name == "tiny-gpt2") return gpt2_spec({256, 128, 64, n(2), 4, 255});
  if (name == "tiny-gpt2-hub") return gpt2_spec({256, 128, 64, n(2), 4, 255}, /*hub_layout=*/true);
  // StarCoder's multi-query attention (one key/value head), and GPTBigCode without it.
  if (name == "tiny-gpt-bigcode") return gpt_bigcode_spec({256, 128, 64, n(2), 4, 255}, /*multi_query=*/true);
  if (name == "tiny-gpt-bigcode-mha") return gpt_bigcode_spec({256, 128, 64, n(2), 4, 255}, /*multi_query=*/false);
  // Tied like Qwen2-0.5B; layer 0 attends fully, the layers after it over a window of 5 tokens.
  if (name == "tiny-qwen2") {
    return qwen2_spec({256, 64, 128, n(2), 4, 2, 256, 1e-6, 1000000.0, nullptr, true, 1, 2}, 5, 1);
  }
  // Qwen3's head_dim (32) is not hidden / heads (16), as Qwen3-0.6B's 128 is not 1024 / 16; untied,
  // and, as tiny-qwen2, layer 0 attends fully and the layers after it over a window of 5 tokens.
  if (name == "tiny-qwen3") {
    return qwen3_spec({256, 64, 128, n(2), 4, 2, 256, 1e-6, 1000000.0, nullptr, false, 1, 2}, 32, 5, 1);
  }
  // Phi-3 with grouped-query attention (Phi-3-medium's), Phi-4-mini's partial rotary (12 of 16
  // features) and a window of 5 tokens in every layer.
  if (name == "tiny-phi3") {
    return phi3_spec({256, 64, 128, n(2), 4, 2, 256, 1e-5, 10000.0, nullptr, false, 1, 2}, 5, 0.75);
  }
  // Phi-3-mini-128k's longrope ([LongRoPE] in client_runtime/models/llama.h) over tiny-phi3's
  // shapes, its original context 8 positions (of 256: attention factor sqrt(1 + ln 32 / ln 8)), so
  // that the tests' sequences lie on both sides of it.
  if (name == "tiny-phi3-longrope") {
    auto m = phi3_spec({256, 64, 128, n(2), 4, 2, 256, 1e-5, 10000.0, nullptr, false, 1, 2}, 5, 0.75);
    m.config["original_max_position_embeddings"] = 8;
    m.config["rope_scaling"] = longrope(6);  // 12 of 16 features turn: 6 frequencies
    return m;
  }
  if (name == "tiny-opt") return opt_spec({256, 64, 128, n(2), 4, 4, 128});
  // OPT-350m's shapes in small: token embeddings of 32 projected in to the decoder's 64 and out
  // again (project_in, project_out), norms after attention and after the MLP, no final norm.
  if (name == "tiny-opt-projected") return opt_spec({256, 64, 128, n(2), 4, 4, 128}, /*word_embed_proj_dim=*/32);
  // Pythia's rotary_pct (a quarter: 4 of 16 features); also with attention and MLP in sequence.
  if (name == "tiny-gpt-neox") return gpt_neox_spec({256, 64, 256, n(2), 4, 4, 256}, 0.25, true);
  if (name == "tiny-gpt-neox-sequential") return gpt_neox_spec({256, 64, 256, n(2), 4, 4, 256}, 0.25, false);
  // phi-2's partial rotary (half: 8 of 16 features), with grouped-query attention (2 key/value heads).
  if (name == "tiny-phi") return phi_spec({256, 64, 128, n(2), 4, 2, 256}, 0.5);
  // A window of 4 tokens: the tests' sequences are longer, so the window matters.
  if (name == "tiny-mistral") {
    return mistral_spec({256, 64, 128, n(2), 4, 2, 256, 1e-5, 10000.0, nullptr, false, 1, 2}, 4);
  }
  // Gemma 2's shapes in small: head_dim apart from hidden / heads (24, not 16), query_pre_attn_scalar
  // apart from head_dim (4: scores scaled by 1/2), a window of 4 in layer 0, and soft caps low enough
  // (0.1 on the scores, 0.5 on the logits) that each changes what the random weights compute.
  if (name == "tiny-gemma2") {
    return gemma2_spec({256, 64, 128, n(2), 4, 2, 256, 1e-6, 10000.0, nullptr, true, 2, 1}, {24, 4, 4, 0.1, 0.5});
  }
  if (name == "llama-3.2-1b") {
    return llama_spec({128256, 2048, 8192, n(16), 32, 8, 131072, 1e-5, 500000.0, llama3_rope(32.0, 1.0, 4.0, 8192),
                       true, 128000, 128001});
  }
  if (name == "llama-2-7b")
    return llama_spec({32000, 4096, 11008, n(32), 32, 32, 4096, 1e-5, 10000.0, nullptr, false, 1, 2});
  if (name == "llama-2-13b")
    return llama_spec({32000, 5120, 13824, n(40), 40, 40, 4096, 1e-5, 10000.0, nullptr, false, 1, 2});
  // Sliding windows of 4096 in every other layer, soft caps 50 (scores) and 30 (logits), scores
  // scaled by 1/sqrt(144) (hidden / heads), not 1/sqrt(head_dim).
  if (name == "gemma-2-27b") {
    return gemma2_spec({256000, 4608, 36864, n(46), 32, 16, 8192, 1e-6, 10000.0, nullptr, true, 2, 1},
                       {128, 4096, 144, 50.0, 30.0});
  }
  if (name == "gpt2-xl") return gpt2_spec({50257, 1024, 1600, n(48), 25, 50256});
  std::string known;
  for (const auto& p : kPresets) known += (known.empty() ? "" : ", ") + p;
  TORCH_CHECK(false, "unknown preset '", name, "' (known: ", known, ")");
}

uint64_t tensor_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

at::Tensor generate(const TensorSpec& spec, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(tensor_seed(seed, spec.name));
  auto t = at::empty(spec.shape, at::kFloat);
  switch (spec.init) {
    case Init::kMatrix: t.normal_(0.0, 0.02, gen); break;
    case Init::kNorm: t.normal_(0.0, 0.1, gen).add_(1.0); break;
    case Init::kOffsetNorm: t.normal_(0.0, 0.1, gen); break;
    case Init::kBias: t.normal_(0.0, 0.02, gen); break;
    case Init::kProjection: t.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(spec.shape.back())), gen); break;
  }
  return t.to(dtype);
}

void write_json(const fs::path& path, const json& j) {
  std::ofstream out(path);
  TORCH_CHECK(out.good(), "cannot write ", path);
  out << j.dump(2) << "\n";
  TORCH_CHECK(out.good(), "failed writing ", path);
}

void make_checkpoint(const std::string& preset, const fs::path& out, at::ScalarType dtype, uint64_t seed,
                     uint64_t shard_size, int64_t layers) {
  ModelSpec spec = preset_spec(preset, layers);
  spec.config["torch_dtype"] = dtype == at::kFloat ? "float32" : dtype == at::kBFloat16 ? "bfloat16" : "float16";
  fs::create_directories(out);
  // Stale weights from an earlier run would mix with these (an old index wins over a new file).
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string f = entry.path().filename().string();
    if (f == "model.safetensors" || f == "model.safetensors.index.json" ||
        (f.rfind("model-", 0) == 0 && f.size() > 12 && f.substr(f.size() - 12) == ".safetensors")) {
      fs::remove(entry.path());
    }
  }
  write_json(out / "config.json", spec.config);

  // Shards: consecutive tensors, each shard at most shard_size bytes unless one tensor is larger.
  std::vector<std::vector<symbiosis::SafetensorsWriter::Entry>> shards(1);
  std::vector<std::vector<const TensorSpec*>> shard_specs(1);
  uint64_t current = 0, total = 0;
  for (const auto& t : spec.tensors) {
    symbiosis::SafetensorsWriter::Entry e{t.name, dtype, t.shape};
    const uint64_t bytes = symbiosis::SafetensorsWriter::data_bytes(e);
    if (shard_size > 0 && !shards.back().empty() && current + bytes > shard_size) {
      shards.emplace_back();
      shard_specs.emplace_back();
      current = 0;
    }
    shards.back().push_back(e);
    shard_specs.back().push_back(&t);
    current += bytes;
    total += bytes;
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    std::string file = "model.safetensors";
    if (shard_size > 0) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      file = buf;
    }
    symbiosis::SafetensorsWriter writer(out / file, shards[s], metadata);
    for (const TensorSpec* t : shard_specs[s]) {
      writer.write(t->name, generate(*t, seed, dtype));
      weight_map[t->name] = file;
    }
    writer.finish();
  }
  if (shard_size > 0) {
    write_json(out / "model.safetensors.index.json",
               {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
  }
  std::cout << "wrote " << preset << " (" << spec.tensors.size() << " tensors, " << total << " bytes, " << shards.size()
            << (shards.size() == 1 ? " file" : " shards") << ") to " << out.string() << "\n";
  // Hashed now, once: the digests are cached beside the checkpoint ([Weight hash] in common/weight_hash.cpp).
  std::cout << "model hash " << symbiosis::Checkpoint::open(out)->model_hash() << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Writes a Hugging Face checkpoint with random weights in a preset model's shapes."};
  std::string preset, out, dtype_name = "fp32";
  uint64_t seed = 0, shard_size = 0;
  int64_t layers = -1;
  std::string preset_names;
  for (const auto& p : kPresets) preset_names += (preset_names.empty() ? "" : ", ") + p;
  app.add_option("--preset", preset, preset_names)->required();
  app.add_option("--out", out, "output directory (created if needed)")->required();
  app.add_option("--dtype", dtype_name, "fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--seed", seed, "random seed")->capture_default_str();
  app.add_option("--shard-size", shard_size, "bytes per shard; 0 writes one model.safetensors")->capture_default_str();
  app.add_option("--layers", layers, "number of layers instead of the preset's")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    make_checkpoint(preset, out, symbiosis::parse_dtype_name(dtype_name), seed, shard_size, layers);
  } catch (const c10::Error& e) {
    std::cerr << "symbiosis-make-checkpoint: error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-make-checkpoint: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
