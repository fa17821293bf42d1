// [Fuzzing] checkpoint: a Hugging Face checkpoint folder as Checkpoint::open reads it (config.json;
// model.safetensors, or shards listed in model.safetensors.index.json), then what reads it: every
// tensor (mapped or copied, its bytes read), the config look-ups, the Llama and GPT-2 configs
// (config.json's fields), and the executor's base model (BaseModel::load). Every refusal must
// name the checkpoint's folder (common/checkpoint.h: "every error ... names the file").
// Input: config.json, model.safetensors (or the first shard), then optionally the index and a
// second shard, split by kPartMarker. With an index, the first part is model-00001-of-00002 and
// the last model-00002-of-00002.
#include "base_executor/base_model.h"
#include "client_runtime/models/gpt2.h"
#include "client_runtime/models/llama.h"
#include "common/checkpoint.h"
#include "fuzz/fuzz_support.h"

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

namespace symbiosis::fuzz {
namespace {

const char* kFirstShard = "model-00001-of-00002.safetensors";
const char* kSecondShard = "model-00002-of-00002.safetensors";

void read_all(const Checkpoint& ckpt) {
  for (const auto& name : ckpt.names()) {
    const auto& record = ckpt.record(name);
    const at::Tensor t = ckpt.tensor(name);
    FUZZ_ASSERT(t.sizes() == at::IntArrayRef(record.shape) && t.scalar_type() == record.dtype);
    // Every byte read: a view that runs past its file faults here.
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    unsigned sum = 0;
    for (size_t i = 0; i < t.nbytes(); ++i) sum += bytes[i];
    (void)sum;
  }
  for (const char* path :
       {"hidden_size", "rope_scaling.factor", "layer_types.0", "model_type", "tie_word_embeddings"}) {
    ckpt.config_has(path);
  }
  (void)ckpt.model_hash();
}

void take(const uint8_t* data, size_t size) {
  const auto parts = split_parts(data, size, 4);
  const auto& dir = fresh_scratch_dir();
  write_file(dir / "config.json", parts[0]);
  const bool sharded = parts.size() > 2;
  if (parts.size() > 1) write_file(dir / (sharded ? kFirstShard : "model.safetensors"), parts[1]);
  if (sharded) write_file(dir / "model.safetensors.index.json", parts[2]);
  if (parts.size() > 3) write_file(dir / kSecondShard, parts[3]);

  std::shared_ptr<Checkpoint> ckpt;
  expect_refusal_or_success([&] { ckpt = Checkpoint::open(dir); }, dir.string());
  if (!ckpt) return;
  expect_refusal_or_success([&] { read_all(*ckpt); }, dir.string());
  // A model config's refusals name the field, and config.json or the config they come from.
  expect_refusal_or_success([&] { (void)LlamaConfig::from_checkpoint(*ckpt); }, "config");
  expect_refusal_or_success([&] { (void)GPT2Config::from_checkpoint(*ckpt); }, "config");
  expect_refusal_or_success([&] { (void)BaseModel::load(*ckpt, BaseLayerRule{}, at::kCPU, std::nullopt); },
                            dir.string());
}

}  // namespace

void write_seeds(const std::filesystem::path& dir) {
  const auto& scratch = fresh_scratch_dir();
  auto read = [](const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string llama = R"({"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}})";
  const std::string gpt2 = R"({"model_type": "gpt2", "vocab_size": 16, "n_positions": 32, "n_embd": 8, "n_layer": 1,
 "n_head": 2, "n_inner": null, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"})";
  const std::string p = "model.layers.0.";
  const std::vector<std::pair<std::string, at::Tensor>> tensors{
      {"model.embed_tokens.weight", at::randn({16, 8}).to(at::kBFloat16)},
      {p + "self_attn.q_proj.weight", at::randn({8, 8})},
      {p + "self_attn.k_proj.weight", at::randn({4, 8})},
      {p + "self_attn.v_proj.weight", at::randn({4, 8})},
      {p + "mlp.down_proj.weight", at::randn({8, 16}).to(at::kHalf)},
      {p + "input_layernorm.weight", at::ones({8})}};
  write_safetensors(scratch / "one.safetensors", tensors, {{"format", "pt"}});
  write_safetensors(scratch / "first.safetensors", {tensors.begin(), tensors.begin() + 3});
  write_safetensors(scratch / "second.safetensors", {tensors.begin() + 3, tensors.end()});
  nlohmann::json index = {{"metadata", {{"total_size", 1}}}, {"weight_map", nlohmann::json::object()}};
  for (size_t i = 0; i < tensors.size(); ++i)
    index["weight_map"][tensors[i].first] = i < 3 ? kFirstShard : kSecondShard;
  const std::string h = "h.0.";
  write_safetensors(scratch / "gpt2.safetensors", {{h + "attn.c_attn.weight", at::randn({8, 24})},
                                                   {h + "attn.c_attn.bias", at::randn({24})},
                                                   {"wte.weight", at::randn({16, 8})}});
  const std::vector<std::vector<std::string>> seeds{
      {llama, read(scratch / "one.safetensors")},
      {llama, read(scratch / "first.safetensors"), index.dump(), read(scratch / "second.safetensors")},
      {gpt2, read(scratch / "gpt2.safetensors")},
      {"{}", std::string(8, '\0')},
  };
  for (size_t i = 0; i < seeds.size(); ++i) write_file(dir / ("seed-" + std::to_string(i)), join_parts(seeds[i]));
}

}  // namespace symbiosis::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  symbiosis::fuzz::take(data, size);
  return 0;
}
