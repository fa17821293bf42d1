#pragma once
// Internal to the PEFT methods (not installed): what every method shares about Hugging Face PEFT's
// adapter files (adapter_config.json + adapter_model.safetensors), finding its adapters in a
// model, and module matching.
#include <ATen/ATen.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "client_runtime/nn.h"

namespace symbiosis::peft {

// PEFT's prefix of a layer's key in adapter_model.safetensors: base_model.model.<module path>.
inline const std::string kKeyPrefix = "base_model.model.";

// adapter_config.json, parsed; throws naming the file for a missing file or bad JSON, and as
// check_config does.
nlohmann::json read_config(const std::filesystem::path& dir, const std::string& expected_type = "");
// Throws naming `dir`'s adapter_config.json when `config` is not an object, its peft_type is not
// `expected_type` (empty: any) or its task_type is not CAUSAL_LM.
void check_config(const nlohmann::json& config, const std::filesystem::path& dir, const std::string& expected_type);
// Every tensor of adapter_model.safetensors, copied into memory (fp32/bf16/fp16, as stored).
std::map<std::string, at::Tensor> read_tensors(const std::filesystem::path& dir);
// Fills a model's adapter tensors, `state` (their PEFT keys and the tensors themselves, as
// lora_state, ia3_state and adalora_state give them), from adapter_model.safetensors, each cast to
// its tensor's dtype. The file must hold exactly these keys in these shapes: otherwise throws,
// naming the file, the tensor and `method`'s adapters ("LoRA", "IA3", ...), having changed nothing.
void load_state(const std::filesystem::path& dir, const std::vector<std::pair<std::string, at::Tensor>>& state,
                const std::string& method);
// The same from `saved`, the file's tensors already in memory (`config`: its adapter_config.json,
// for messages; `dir`: the folder the messages name).
void load_state(const std::map<std::string, at::Tensor>& saved, const nlohmann::json& config,
                const std::filesystem::path& dir, const std::vector<std::pair<std::string, at::Tensor>>& state,
                const std::string& method);
// Writes both files (tensors contiguous, on the CPU, in their own dtype).
void write_adapter(const std::filesystem::path& dir, const nlohmann::json& config,
                   const std::vector<std::pair<std::string, at::Tensor>>& tensors);

// A string or list-of-strings field; `fallback` when absent or null.
std::vector<std::string> string_list(const nlohmann::json& config, const std::string& field,
                                     const std::vector<std::string>& fallback);
// An integer field; `fallback` when absent or null. Anything but a whole number within int64 (a
// float such as 1e20 or 2.5, a string) is refused as "<where>field '<field>' should be an integer,
// got ..." (converting 1e20 to int64_t would be undefined behaviour).
int64_t integer_field(const nlohmann::json& config, const std::string& field, int64_t fallback,
                      const std::string& where);
// Throws naming the field when `field` is present, not null, and not equal to `allowed`
// (a null `allowed` also accepts an empty list or empty object).
void require_default(const nlohmann::json& config, const std::string& field, const nlohmann::json& allowed,
                     const std::string& why);

// The adapters of type Adapter (LoraAdapterImpl, IA3AdapterImpl, ...; a derived type counts) that
// the model's base layers hold, with the layers' module paths, in module order.
template <typename Adapter>
std::vector<std::pair<std::string, std::shared_ptr<Adapter>>> layer_adapters(torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<Adapter>>> found;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    auto adapter = base ? std::dynamic_pointer_cast<Adapter>(base->adapter()) : nullptr;
    if (adapter) found.emplace_back(item.key(), std::move(adapter));
  }
  return found;
}

// Where and in which dtype a new adapter lives: where the model's own (floating-point) parameters
// do. Every method moves its new adapters there, so that a model on a GPU trains them there.
at::TensorOptions parameter_options(torch::nn::Module& model);

// What target_modules may name in this model: its base layers' last path components (GPT-2's
// c_attn, c_proj, c_fc; Llama's q_proj, k_proj, ...), each once, in module order.
std::vector<std::string> targetable_names(torch::nn::Module& model);
// The error for target_modules that matched no base layer: `what` ("LoRA target_modules"), the
// targets, the model's type where it says, and the names that exist.
std::string no_layer_matched(torch::nn::Module& model, const std::string& what,
                             const std::vector<std::string>& targets);
// The same for a model known by its type ("" when it does not say) and its base layers' paths.
std::string no_layer_matched(const std::string& model_type, const std::vector<std::string>& layer_paths,
                             const std::string& what, const std::vector<std::string>& targets);
// Where an adapter in `dir` says it came from, for errors: " (made for 'gpt2', its
// adapter_config.json's base_model_name_or_path)", or "" when it does not say.
std::string adapter_origin(const std::filesystem::path& dir);
std::string adapter_origin(const nlohmann::json& config);
// Runs `add` (add_lora, add_ia3, add_adalora with a saved adapter's config) for load_lora, load_ia3
// and load_adalora: its refusal (target_modules that match no layer of this model: an adapter for
// another architecture) names the user's adapter folder and where the adapter says it came from,
// as "<method> adapter \"<dir>\" (made for ...): ...".
void add_saved_adapter(const std::filesystem::path& dir, const std::string& method, const std::function<void()>& add);

// PEFT's target matching for a list of names: the module's path equals a name or ends with
// ".<name>". A single string in PEFT's config is a regular expression that must match the whole
// path; `is_regex` selects that.
bool matches_module(const std::string& path, const std::vector<std::string>& targets, bool is_regex = false);
// Whether `expression`, a regular expression (ECMAScript, as Python's re reads these) the config's
// `field` gives, matches the whole of `path`; an expression that does not compile is refused
// naming the field and the expression.
bool regex_matches(const std::string& path, const std::string& expression, const std::string& field);

}  // namespace symbiosis::peft
