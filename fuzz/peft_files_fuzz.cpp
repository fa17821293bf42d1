// [Fuzzing] peft_files: a saved PEFT adapter (adapter_config.json + adapter_model.safetensors) as
// load_peft_adapter reads it into a model: the config's peft_type picks LoRA (and DoRA), AdaLoRA,
// IA3 or a prompt-learning method, whose reader checks the config's fields and the tensors' names
// and shapes against a small Llama, then copies them in. Every refusal names one of the two files.
// Input: adapter_config.json, then adapter_model.safetensors, split by kPartMarker.
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "client_runtime/models/llama.h"
#include "client_runtime/peft/adapter.h"
#include "fuzz/fuzz_support.h"

namespace symbiosis::fuzz {
namespace {

LlamaConfig small_llama() {
  LlamaConfig c;
  c.vocab_size = 16;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.max_position_embeddings = 32;
  return c;
}

void take(const uint8_t* data, size_t size) {
  const auto parts = split_parts(data, size, 2);
  const auto& dir = fresh_scratch_dir();
  write_file(dir / "adapter_config.json", parts[0]);
  if (parts.size() > 1) write_file(dir / "adapter_model.safetensors", parts[1]);
  // A new model once an adapter was attached (a load may attach one and then refuse the tensors).
  static LlamaForCausalLM model(small_llama());
  if (!adapter_parameters(*model).empty() || prompt_learning_adapter(*model)) model = LlamaForCausalLM(small_llama());
  expect_refusal_or_success(
      [&] {
        const auto loaded = load_peft_adapter(*model, dir);
        FUZZ_ASSERT(!loaded.peft_type.empty());
      },
      dir.string());
}

}  // namespace

void write_seeds(const std::filesystem::path& dir) {
  const auto& scratch = fresh_scratch_dir();
  int n = 0;
  auto keep = [&](const std::filesystem::path& adapter) {
    auto read = [](const std::filesystem::path& path) {
      std::ifstream in(path, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    };
    write_file(dir / ("seed-" + std::to_string(n++)),
               join_parts({read(adapter / "adapter_config.json"), read(adapter / "adapter_model.safetensors")}));
  };
  {
    LlamaForCausalLM model(small_llama());
    LoraConfig config;
    config.r = 2;
    config.rank_pattern = {{"v_proj", 4}};
    config.alpha_pattern = {{"q_proj", 8.0}};
    add_lora(*model, config);
    save_lora(*model, config, scratch / "lora");
    keep(scratch / "lora");
  }
  {
    LlamaForCausalLM model(small_llama());
    LoraConfig config;
    config.r = 2;
    config.use_dora = true;
    config.target_modules = {"all-linear"};
    add_lora(*model, config);
    save_lora(*model, config, scratch / "dora");
    keep(scratch / "dora");
  }
  {
    LlamaForCausalLM model(small_llama());
    add_ia3(*model);
    save_ia3(*model, {}, scratch / "ia3");
    keep(scratch / "ia3");
  }
  {
    LlamaForCausalLM model(small_llama());
    AdaLoraConfig config;
    config.init_r = 4;
    config.target_r = 2;
    config.total_step = 10;
    add_adalora(*model, config);
    save_adalora(*model, config, scratch / "adalora");
    keep(scratch / "adalora");
  }
  {
    LlamaForCausalLM model(small_llama());
    add_prompt_tuning(*model, {.num_virtual_tokens = 3});
    save_prompt_learning(*model, scratch / "prompt");
    keep(scratch / "prompt");
  }
  {
    LlamaForCausalLM model(small_llama());
    add_prefix_tuning(*model, {.num_virtual_tokens = 2, .prefix_projection = true, .encoder_hidden_size = 4});
    save_prompt_learning(*model, scratch / "prefix");
    keep(scratch / "prefix");
  }
}

}  // namespace symbiosis::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  symbiosis::fuzz::take(data, size);
  return 0;
}
