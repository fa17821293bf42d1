#pragma once
// PEFT methods, one entry point. Layer-level methods (LoRA in lora.h, IA3 in ia3.h) wrap base
// layers through LayerAdapterImpl (nn.h); model-level methods (prompt tuning, P-tuning, prefix
// tuning in prompt.h) act through the model's ModelAdapterHost hook
// (model_adapter.h). Every method saves and loads Hugging Face PEFT's files:
// adapter_config.json + adapter_model.safetensors.
//
// LoRA with use_dora is DoRA (dora.h); AdaLoRA is in adalora.h.
//
// Not supported, refused when a file asks for them (naming the field): LoRA bias other than
// "none", modules_to_save, and every other peft_type.
#include <filesystem>
#include <string>
#include <vector>

#include "client_runtime/peft/adalora.h"
#include "client_runtime/peft/dora.h"
#include "client_runtime/peft/ia3.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/peft/prompt.h"

namespace symbiosis {

struct LoadedAdapter {
  std::string peft_type;               // "LORA", "ADALORA", "IA3", "PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"
  std::vector<at::Tensor> parameters;  // trainable, in a stable order
};

// Reads adapter_config.json's peft_type and loads that method's adapter into the model,
// attaching it when the model has none.
LoadedAdapter load_peft_adapter(torch::nn::Module& model, const std::filesystem::path& dir);

// Records in DIR's adapter_config.json the base model the adapter was trained on, as PEFT does
// (base_model_name_or_path: the directory or Hub name the base was loaded from), so that PEFT's
// AutoPeftModelForCausalLM.from_pretrained(DIR) loads the base without being told.
void record_base_model(const std::filesystem::path& dir, const std::string& base);

// Every adapter parameter of the model (under a child module named "adapter"), in module order.
std::vector<at::Tensor> adapter_parameters(torch::nn::Module& model);

}  // namespace symbiosis
