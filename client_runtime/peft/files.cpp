#include "client_runtime/peft/files.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <regex>

#include "client_runtime/peft/model_adapter.h"
#include "common/checkpoint.h"

namespace symbiosis::peft {

nlohmann::json read_config(const std::filesystem::path& dir, const std::string& expected_type) {
  const auto path = dir / "adapter_config.json";
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "missing file ", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "bad JSON in ", path, ": ", e.what());
  }
  check_config(j, dir, expected_type);
  return j;
}

void check_config(const nlohmann::json& j, const std::filesystem::path& dir, const std::string& expected_type) {
  const auto path = dir / "adapter_config.json";
  TORCH_CHECK(j.is_object(), path, " is not a JSON object");
  const auto type = j.contains("peft_type") && j["peft_type"].is_string() ? j["peft_type"].get<std::string>() : "";
  TORCH_CHECK(expected_type.empty() || type == expected_type, path, ": field 'peft_type' is '", type, "', expected '",
              expected_type, "'");
  if (j.contains("task_type") && !j["task_type"].is_null()) {
    TORCH_CHECK(j["task_type"] == "CAUSAL_LM", path, ": field 'task_type' is ", j["task_type"].dump(),
                ", expected \"CAUSAL_LM\"");
  }
}

std::map<std::string, at::Tensor> read_tensors(const std::filesystem::path& dir) {
  const auto file = dir / "adapter_model.safetensors";
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK(in.good(), "missing file ", file);
  const uint64_t size = std::filesystem::file_size(file);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  // Compared without adding to the file's number, which may be anything up to 2^64 - 1.
  TORCH_CHECK(in.good() && size >= 8 && header_len <= size - 8, file, ": bad safetensors header length ", header_len,
              " (the file has ", size, " bytes)");
  const uint64_t data_bytes = size - 8 - header_len;
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json table;
  try {
    table = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, file, ": bad safetensors header: ", e.what());
  }
  TORCH_CHECK(table.is_object(), file, ": the safetensors header is not a JSON object");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, entry] : table.items()) {
    if (name == "__metadata__") continue;
    const std::string where = file.string() + ": tensor '" + name + "'";
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    std::vector<uint64_t> offsets;
    try {
      TORCH_CHECK(entry.is_object(), where, ": its entry is not an object");
      dtype = dtype_from_safetensors(entry.at("dtype").get<std::string>(), where);
      shape = entry.at("shape").get<std::vector<int64_t>>();
      offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, where,
                  ": needs dtype (a string), shape and data_offsets (lists of whole numbers): ", e.what());
    }
    // The shape's bytes, refused before anything is allocated for them when they overflow or do
    // not fit the file.
    uint64_t bytes = at::elementSize(dtype);
    for (const int64_t d : shape) {
      TORCH_CHECK(d >= 0, where, ": shape ", at::IntArrayRef(shape), " has a negative size");
      TORCH_CHECK(d == 0 || bytes <= data_bytes / static_cast<uint64_t>(d), where, ": shape ", at::IntArrayRef(shape),
                  " needs more bytes than the file holds");
      bytes *= static_cast<uint64_t>(d);
    }
    TORCH_CHECK(
        offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data_bytes && offsets[1] - offsets[0] == bytes,
        where, " has bad data_offsets (expected [begin, begin + ", bytes, "] within the ", data_bytes, " data bytes)");
    auto t = at::empty(shape, at::TensorOptions().dtype(dtype));
    in.seekg(static_cast<std::streamoff>(8 + header_len + offsets[0]));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    TORCH_CHECK(in.good(), where, ": short read");
    tensors.emplace(name, t);
  }
  return tensors;
}

namespace {

// The module a PEFT key belongs to: "base_model.model.<path>.lora_A.weight" -> "<path>" (also
// <path>.lora_E, .ia3_l, .lora_magnitude_vector).
std::string module_of(std::string key) {
  if (key.rfind(kKeyPrefix, 0) == 0) key = key.substr(kKeyPrefix.size());
  const std::string weight = ".weight";
  if (key.size() > weight.size() && key.compare(key.size() - weight.size(), weight.size(), weight) == 0) {
    key.resize(key.size() - weight.size());
  }
  const auto dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(0, dot);
}

// "a, b, c and 7 more" (the first `shown`).
std::string some_of(const std::vector<std::string>& names, size_t shown = 3) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

std::string joined(const std::vector<std::string>& names) { return some_of(names, names.size()); }

std::string model_type_of(torch::nn::Module& model) {
  auto* host = dynamic_cast<ModelAdapterHost*>(&model);
  return host ? host->model_shape().model_type : "";
}

}  // namespace

at::TensorOptions parameter_options(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (at::isFloatingType(p.scalar_type())) return p.options();
  }
  return at::TensorOptions();
}

namespace {

// The base layers' paths' last components, each once, in order.
std::vector<std::string> last_components(const std::vector<std::string>& paths) {
  std::vector<std::string> names;
  for (const auto& path : paths) {
    const auto dot = path.rfind('.');
    auto name = dot == std::string::npos ? path : path.substr(dot + 1);
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(std::move(name));
  }
  return names;
}

std::vector<std::string> base_layer_paths(torch::nn::Module& model) {
  std::vector<std::string> paths;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<nn::BaseLayerImpl*>(item.value().get()) != nullptr) paths.push_back(item.key());
  }
  return paths;
}

}  // namespace

std::vector<std::string> targetable_names(torch::nn::Module& model) { return last_components(base_layer_paths(model)); }

std::string no_layer_matched(torch::nn::Module& model, const std::string& what,
                             const std::vector<std::string>& targets) {
  return no_layer_matched(model_type_of(model), base_layer_paths(model), what, targets);
}

std::string no_layer_matched(const std::string& model_type, const std::vector<std::string>& layer_paths,
                             const std::string& what, const std::vector<std::string>& targets) {
  const auto names = last_components(layer_paths);
  return what + " (" + joined(targets) + ") matched no base layer of the model" +
         (model_type.empty() ? "" : " (" + model_type + ")") + "; its base layers are named " +
         (names.empty() ? std::string("(none: the model has no base layers)") : joined(names));
}

std::string adapter_origin(const std::filesystem::path& dir) {
  std::ifstream in(dir / "adapter_config.json");
  if (!in) return "";
  return adapter_origin(nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false));
}

std::string adapter_origin(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("base_model_name_or_path") || !j["base_model_name_or_path"].is_string()) return "";
  return " (made for '" + j["base_model_name_or_path"].get<std::string>() +
         "', its adapter_config.json's base_model_name_or_path)";
}

int64_t integer_field(const nlohmann::json& config, const std::string& field, int64_t fallback,
                      const std::string& where) {
  if (!config.contains(field) || config[field].is_null()) return fallback;
  const auto& value = config[field];
  const bool whole =
      value.is_number_integer() && !(value.is_number_unsigned() && value.get<uint64_t>() > uint64_t{INT64_MAX});
  TORCH_CHECK(whole, where, "field '", field, "' should be an integer, got ", value.dump().substr(0, 64));
  return value.get<int64_t>();
}

void add_saved_adapter(const std::filesystem::path& dir, const std::string& method, const std::function<void()>& add) {
  try {
    add();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, method, " adapter ", dir, adapter_origin(dir), ": ", e.what_without_backtrace(),
                ". Was the adapter made for another model?");
  }
}

void load_state(const std::filesystem::path& dir, const std::vector<std::pair<std::string, at::Tensor>>& state,
                const std::string& method) {
  std::ifstream config(dir / "adapter_config.json");
  load_state(read_tensors(dir), nlohmann::json::parse(config, nullptr, /*allow_exceptions=*/false), dir, state, method);
}

void load_state(const std::map<std::string, at::Tensor>& saved, const nlohmann::json& config,
                const std::filesystem::path& dir, const std::vector<std::pair<std::string, at::Tensor>>& state,
                const std::string& method) {
  const auto file = dir / "adapter_model.safetensors";
  // An adapter for another architecture (or another depth) names modules this model lacks: say so,
  // rather than only which tensor is missing.
  std::vector<std::string> model_modules, foreign;  // in order, each once
  for (const auto& [name, param] : state) {
    const auto module = module_of(name);
    if (model_modules.empty() || model_modules.back() != module) model_modules.push_back(module);
  }
  for (const auto& [name, tensor] : saved) {
    const auto module = module_of(name);
    const bool known = std::find(model_modules.begin(), model_modules.end(), module) != model_modules.end();
    if (!known && std::find(foreign.begin(), foreign.end(), module) == foreign.end()) foreign.push_back(module);
  }
  TORCH_CHECK(foreign.empty(), file, ": this adapter's tensors name modules (", some_of(foreign),
              ") that this model does not have", adapter_origin(config), "; the model's ", method, " layers are ",
              model_modules.empty() ? std::string("none") : some_of(model_modules),
              ". Was the adapter made for another model?");
  TORCH_CHECK(saved.size() == state.size(), file, " holds ", saved.size(), " tensors, but the model's ", method,
              " adapters have ", state.size());
  std::vector<const at::Tensor*> sources;
  for (const auto& [name, param] : state) {
    auto it = saved.find(name);
    TORCH_CHECK(it != saved.end(), file, " lacks tensor '", name, "'");
    TORCH_CHECK(it->second.sizes() == param.sizes(), file, ": tensor '", name, "' has shape ", it->second.sizes(),
                ", expected ", param.sizes());
    sources.push_back(&it->second);
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < state.size(); ++i) state[i].second.copy_(*sources[i]);
}

void write_adapter(const std::filesystem::path& dir, const nlohmann::json& config,
                   const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> cpu;
  for (const auto& [name, t] : tensors) cpu.emplace_back(name, t.detach().to(at::kCPU).contiguous());
  write_safetensors(dir / "adapter_model.safetensors", cpu, {{"format", "pt"}});
  std::ofstream(dir / "adapter_config.json") << config.dump(2) << "\n";
}

std::vector<std::string> string_list(const nlohmann::json& config, const std::string& field,
                                     const std::vector<std::string>& fallback) {
  if (!config.contains(field) || config[field].is_null()) return fallback;
  const auto& v = config[field];
  if (v.is_string()) return {v.get<std::string>()};
  TORCH_CHECK(v.is_array(), "adapter config field '", field, "' should be a string or a list of strings, got ",
              v.dump());
  std::vector<std::string> out;
  for (const auto& item : v) {
    TORCH_CHECK(item.is_string(), "adapter config field '", field, "' holds a non-string: ", item.dump());
    out.push_back(item.get<std::string>());
  }
  return out;
}

void require_default(const nlohmann::json& config, const std::string& field, const nlohmann::json& allowed,
                     const std::string& why) {
  if (!config.contains(field)) return;
  const auto& v = config[field];
  if (v.is_null() || v == allowed) return;
  if (allowed.is_null() && (v.is_array() || v.is_object()) && v.empty()) return;
  TORCH_CHECK(false, "adapter config field '", field, "' is ", v.dump(), ": ", why);
}

bool regex_matches(const std::string& path, const std::string& expression, const std::string& field) {
  try {
    return std::regex_match(path, std::regex(expression));
  } catch (const std::regex_error& e) {
    TORCH_CHECK(false, "adapter config field '", field, "' holds '", expression.substr(0, 80),
                "', which is not a regular expression (", e.what(), ")");
  }
}

bool matches_module(const std::string& path, const std::vector<std::string>& targets, bool is_regex) {
  for (const auto& target : targets) {
    if (is_regex) {
      if (regex_matches(path, target, "target_modules")) return true;
      continue;
    }
    if (path == target) return true;
    if (path.size() > target.size() && path.compare(path.size() - target.size(), target.size(), target) == 0 &&
        path[path.size() - target.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

}  // namespace symbiosis::peft
