// Loading adapter files a user has: errors name the user's adapter and what is wrong, and say so
// when the adapter was made for another model; targets that match nothing list the names there are.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/adalora.h"
#include "client_runtime/peft/adapter.h"
#include "client_runtime/peft/ia3.h"
#include "client_runtime/peft/lora.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

CausalLM model_of(const std::string& preset, const std::string& extra_args = "") {
  return open_causal_lm(*Checkpoint::open(testing::make_checkpoint(preset, extra_args)));
}

// A LoRA adapter of `preset`'s model on `targets`, saved as PEFT saves one for the Hub model `base`.
fs::path saved_lora(const std::string& preset, const std::vector<std::string>& targets, const std::string& base,
                    const std::string& extra_args = "") {
  auto lm = model_of(preset, extra_args);
  const LoraConfig config{.r = 2, .alpha = 4, .target_modules = targets};
  add_lora(*lm.module, config);
  const auto dir = testing::temp_dir("symbiosis-user-adapter") / "my-adapter";
  save_lora(*lm.module, config, dir);
  std::ifstream in(dir / "adapter_config.json");
  auto j = nlohmann::json::parse(in);
  j["base_model_name_or_path"] = base;
  std::ofstream(dir / "adapter_config.json") << j.dump(2);
  return dir;
}

// `dir`'s adapter_config.json, with `change` applied to it.
void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& change) {
  std::ifstream in(dir / "adapter_config.json");
  auto j = nlohmann::json::parse(in);
  change(j);
  std::ofstream(dir / "adapter_config.json") << j.dump(2);
}

// The message names the targets, the model and every name target_modules may give, once each.
TEST(PeftTargets, TargetsThatMatchNothingListTheModelsNames) {
  auto gpt2 = model_of("tiny-gpt2");
  auto message = error_of([&] { add_lora(*gpt2.module, LoraConfig{.target_modules = {"q_proj", "v_proj"}}); });
  EXPECT_NE(message.find("LoRA target_modules (q_proj, v_proj) matched no base layer of the model (gpt2); its base "
                         "layers are named c_attn, c_proj, c_fc (or \"all-linear\""),
            std::string::npos)
      << message;
  auto llama = model_of("tiny-llama");
  message =
      error_of([&] { add_ia3(*llama.module, IA3Config{.target_modules = {"c_attn"}, .feedforward_modules = {}}); });
  EXPECT_NE(message.find("IA3 field 'target_modules' (c_attn) matched no base layer of the model (llama); its base "
                         "layers are named q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
            std::string::npos)
      << message;
}

// A GPT-2 adapter loaded into Llama: its targets are not Llama's. The error names the user's
// adapter directory and where the adapter says it came from.
TEST(PeftFilesLoad, AnAdapterForAnotherArchitectureSaysSo) {
  const auto adapter = saved_lora("tiny-gpt2", {"c_attn"}, "openai-community/gpt2");
  auto llama = model_of("tiny-llama");
  const auto message = error_of([&] { load_peft_adapter(*llama.module, adapter); });
  EXPECT_NE(message.find("LoRA adapter \"" + adapter.string() + "\" (made for 'openai-community/gpt2'"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("(c_attn) matched no base layer of the model (llama); its base layers are named q_proj"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("made for another model"), std::string::npos) << message;
  EXPECT_EQ(message.find("symbiosis-lora-"), std::string::npos) << message;  // no temporary copy named
}

// An adapter for a deeper model of the same architecture: its tensors name layers this model lacks.
// Nothing is copied aside to read it: no temporary directory is left behind.
TEST(PeftFilesLoad, AnAdapterForADeeperModelNamesTheModulesThisOneLacks) {
  const auto adapter = saved_lora("tiny-llama", {"q_proj"}, "my-org/deeper-llama");
  auto shallow = model_of("tiny-llama", "--layers 1");
  const auto message = error_of([&] { load_peft_adapter(*shallow.module, adapter); });
  const auto file = adapter / "adapter_model.safetensors";
  EXPECT_NE(
      message.find("\"" + file.string() + "\": this adapter's tensors name modules (model.layers.1.self_attn.q_proj"),
      std::string::npos)
      << message;
  EXPECT_NE(message.find("that this model does not have (made for 'my-org/deeper-llama'"), std::string::npos)
      << message;
  EXPECT_NE(message.find("the model's LoRA layers are model.layers.0.self_attn.q_proj"), std::string::npos) << message;
  for (const auto& entry : fs::directory_iterator(fs::temp_directory_path())) {
    EXPECT_NE(entry.path().filename().string(), "symbiosis-lora-" + std::to_string(::getpid())) << entry.path();
  }
}

// [Fuzzing] peft_files' finding (fuzz/regressions/peft_files/adalora-targets-match-nothing): an
// AdaLoRA or IA3 adapter whose targets match no layer here is refused, as LoRA's is, naming the
// user's adapter directory and where the adapter came from; an AdaLoRA rank_pattern whose list
// does not cover its layer's init_r names adapter_config.json.
TEST(PeftFilesLoad, AdaLoraAndIA3AdaptersForAnotherArchitectureNameTheAdapter) {
  auto gpt2 = model_of("tiny-gpt2");
  const auto root = testing::temp_dir("symbiosis-user-adapter");
  const AdaLoraConfig adalora{.init_r = 4, .target_r = 2, .total_step = 10};
  add_adalora(*gpt2.module, adalora);
  save_adalora(*gpt2.module, adalora, root / "my-adalora");
  auto gpt2_ia3 = model_of("tiny-gpt2");
  add_ia3(*gpt2_ia3.module);
  save_ia3(*gpt2_ia3.module, {}, root / "my-ia3");
  for (const auto& [name, method] : {std::pair{"my-adalora", "AdaLoRA"}, std::pair{"my-ia3", "IA3"}}) {
    const auto adapter = root / name;
    edit_config(adapter, [](nlohmann::json& j) { j["base_model_name_or_path"] = "openai-community/gpt2"; });
    auto llama = model_of("tiny-llama");
    const auto message = error_of([&] { load_peft_adapter(*llama.module, adapter); });
    EXPECT_NE(
        message.find(std::string(method) + " adapter \"" + adapter.string() + "\" (made for 'openai-community/gpt2'"),
        std::string::npos)
        << message;
    EXPECT_NE(message.find("matched no base layer of the model (llama); its base layers are named q_proj"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("made for another model"), std::string::npos) << message;
  }

  auto llama = model_of("tiny-llama");
  add_adalora(*llama.module, adalora);
  const auto adapter = root / "short-rank-pattern";
  save_adalora(*llama.module, adalora, adapter);
  edit_config(adapter, [](nlohmann::json& j) {
    j["rank_pattern"] = {{"model.layers.0.self_attn.q_proj.lora_E", {true, false}}};
  });
  auto fresh = model_of("tiny-llama");
  const auto message = error_of([&] { load_peft_adapter(*fresh.module, adapter); });
  EXPECT_NE(message.find("\"" + (adapter / "adapter_config.json").string() +
                         "\": field 'rank_pattern' gives 'model.layers.0.self_attn.q_proj.lora_E' 2 entries; its "
                         "layer has init_r = 4"),
            std::string::npos)
      << message;
}

// [Fuzzing] peft_files' finding (fuzz/regressions/peft_files/adalora-integer-field-1e20): an
// integer field holding a number beyond int64 (read by JSON as a float) or a fraction is refused
// naming adapter_config.json and the field, never converted (undefined behaviour).
TEST(PeftFilesLoad, FieldsOfTheWrongTypeAreRefusedNamingTheFileAndField) {
  auto llama = model_of("tiny-llama");
  const AdaLoraConfig adalora{.init_r = 4, .target_r = 2, .total_step = 10};
  add_adalora(*llama.module, adalora);
  const auto root = testing::temp_dir("symbiosis-user-adapter");
  save_adalora(*llama.module, adalora, root / "adalora");
  edit_config(root / "adalora", [](nlohmann::json& j) { j["tinit"] = nlohmann::json::parse("184467440737095516150"); });
  auto fresh = model_of("tiny-llama");
  auto message = error_of([&] { load_peft_adapter(*fresh.module, root / "adalora"); });
  EXPECT_NE(message.find((root / "adalora" / "adapter_config.json").string() +
                         ": field 'tinit' should be an integer, got 1.84467"),
            std::string::npos)
      << message;
  const auto lora = saved_lora("tiny-llama", {"q_proj"}, "my-org/llama");
  edit_config(lora, [](nlohmann::json& j) { j["r"] = 2.5; });
  message = error_of([&] { load_peft_adapter(*fresh.module, lora); });
  EXPECT_NE(message.find((lora / "adapter_config.json").string() + ": field 'r' should be an integer, got 2.5"),
            std::string::npos)
      << message;
  // [Fuzzing] peft_files' finding (lora-target-modules-of-the-wrong-type): a field of the wrong
  // JSON type escaped as nlohmann's type_error, naming no file.
  edit_config(lora, [](nlohmann::json& j) {
    j["r"] = 2;
    j["target_modules"] = false;
  });
  message = error_of([&] { load_peft_adapter(*fresh.module, lora); });
  EXPECT_NE(message.find("\"" + (lora / "adapter_config.json").string() + "\": bad LoRA field: "), std::string::npos)
      << message;
  EXPECT_NE(message.find("type must be array, but is boolean"), std::string::npos) << message;
  edit_config(lora, [](nlohmann::json& j) { j["peft_type"] = false; });
  message = error_of([&] { load_peft_adapter(*fresh.module, lora); });
  EXPECT_NE(
      message.find("\"" + (lora / "adapter_config.json").string() + "\": field 'peft_type' is ''; supported: LORA"),
      std::string::npos)
      << message;
  // [Fuzzing] peft_files' finding (regex-rank-pattern): a rank_pattern or alpha_pattern key is a
  // regular expression; one that does not compile escaped as std::regex_error.
  for (const auto& [field, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"rank_pattern", {{"(_proj", 4}}}, {"alpha_pattern", {{"q_proj)", 8.0}}}}) {
    SCOPED_TRACE(field);
    edit_config(lora, [&](nlohmann::json& j) {
      j["peft_type"] = "LORA";
      j["target_modules"] = {"q_proj"};
      j.erase("rank_pattern");
      j.erase("alpha_pattern");
      j[field] = value;
    });
    message = error_of([&] { load_peft_adapter(*fresh.module, lora); });
    EXPECT_NE(message.find("field '" + field + "' holds '"), std::string::npos) << message;
    EXPECT_NE(message.find("which is not a regular expression"), std::string::npos) << message;
  }
}

// A damaged adapter file is named as the user's file, never a copy of it.
TEST(PeftFilesLoad, ErrorsNameTheUsersAdapterFile) {
  const auto adapter = saved_lora("tiny-llama", {"q_proj"}, "my-org/llama");
  fs::resize_file(adapter / "adapter_model.safetensors", 6);
  auto llama = model_of("tiny-llama");
  const auto message = error_of([&] { load_peft_adapter(*llama.module, adapter); });
  EXPECT_NE(message.find("\"" + (adapter / "adapter_model.safetensors").string() + "\""), std::string::npos) << message;
}

}  // namespace
}  // namespace symbiosis
