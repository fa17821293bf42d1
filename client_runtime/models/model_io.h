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
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <filesystem>

#include "client_runtime/models/gpt2.h"
#include "client_runtime/models/llama.h"

namespace symbiosis {

class Checkpoint;

void load_weights(torch::nn::Module& model, const Checkpoint& ckpt);

// Opens the checkpoint, builds the model from its config.json in `dtype` on `device`, loads it.
// materialize_base=false: base layers stay without weights (virtualize the model next); the
// checkpoint must still hold them, since the tensor table is checked whole.
LlamaForCausalLM load_llama(const std::filesystem::path& dir, bool materialize_base = true,
                            at::ScalarType dtype = at::kFloat, at::Device device = at::kCPU);
GPT2LMHeadModel load_gpt2(const std::filesystem::path& dir, bool materialize_base = true,
                          at::ScalarType dtype = at::kFloat, at::Device device = at::kCPU);

}  // namespace symbiosis
