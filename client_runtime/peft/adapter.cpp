#include "client_runtime/peft/adapter.h"

#include <fstream>

#include "client_runtime/peft/files.h"

namespace symbiosis {

LoadedAdapter load_peft_adapter(torch::nn::Module& model, const std::filesystem::path& dir) {
  const auto config = peft::read_config(dir);
  LoadedAdapter loaded;
  // Not a string (false): refused below as an unsupported type, naming the file.
  if (config.contains("peft_type") && config["peft_type"].is_string()) loaded.peft_type = config["peft_type"];
  const auto& type = loaded.peft_type;
  if (type == "LORA") {
    load_lora(model, dir);
  } else if (type == "IA3") {
    load_ia3(model, dir);
  } else if (type == "PROMPT_TUNING" || type == "P_TUNING" || type == "PREFIX_TUNING") {
    load_prompt_learning(model, dir);
  } else if (type == "ADALORA") {
    load_adalora(model, dir);
  } else {
    TORCH_CHECK(false, dir / "adapter_config.json", ": field 'peft_type' is '", type,
                "'; supported: LORA, ADALORA, IA3, PROMPT_TUNING, P_TUNING, PREFIX_TUNING");
  }
  loaded.parameters = adapter_parameters(model);
  return loaded;
}

std::vector<at::Tensor> adapter_parameters(torch::nn::Module& model) {
  std::vector<at::Tensor> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& name = item.key();
    const bool under_adapter = name.rfind("adapter.", 0) == 0 || name.find(".adapter.") != std::string::npos;
    if (under_adapter && item.value().requires_grad()) params.push_back(item.value());
  }
  return params;
}

void record_base_model(const std::filesystem::path& dir, const std::string& base) {
  auto config = peft::read_config(dir);
  config["base_model_name_or_path"] = base;
  std::ofstream(dir / "adapter_config.json") << config.dump(2) << "\n";
}

}  // namespace symbiosis
