#include "client_runtime/models/causal_lm.h"

#include "client_runtime/models/gpt2.h"
#include "client_runtime/models/gpt_neox.h"
#include "client_runtime/models/llama.h"
#include "client_runtime/models/model_io.h"
#include "client_runtime/virtualize.h"
#include "common/model_types.h"

namespace symbiosis {
namespace {

template <typename Model>
CausalLM finish(Model model, const Checkpoint& checkpoint, const std::shared_ptr<Client>& client,
                const CausalLMOptions& options) {
  CausalLM lm;
  model->to(options.device, options.dtype);
  if (client) {
    // The executor serves the base layers by the checkpoint's names ([Checkpoint layouts]).
    const auto names = checkpoint_names(*model, checkpoint);
    // [Served tied head] (base_executor/base_model.cpp): a head tied to the embeddings calls the
    // executor's lm_head where it serves one.
    if (client->find_layer(names.of("lm_head")) != nullptr) model->untie_head();
    lm.virtual_layers =
        virtualize(*model, client, {.layer_name = [names](const std::string& path) { return names.of(path); }});
  }
  lm.client = client;
  // Virtual base layers are skipped; everything else (lm_head when not served) is loaded.
  load_weights(*model, checkpoint);
  // The whole checkpoint is the frozen base, as PEFT freezes it: autograd computes no gradient
  // for embeddings, norms or a local lm_head, and none flows below the first adapter.
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  lm.module = model.ptr();
  lm.forward = [model](const at::Tensor& ids, const at::Tensor& mask) mutable { return model->forward(ids, mask); };
  return lm;
}

}  // namespace

CausalLM open_causal_lm(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client,
                        const CausalLMOptions& options) {
  if (client) {
    TORCH_CHECK(client->model_hash() == checkpoint.model_hash(), "the executor serves model ", client->model_hash(),
                ", but checkpoint ", checkpoint.dir(), " is model ", checkpoint.model_hash());
  }
  // Base layers are never materialized here: split, they are virtual; monolithic, load_weights
  // fills them from the checkpoint straight in the model's dtype and on its device.
  const bool materialize = false;
  const auto type = checkpoint.config_string("model_type").value_or("");
  TORCH_CHECK(is_supported_model_type(type), checkpoint.dir() / "config.json", ": ", unsupported_model_type(type));
  if (type == "gpt2" || type == "gpt_bigcode") {  // [GPT-2 family]
    return finish(GPT2LMHeadModel(GPT2Config::from_checkpoint(checkpoint), materialize), checkpoint, client, options);
  }
  if (type == "gpt_neox" || type == "phi" || type == "opt") {  // [GPT-NeoX family]
    return finish(GPTNeoXForCausalLM(GPTNeoXConfig::from_checkpoint(checkpoint), materialize), checkpoint, client,
                  options);
  }
  // [Llama family]: llama, qwen2, qwen3, mistral, gemma2, phi3.
  return finish(LlamaForCausalLM(LlamaConfig::from_checkpoint(checkpoint), materialize), checkpoint, client, options);
}

}  // namespace symbiosis
