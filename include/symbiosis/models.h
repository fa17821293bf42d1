#pragma once
// Symbiosis client runtime, the models: what a tenant's model is built from, and the models
// it offers ready-made.
//  - symbiosis::nn::Linear and nn::Conv1D: base layers, computed locally or, once virtualized,
//    on the executor; LayerAdapterImpl is where a PEFT method wraps one.
//  - LlamaForCausalLM (also Qwen2, Qwen3, Mistral, Gemma 2 and Phi-3: [Llama family]), GPT2LMHeadModel
//    (also GPTBigCode / StarCoder: [GPT-2 family]) and GPTNeoXForCausalLM (also Phi and OPT: [GPT-NeoX
//    family]) with Hugging Face parameter names (their module paths
//    are the checkpoint's, and so the executor's, layer names, or those without the base model's
//    prefix: [Checkpoint layouts] in model_io.h), computing what transformers computes.
//  - load_weights, load_llama (the Llama family), load_gpt2 (the GPT-2 family), load_gpt_neox (the
//    GPT-NeoX family): a model's weights
//    from a Hugging Face checkpoint (symbiosis::Checkpoint), by parameter name.
//  - open_causal_lm: the checkpoint's model, split (base layers on the executor) or monolithic.
#include "client_runtime/models/causal_lm.h"
#include "client_runtime/models/gpt2.h"
#include "client_runtime/models/gpt_neox.h"
#include "client_runtime/models/llama.h"
#include "client_runtime/models/model_io.h"
#include "client_runtime/nn.h"
#include "common/checkpoint.h"
