#pragma once
// Loading a model's weights from a Hugging Face checkpoint by parameter name. Works for any
// torch::nn::Module tree whose parameter names are the checkpoint's (the models in llama.h and
// gpt2.h, or a tenant's own).
//
// Contract of load_weights:
//  - every parameter of the tree is filled from the checkpoint tensor of the same name, checked
//    against the parameter's shape, cast to its dtype and device, copied (the checkpoint's mmap is
//    never aliased or written);
//  - base layers (nn::BaseLayerImpl) get their weight/bias through set_weights(), in the dtype and
//    device of the model; virtual base layers are skipped (their weights live on the executor);
//  - adapter parameters (anything under a child module named "adapter") are left alone;
//  - a tensor the model needs but the checkpoint lacks, and a tensor in the checkpoint the model does
//    not use, are errors naming the tensor. Not counted as unused: "lm_head.weight" when the model
//    ties its head to the embeddings and the checkpoint's copy equals them (a different head is an
//    error), GPT-2's "attn.bias"/"attn.masked_bias" mask buffers and RoPE "rotary_emb.inv_freq"
//    buffers, which older save_pretrained versions wrote.
//  - buffers are not loaded. Nothing is changed when a check fails.
//  - the checkpoint may name the tensors of the model's base model without its prefix
//    ([Checkpoint layouts] below).
//
// [Checkpoint layouts]
// A checkpoint names a model's tensors either by the model's own parameter paths
// (transformer.h.0.attn.c_attn.weight, what save_pretrained of GPT2LMHeadModel writes) or, when it
// was saved from the base model alone, without the top-level module that holds it
// (h.0.attn.c_attn.weight, wte.weight: the Hub's GPT-2 checkpoints, saved from GPT2Model). Hugging
// Face transformers loads both into GPT2LMHeadModel (its base_model_prefix); so do we. The layout
// is the checkpoint's, found once (checkpoint_names); it decides the names the checkpoint's tensors
// are read by and the names the executor serves the base layers by, since the executor knows
// layers by their checkpoint names (h.0.attn.c_attn): virtualize() is given the same map.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <filesystem>
#include <string>

#include "client_runtime/models/gpt2.h"
#include "client_runtime/models/gpt_neox.h"
#include "client_runtime/models/llama.h"

namespace symbiosis {

class Checkpoint;

// [Checkpoint layouts]: how one checkpoint names the tensors of one model.
struct CheckpointNames {
  // The model's top-level module that the checkpoint's names leave out ("transformer" for the
  // Hub's GPT-2), or "" when the checkpoint names tensors by the model's paths.
  std::string dropped_prefix;
  // The checkpoint's name of a module or parameter path of the model (also the executor's name of
  // a base layer at that path).
  std::string of(const std::string& path) const;
};

// The layout of `ckpt` for `model`: a top-level module (other than an "adapter") is dropped when
// the checkpoint names none of its tensors with its prefix but some without it.
CheckpointNames checkpoint_names(torch::nn::Module& model, const Checkpoint& ckpt);

void load_weights(torch::nn::Module& model, const Checkpoint& ckpt);

// Opens the checkpoint, builds the model from its config.json in `dtype` on `device`, loads it.
// materialize_base=false: base layers stay without weights (virtualize the model next); the
// checkpoint must still hold them, since the tensor table is checked whole. load_llama loads the
// [Llama family] (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Phi-3), load_gpt2 the [GPT-2 family] (GPT-2,
// GPTBigCode), load_gpt_neox the [GPT-NeoX family] (GPT-NeoX, Phi, OPT).
LlamaForCausalLM load_llama(const std::filesystem::path& dir, bool materialize_base = true,
                            at::ScalarType dtype = at::kFloat, at::Device device = at::kCPU);
GPT2LMHeadModel load_gpt2(const std::filesystem::path& dir, bool materialize_base = true,
                          at::ScalarType dtype = at::kFloat, at::Device device = at::kCPU);
GPTNeoXForCausalLM load_gpt_neox(const std::filesystem::path& dir, bool materialize_base = true,
                                 at::ScalarType dtype = at::kFloat, at::Device device = at::kCPU);

}  // namespace symbiosis
