// Adapter files interoperate with Hugging Face PEFT (CPU, from PyPI), for every method and every
// architecture (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Phi-3, GPT-2, GPTBigCode, GPT-NeoX, Phi, OPT): an adapter
// saved here and loaded by PEFT on the same random checkpoint gives the same logits (1e-4
// relative), and an adapter made and saved by PEFT, loaded here, gives PEFT's logits. Skipped when
// the Python packages are missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <functional>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/adapter.h"
#include "client_runtime/training/loss.h"
#include "tests/python_reference.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;
using testing::relative_error;
constexpr double kTolerance = 1e-4;

const std::string kPython = SYMBIOSIS_PYTHON;

struct Method {
  std::string name;
  std::function<void(torch::nn::Module&)> add;
  std::function<void(torch::nn::Module&, const fs::path&)> save;
  std::function<void(CausalLM&)> train;  // optional, after add: training that changes the file (AdaLoRA)
};

LoraConfig lora_plain() {
  LoraConfig c;
  c.r = 4;
  c.alpha = 8;
  c.target_modules = {"q_proj", "v_proj", "c_attn", "query_key_value", "qkv_proj"};  // each architecture's
  c.init_b_zero = false;
  return c;
}

LoraConfig lora_rslora_patterns() {
  LoraConfig c = lora_plain();
  c.target_modules = {"all-linear"};
  c.use_rslora = true;
  c.rank_pattern = {{"v_proj", 2}, {"c_fc", 6}};
  c.alpha_pattern = {{"layers\\.1\\.mlp\\.down_proj", 3}, {"h\\.0\\.attn\\.c_attn", 5}};
  return c;
}

LoraConfig lora_dora() {
  LoraConfig c = lora_plain();
  c.target_modules = {"q_proj",          "v_proj",   "down_proj",     "c_attn", "c_fc",
                      "query_key_value", "qkv_proj", "dense_4h_to_h", "fc2"};
  c.use_dora = true;
  return c;
}

// DoRA's magnitude starts at the weight norm, where DoRA equals LoRA; move it off that point.
void perturb_dora_magnitudes(torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    if (item.key().find("lora_magnitude_vector") != std::string::npos) {
      item.value().mul_(at::rand_like(item.value()) + 0.5);
    }
  }
}

AdaLoraConfig adalora_config() {
  AdaLoraConfig c;
  c.init_r = 6;
  c.target_r = 2;
  c.target_modules = {"q_proj", "v_proj", "c_attn", "query_key_value", "qkv_proj"};
  c.init_lora_weights = false;
  c.total_step = 2;
  return c;
}

// PEFT's default targets, but for Phi-3, which has none in PEFT: its fused qkv_proj, and down_proj.
IA3Config ia3_config(torch::nn::Module& model) {
  IA3Config c;
  c.init_ia3_weights = false;
  if (model_adapter_host(model).model_shape().model_type == "phi3") {
    c.target_modules = {"qkv_proj", "down_proj"};
    c.feedforward_modules = {"down_proj"};
  }
  return c;
}

// The config after our allocation step, with its rank_pattern: what the saved file holds.
AdaLoraConfig& adalora_allocated_config() {
  static AdaLoraConfig config;
  return config;
}

// One training step and a budgeted allocation (step 1 of 2), so the saved adapter is resized by a
// rank_pattern as PEFT's is after training.
void adalora_train(CausalLM& lm) {
  const auto config = adalora_config();
  AdaLoraAllocator allocator(*lm.module, config);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  auto ids = at::randint(200, {2, 7}, gen, at::kLong);
  (causal_lm_loss(lm.forward(ids, {}), ids) + adalora_orthogonal_regularization(*lm.module, config)).backward();
  allocator.update_and_allocate(1);
  adalora_allocated_config() = allocator.config();
}

std::vector<Method> methods() {
  auto prompt_save = [](torch::nn::Module& m, const fs::path& d) { save_prompt_learning(m, d); };
  return {
      {"lora", [](torch::nn::Module& m) { add_lora(m, lora_plain()); },
       [](torch::nn::Module& m, const fs::path& d) { save_lora(m, lora_plain(), d); }},
      {"lora_rslora_patterns", [](torch::nn::Module& m) { add_lora(m, lora_rslora_patterns()); },
       [](torch::nn::Module& m, const fs::path& d) { save_lora(m, lora_rslora_patterns(), d); }},
      {"ia3", [](torch::nn::Module& m) { add_ia3(m, ia3_config(m)); },
       [](torch::nn::Module& m, const fs::path& d) { save_ia3(m, ia3_config(m), d); }},
      {"prompt_tuning", [](torch::nn::Module& m) { add_prompt_tuning(m, PromptTuningConfig{5}); }, prompt_save},
      {"p_tuning",
       [](torch::nn::Module& m) {
         PTuningConfig c;
         c.num_virtual_tokens = 4;
         c.encoder_hidden_size = 32;
         add_p_tuning(m, c);
       },
       prompt_save},
      {"prefix_tuning", [](torch::nn::Module& m) { add_prefix_tuning(m, PrefixTuningConfig{6}); }, prompt_save},
      {"prefix_tuning_projection",
       [](torch::nn::Module& m) {
         PrefixTuningConfig c;
         c.num_virtual_tokens = 3;
         c.prefix_projection = true;
         c.encoder_hidden_size = 24;
         add_prefix_tuning(m, c);
       },
       prompt_save},
      {"lora_dora",
       [](torch::nn::Module& m) {
         add_lora(m, lora_dora());
         perturb_dora_magnitudes(m);
       },
       [](torch::nn::Module& m, const fs::path& d) { save_lora(m, lora_dora(), d); }},
      {"adalora", [](torch::nn::Module& m) { add_adalora(m, adalora_config()); },
       [](torch::nn::Module& m, const fs::path& d) { save_adalora(m, adalora_allocated_config(), d); }, adalora_train},
  };
}

using Param = std::tuple<std::string, int>;

class PeftInteropTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const auto& [preset, index] = GetParam();
    method_ = methods()[index];
    dir_ = testing::temp_dir("symbiosis-peft-interop-" + std::get<0>(GetParam()) + "-" + method_.name);
    checkpoint_dir_ = testing::make_checkpoint(preset);
    checkpoint_ = Checkpoint::open(checkpoint_dir_);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    ids_ = at::randint(200, {2, 9}, gen, at::kLong);
    mask_ = at::ones({2, 9}, at::kLong);
    mask_.index_put_({1, at::indexing::Slice(6, at::indexing::None)}, 0);
    write_safetensors(dir_ / "inputs.safetensors",
                      {{"input_ids", ids_.to(at::kFloat)}, {"attention_mask", mask_.to(at::kFloat)}});
  }

  // The logits of real (unpadded) positions: padded rows' tails differ only in masked garbage.
  at::Tensor real(const at::Tensor& logits) { return logits.masked_select(mask_.to(at::kBool).unsqueeze(-1)); }

  // peft_interop.py MODE ARGS... on our checkpoint and inputs, its logits to peft_logits.safetensors.
  int python(std::vector<std::string> args) {
    args.insert(args.end(),
                {"--checkpoint", checkpoint_dir_.string(), "--inputs", (dir_ / "inputs.safetensors").string(),
                 "--output", (dir_ / "peft_logits.safetensors").string()});
    return testing::run_reference("peft_interop.py", args, dir_ / "python.log");
  }

  Method method_;
  fs::path dir_, checkpoint_dir_;
  std::shared_ptr<Checkpoint> checkpoint_;
  at::Tensor ids_, mask_;
};

TEST_P(PeftInteropTest, SavedHereLoadsInPeftWithTheSameLogits) {
  auto lm = open_causal_lm(*checkpoint_);
  at::manual_seed(4321);
  method_.add(*lm.module);
  if (method_.train) method_.train(lm);
  at::Tensor ours;
  {
    at::NoGradGuard no_grad;
    ours = lm.forward(ids_, mask_);
  }
  const auto adapter = dir_ / "ours";
  method_.save(*lm.module, adapter);
  const int status = python({"run", "--adapter", adapter.string()});
  if (status == 3) GTEST_SKIP() << "transformers/peft not installed for " << kPython;
  ASSERT_EQ(status, 0) << "see " << dir_ / "python.log";
  auto theirs = testing::read_safetensors_f32(dir_ / "peft_logits.safetensors", "logits");
  ASSERT_EQ(theirs.sizes(), ours.sizes());
  EXPECT_LT(relative_error(real(ours), real(theirs)), kTolerance);
}

TEST_P(PeftInteropTest, SavedByPeftLoadsHereWithTheSameLogits) {
  const auto adapter = dir_ / "peft";
  const int status = python({"make", "--method", method_.name, "--adapter", adapter.string()});
  if (status == 3) GTEST_SKIP() << "transformers/peft not installed for " << kPython;
  ASSERT_EQ(status, 0) << "see " << dir_ / "python.log";
  auto theirs = testing::read_safetensors_f32(dir_ / "peft_logits.safetensors", "logits");
  auto lm = open_causal_lm(*checkpoint_);
  auto loaded = load_peft_adapter(*lm.module, adapter);
  EXPECT_FALSE(loaded.parameters.empty());
  at::NoGradGuard no_grad;
  auto ours = lm.forward(ids_, mask_);
  ASSERT_EQ(theirs.sizes(), ours.sizes());
  EXPECT_LT(relative_error(real(ours), real(theirs)), kTolerance);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  auto name = std::get<0>(info.param) + "_" + methods()[std::get<1>(info.param)].name;
  for (auto& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return name;
}

INSTANTIATE_TEST_SUITE_P(Methods, PeftInteropTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-gpt2"), ::testing::Range(0, 9)),
                         param_name);

// [Llama family]: Qwen2 (q, k and v biases; PEFT's own IA3 targets for it), Qwen3 (q and k norms),
// Mistral and Gemma 2 (soft caps, scaled embeddings), whose sliding windows the batch outgrows, with
// every method.
INSTANTIATE_TEST_SUITE_P(LlamaFamily, PeftInteropTest,
                         ::testing::Combine(::testing::Values("tiny-qwen2", "tiny-qwen3", "tiny-mistral",
                                                              "tiny-gemma2"),
                                            ::testing::Range(0, 9)),
                         param_name);

// [Phi-3] (a setting of [Llama family]): adapters on the fused qkv_proj and gate_up_proj's sibling
// down_proj, as PEFT names them, with every method.
INSTANTIATE_TEST_SUITE_P(Phi3, PeftInteropTest,
                         ::testing::Combine(::testing::Values("tiny-phi3"), ::testing::Range(0, 9)), param_name);

// [GPT-NeoX family]: GPT-NeoX (query_key_value, each head's q, k and v side by side; embed_out, not
// an all-linear target), Phi (grouped-query attention, lm_head with a bias) and OPT (learned
// positions, the layer's own fc1 and fc2; PEFT's IA3 targets for each), with every method.
INSTANTIATE_TEST_SUITE_P(GPTNeoXFamily, PeftInteropTest,
                         ::testing::Combine(::testing::Values("tiny-gpt-neox", "tiny-phi", "tiny-opt"),
                                            ::testing::Range(0, 9)),
                         param_name);

// [LongRoPE] (Phi-3-mini-128k's scaling, an original context of 8 that the 9 tokens and the virtual
// tokens before them pass) with prompt tuning; [OPT projections] (OPT-350m's project_in and
// project_out, which all-linear LoRA adapts as PEFT does, and post-layer norms) with that LoRA.
INSTANTIATE_TEST_SUITE_P(LongRope, PeftInteropTest,
                         ::testing::Combine(::testing::Values("tiny-phi3-longrope"), ::testing::Values(3)), param_name);
INSTANTIATE_TEST_SUITE_P(OPTProjected, PeftInteropTest,
                         ::testing::Combine(::testing::Values("tiny-opt-projected"), ::testing::Values(1)), param_name);

// [GPT-2 family]: GPTBigCode, multi-query attention (prefix tuning's past with one key/value head)
// and Linear layers where GPT-2 has Conv1D, with every method.
INSTANTIATE_TEST_SUITE_P(GPT2Family, PeftInteropTest,
                         ::testing::Combine(::testing::Values("tiny-gpt-bigcode"), ::testing::Range(0, 9)), param_name);

// PEFT's default targets for each new architecture (peft 0.21's TRANSFORMERS_MODELS_TO_LORA_,
// _IA3_ and _ADALORA_TARGET_MODULES_MAPPING), what an adapter gets when none are named; Phi-3 has
// none in PEFT, and is refused as PEFT refuses it, asking for the targets.
TEST(PeftDefaultTargetsTest, EachArchitectureGetsPeftsTargets) {
  struct Expected {
    std::string preset;
    std::vector<std::string> lora, ia3, ia3_feedforward;
  };
  const std::vector<Expected> expected = {
      {"tiny-opt", {"q_proj", "v_proj"}, {"q_proj", "k_proj", "fc2"}, {"fc2"}},
      {"tiny-gpt-neox", {"query_key_value"}, {"query_key_value", "dense_4h_to_h"}, {"dense_4h_to_h"}},
      {"tiny-phi", {"q_proj", "v_proj", "fc1", "fc2"}, {"q_proj", "v_proj", "fc2"}, {"fc2"}},
  };
  for (const auto& e : expected) {
    SCOPED_TRACE(e.preset);
    auto lm = open_causal_lm(*Checkpoint::open(testing::make_checkpoint(e.preset)));
    EXPECT_EQ(default_lora_targets(*lm.module), e.lora);
    const auto ia3 = IA3Config{}.resolved_for(*lm.module);
    EXPECT_EQ(ia3.target_modules, e.ia3);
    EXPECT_EQ(ia3.feedforward_modules, e.ia3_feedforward);
  }
  auto phi3 = open_causal_lm(*Checkpoint::open(testing::make_checkpoint("tiny-phi3")));
  EXPECT_NE(testing::error_of([&] {
              default_lora_targets(*phi3.module);
            }).find("model_type 'phi3') has no default LoRA targets in PEFT: name them"),
            std::string::npos);
  EXPECT_NE(
      testing::error_of([&] { IA3Config{}.resolved_for(*phi3.module); }).find("IA3 field 'target_modules' is empty"),
      std::string::npos);
}

}  // namespace
}  // namespace symbiosis
