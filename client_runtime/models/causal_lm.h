#pragma once
// A causal language model of a checkpoint's family (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Phi-3,
// GPT-2, GPTBigCode, GPT-NeoX, Phi or OPT, from config.json's model_type: common/model_types.h;
// another is refused naming it and the supported ones),
// built either split (base layers virtualized on an executor, never allocated here) or monolithic (base layers
// computed in-process: the reference and the baseline).
#include <torch/nn/module.h>

#include <functional>
#include <memory>

#include "client_runtime/client.h"
#include "common/checkpoint.h"

namespace symbiosis {

struct CausalLM {
  std::shared_ptr<torch::nn::Module> module;
  // input_ids [B,T] int64, attention_mask [B,T] or undefined -> logits [B,T,vocab]
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> forward;
  size_t virtual_layers = 0;       // base layers computed on the executor
  std::shared_ptr<Client> client;  // the executor's connection; null when monolithic
  // Waits for every base-layer call made so far and throws the first executor error among them
  // (Client::settle); call it before an optimizer step. Nothing to wait for when monolithic.
  void settle() const {
    if (client) client->settle();
  }
};

// Where the client's part of the model lives and in which dtype (its norms and softmax still
// compute in fp32, as transformers does). Base layers on the executor compute in the executor's
// dtype; inputs are cast to it and results back.
struct CausalLMOptions {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
};

// client == nullptr: monolithic. Otherwise the executor must serve this very model (the
// client's model hash is checked against the checkpoint's). Every parameter of the model is frozen
// (the base, as PEFT freezes it); adapters attached afterwards bring the trainable parameters.
CausalLM open_causal_lm(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client = nullptr,
                        const CausalLMOptions& options = {});

}  // namespace symbiosis
