#pragma once
// The architectures the C++ client runtime has a model for, by config.json's model_type
// (client_runtime/models/: GPT-2 with GPTBigCode, [GPT-2 family] in gpt2.h; Llama with Qwen2,
// Qwen3, Mistral, Gemma 2 and Phi-3, [Llama family] in llama.h; GPT-NeoX with Phi and OPT,
// [GPT-NeoX family] in gpt_neox.h); it refuses another model_type in these words
// (unsupported_model_type). The executor serves any ([Any architecture] in
// base_executor/base_model.cpp), for Python tenants (docs/python.md).
#include <algorithm>
#include <string>
#include <vector>

namespace symbiosis {

inline const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> types = {"gemma2", "gpt2", "gpt_bigcode", "gpt_neox", "llama", "mistral",
                                                 "opt",    "phi",  "phi3",        "qwen2",    "qwen3"};
  return types;
}

inline bool is_supported_model_type(const std::string& type) {
  const auto& types = supported_model_types();
  return std::find(types.begin(), types.end(), type) != types.end();
}

// "model_type 'bloom' is not supported (supported: gemma2, gpt2, ...)"; a missing
// model_type reads "config.json has no model_type (supported: ...)".
inline std::string unsupported_model_type(const std::string& type) {
  std::string list;
  for (const auto& t : supported_model_types()) list += (list.empty() ? "" : ", ") + t;
  return (type.empty() ? std::string("config.json has no model_type") : "model_type '" + type + "' is not supported") +
         " (supported: " + list + ")";
}

}  // namespace symbiosis
