// Invariant 1 (exactness) for every PEFT method: split execution against an in-process executor
// computes what the same model computes monolithically, in logits, loss and every adapter gradient
// (fp32, 1e-5 relative), and the adapters still agree after three AdamW steps. Llama (grouped-query
// attention, llama3 RoPE), tied Llama and GPT-2; a right-padded batch exercises the attention
// mask's extension for virtual tokens.
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/adapter.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/loss.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

using testing::relative_error;
constexpr double kTolerance = 1e-5;

using AddMethod = testing::AddAdapter;

struct Method {
  std::string name;
  AddMethod add;
};

// The method that `add` (add_lora, add_ia3, ...) attaches with `config`.
template <typename Config>
Method method(std::string name, std::vector<at::Tensor> (*add)(torch::nn::Module&, const Config&), Config config) {
  return {std::move(name), [add, config](torch::nn::Module& m) { return add(m, config); }};
}

std::vector<Method> methods() {
  return {
      // Random vectors: every gradient non-trivial.
      method("ia3", add_ia3, IA3Config{.init_ia3_weights = false}),
      method("prompt_tuning", add_prompt_tuning, PromptTuningConfig{.num_virtual_tokens = 5}),
      method("p_tuning", add_p_tuning, PTuningConfig{.num_virtual_tokens = 4, .encoder_hidden_size = 32}),
      method("prefix_tuning", add_prefix_tuning, PrefixTuningConfig{.num_virtual_tokens = 6}),
      method("prefix_tuning_projection", add_prefix_tuning,
             PrefixTuningConfig{.num_virtual_tokens = 3, .prefix_projection = true, .encoder_hidden_size = 24}),
      method("lora_rslora_patterns", add_lora,
             LoraConfig{.r = 4,
                        .alpha = 8,
                        .target_modules = {"all-linear"},
                        .init_b_zero = false,
                        .use_rslora = true,
                        .rank_pattern = {{"v_proj", 2}, {"c_fc", 6}},
                        .alpha_pattern = {{"layers\\.1\\.mlp\\.down_proj", 3}, {"h\\.0\\.attn\\.c_attn", 5}}}),
      // DoRA on Linear (no bias) and Conv1D (with bias) layers: the split side finds the weight
      // norms through FORWARD_NO_BIAS ([DoRA norms on the executor]), the monolithic side from W.
      method("lora_dora", add_lora,
             LoraConfig{.r = 4,
                        .alpha = 8,
                        .target_modules = {"q_proj", "v_proj", "down_proj", "c_attn", "c_fc"},
                        .init_b_zero = false,
                        .use_dora = true}),
  };
}

using MethodRun = testing::TrainingRun;

// The same adapter initialization on both sides.
MethodRun make_run(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client, const Method& method) {
  return testing::make_training_run(checkpoint, client, method.add, {}, 1e-2, 4321);
}

using Param = std::tuple<std::string, int>;  // preset, index into methods()

class PeftExactnessTest : public ::testing::TestWithParam<Param> {};

TEST_P(PeftExactnessTest, SplitEqualsMonolithicInLossLogitsAndAdapterGradients) {
  const auto& [preset, index] = GetParam();
  const Method method = methods()[index];
  auto served = testing::serve_model(preset);
  const auto& [dir, checkpoint, executor, client] = served;

  MethodRun split = make_run(*checkpoint, client, method);
  MethodRun mono = make_run(*checkpoint, nullptr, method);
  ASSERT_GT(split.lm.virtual_layers, 0u);
  EXPECT_EQ(adapter_parameters(*split.lm.module).size(), split.adapter.size());

  at::manual_seed(7);
  auto ids = at::randint(0, 200, {2, 10}, at::kLong);
  auto mask = at::ones({2, 10}, at::kLong);
  mask.index_put_({1, at::indexing::Slice(7, at::indexing::None)}, 0);
  auto labels = ids.masked_fill(mask == 0, kIgnoreIndex);
  testing::expect_same_training(split, mono, ids, 3, kTolerance, mask, labels);
  EXPECT_GT(client->calls(), 3 * testing::forward_calls(*client) + 3);  // forward each step, and backward
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  auto name = std::get<0>(info.param) + "_" + methods()[std::get<1>(info.param)].name;
  for (auto& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return name;
}

INSTANTIATE_TEST_SUITE_P(Methods, PeftExactnessTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-llama-tied", "tiny-gpt2"),
                                            ::testing::Range(0, 7)),
                         param_name);

// LoRA's update as one autograd node (LoraUpdate in client_runtime/peft/lora.cpp) gives what autograd gives for the
// same expression left to it, in value and in every gradient: with a gradient through the base
// layer and the input, with an input that takes none (the first layer's, under a frozen
// embedding), and with an adapter kept in another dtype than the model.
TEST(LoraNode, MatchesAutogradOfTheExpression) {
  at::manual_seed(5);
  LoraConfig config;
  config.r = 3;
  config.alpha = 6;
  config.init_b_zero = false;
  for (const auto adapter_dtype : {at::kDouble, at::kFloat}) {
    for (const bool input_grad : {true, false}) {
      SCOPED_TRACE(std::string(c10::toString(adapter_dtype)) +
                   (input_grad ? ", input with gradient" : ", input without"));
      auto lora = std::make_shared<LoraAdapterImpl>(7, 4, config);
      lora->to(adapter_dtype);
      const auto opts = at::TensorOptions().dtype(at::kDouble);
      const auto x0 = at::randn({2, 5, 7}, opts), w0 = at::randn({4, 7}, opts), upstream = at::randn({2, 5, 4}, opts);
      auto run = [&](bool fused, at::Tensor* grads) {
        auto x = x0.clone().requires_grad_(input_grad);
        auto w = w0.clone().requires_grad_(true);
        for (auto& p : {lora->lora_A, lora->lora_B}) p.mutable_grad() = at::Tensor();
        auto base = [&](const at::Tensor& in) { return at::linear(in, w); };
        at::Tensor y;
        if (fused) {
          y = lora->forward(x, base);
        } else {
          auto update = at::matmul(at::matmul(x.to(adapter_dtype), lora->lora_A.t()), lora->lora_B.t());
          y = at::add(base(x), update.to(at::kDouble), lora->scaling);
        }
        y.backward(upstream);
        grads[0] = input_grad ? x.grad() : at::Tensor();
        grads[1] = w.grad();
        grads[2] = lora->lora_A.grad().clone();
        grads[3] = lora->lora_B.grad().clone();
        return y.detach();
      };
      at::Tensor fused_grads[4], plain_grads[4];
      const auto fused = run(true, fused_grads), plain = run(false, plain_grads);
      const double tol = adapter_dtype == at::kDouble ? 1e-12 : 1e-6;
      EXPECT_TRUE(at::allclose(fused, plain, tol, tol));
      for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(fused_grads[i].defined(), plain_grads[i].defined()) << "gradient " << i;
        if (!plain_grads[i].defined()) continue;
        EXPECT_GT(plain_grads[i].abs().sum().item<double>(), 0.0) << "gradient " << i;
        EXPECT_TRUE(at::allclose(fused_grads[i], plain_grads[i], tol, tol)) << "gradient " << i;
      }
    }
  }
}

// DoRA's weight norms found through the executor ([DoRA norms on the executor]) equal
// ‖W + s·B·A‖ computed directly from the checkpoint's weights, and its dropout path (the rescaled
// base term on the dropped input, through FORWARD_NO_BIAS) is exact in loss and gradients.
TEST(PeftDora, NormsThroughTheExecutorAndDropoutPathMatchMonolithic) {
  auto served = testing::serve_model("tiny-gpt2");  // Conv1D with biases
  const auto& [dir, checkpoint, executor, client] = served;
  LoraConfig c;
  c.r = 4;
  c.alpha = 8;
  c.dropout = 0.3;
  c.use_dora = true;
  c.target_modules = {"c_attn", "mlp.c_proj"};
  c.init_b_zero = false;
  MethodRun split =
      make_run(*checkpoint, client, {"dora_dropout", [&](torch::nn::Module& m) { return add_lora(m, c); }});
  MethodRun mono =
      make_run(*checkpoint, nullptr, {"dora_dropout", [&](torch::nn::Module& m) { return add_lora(m, c); }});

  int checked = 0;
  for (const auto& item : mono.lm.module->named_modules("", false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    auto dora = base ? std::dynamic_pointer_cast<DoraAdapterImpl>(base->adapter()) : nullptr;
    if (!dora) continue;
    auto split_base = split.lm.module->named_modules("", false)[item.key()];
    auto split_dora =
        std::dynamic_pointer_cast<DoraAdapterImpl>(std::dynamic_pointer_cast<nn::BaseLayerImpl>(split_base)->adapter());
    ASSERT_TRUE(split_dora) << item.key();
    auto direct =
        at::linalg_vector_norm(base->weight.t() + dora->scaling * at::matmul(dora->lora_B, dora->lora_A), 2, {1});
    EXPECT_LT(relative_error(split_dora->weight_norm(), direct), 1e-6) << item.key();
    EXPECT_LT(relative_error(split_dora->lora_magnitude_vector, direct), 1e-6) << item.key();  // PEFT's init
    ++checked;
  }
  EXPECT_EQ(checked, 4);

  auto ids = at::randint(0, 200, {2, 7}, at::kLong);
  at::Tensor losses[2];
  MethodRun* runs[2] = {&split, &mono};
  for (int i = 0; i < 2; ++i) {
    runs[i]->lm.module->train();
    at::manual_seed(99);  // the same dropout masks on both sides
    losses[i] = causal_lm_loss(runs[i]->lm.forward(ids, {}), ids);
    losses[i].backward();
  }
  EXPECT_LT(relative_error(losses[0], losses[1]), kTolerance);
  for (size_t i = 0; i < split.adapter.size(); ++i) {
    EXPECT_LT(relative_error(split.adapter[i].grad(), mono.adapter[i].grad()), kTolerance) << "adapter tensor " << i;
  }
}

// AdaLoRA: split equals monolithic in loss (with the orthogonal regularization), gradients,
// parameters and allocation over steps covering every phase of the schedule: warm-up (step 1,
// importance only), a budgeted allocation (2), the final allocation (3) and the fixed one (4).
TEST(PeftAdaLora, SplitEqualsMonolithicThroughRankAllocation) {
  for (const std::string preset : {"tiny-llama", "tiny-gpt2"}) {
    SCOPED_TRACE(preset);
    auto served = testing::serve_model(preset);
    const auto& [dir, checkpoint, executor, client] = served;
    AdaLoraConfig c;
    c.init_r = 6;
    c.target_r = 2;
    c.target_modules = {"q_proj", "v_proj", "down_proj", "c_attn", "c_fc"};
    c.total_step = 4;
    c.tinit = 1;
    c.tfinal = 1;
    const Method method{"adalora", [&](torch::nn::Module& m) { return add_adalora(m, c); }};
    MethodRun split = make_run(*checkpoint, client, method);
    MethodRun mono = make_run(*checkpoint, nullptr, method);
    AdaLoraAllocator split_allocator(*split.lm.module, c);
    AdaLoraAllocator mono_allocator(*mono.lm.module, c);
    const int64_t layers = static_cast<int64_t>(split.adapter.size() / 3);

    at::manual_seed(5);
    auto ids = at::randint(0, 200, {2, 9}, at::kLong);
    for (int64_t step = 1; step <= 4; ++step) {
      at::Tensor loss[2];
      MethodRun* runs[2] = {&split, &mono};
      for (int i = 0; i < 2; ++i) {
        runs[i]->optimizer->zero_grad();
        loss[i] = causal_lm_loss(runs[i]->lm.forward(ids, {}), ids) +
                  adalora_orthogonal_regularization(*runs[i]->lm.module, c);
        loss[i].backward();
      }
      EXPECT_LT(relative_error(loss[0], loss[1]), kTolerance) << "step " << step;
      for (size_t i = 0; i < split.adapter.size(); ++i) {
        EXPECT_LT(relative_error(split.adapter[i].grad(), mono.adapter[i].grad()), kTolerance)
            << "step " << step << ", adapter tensor " << i;
      }
      split.optimizer->step();
      mono.optimizer->step();
      split_allocator.update_and_allocate(step);
      mono_allocator.update_and_allocate(step);
      for (size_t i = 0; i < split.adapter.size(); ++i) {
        EXPECT_LT(relative_error(split.adapter[i], mono.adapter[i]), kTolerance)
            << "step " << step << ", adapter tensor " << i;
      }
      EXPECT_EQ(split_allocator.config().rank_pattern, mono_allocator.config().rank_pattern) << "step " << step;
      EXPECT_EQ(split_allocator.config().rank_pattern.empty(), step == 1) << "step " << step;
      if (step >= 3) {  // the final allocation keeps exactly the target budget
        int64_t kept = 0;
        for (const auto& [key, keep] : mono_allocator.config().rank_pattern)
          kept += std::count(keep.begin(), keep.end(), true);
        EXPECT_EQ(kept, c.target_r * layers) << "step " << step;
        int64_t zeros = 0;  // masked singular values are zero
        for (size_t i = 1; i < mono.adapter.size(); i += 3) zeros += (mono.adapter[i] == 0).sum().item<int64_t>();
        EXPECT_GE(zeros, c.init_r * layers - kept) << "step " << step;
      }
    }
    EXPECT_EQ(split_allocator.budget_schedule(2).first, int64_t((6 - 2) * layers * 0.125 + 2 * layers));
  }
}

// The model-level hook with no adapter changes nothing, and an adapter's virtual tokens change the
// logits of real tokens only through attention (the output keeps the input's length).
TEST(PeftModelAdapter, PromptTuningKeepsOutputShapeAndRefusesASecondAdapter) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(dir);
  auto lm = open_causal_lm(*checkpoint);
  auto ids = at::randint(0, 200, {1, 6}, at::kLong);
  auto before = lm.forward(ids, {});
  add_prompt_tuning(*lm.module, PromptTuningConfig{3});
  auto after = lm.forward(ids, {});
  EXPECT_EQ(after.sizes(), before.sizes());
  EXPECT_GT((after - before).abs().max().item<double>(), 1e-4);
  try {
    add_prefix_tuning(*lm.module, PrefixTuningConfig{});
    FAIL() << "a second model-level adapter was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("already has a model-level adapter"), std::string::npos) << e.what();
  }
}

TEST(PeftConfigs, RefusalsNameTheField) {
  auto expect_error = [](const std::function<void()>& f, const std::string& field) {
    try {
      f();
      ADD_FAILURE() << "no error for " << field;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + field + "'"), std::string::npos) << e.what();
    }
  };
  LoraConfig lora;
  lora.bias = "all";
  expect_error([&] { lora.validate(); }, "bias");
  lora.bias = "none";
  lora.rank_pattern = {{"q_proj", 0}};
  expect_error([&] { lora.validate(); }, "rank_pattern");
  IA3Config ia3;
  ia3.target_modules = {"k_proj"};
  ia3.feedforward_modules = {"down_proj"};
  expect_error([&] { ia3.validate(); }, "feedforward_modules");
  expect_error([] { PromptTuningConfig{0}.validate(); }, "num_virtual_tokens");
  PrefixTuningConfig prefix;
  prefix.encoder_hidden_size = 8;
  expect_error([&] { prefix.validate(); }, "encoder_hidden_size");
}

// Four clients with four different methods share one executor, their steps interleaved; each
// equals its own monolithic run.
TEST(PeftMixedClients, FourMethodsOnOneExecutorEachExact) {
  auto served = testing::serve_model("tiny-llama");
  const auto& [dir, checkpoint, executor, first_client] = served;
  const auto all = methods();
  const std::vector<int> picks = {5, 0, 3, 2};  // LoRA, IA3, prefix tuning, P-tuning
  std::vector<MethodRun> split, mono;
  std::vector<std::shared_ptr<Client>> clients;
  for (int pick : picks) {
    clients.push_back(clients.empty() ? first_client : testing::connect(*executor, *checkpoint));
    split.push_back(make_run(*checkpoint, clients.back(), all[pick]));
    mono.push_back(make_run(*checkpoint, nullptr, all[pick]));
  }
  at::manual_seed(11);
  auto ids = at::randint(0, 200, {1, 8}, at::kLong);
  for (int step = 0; step < 2; ++step) {
    for (size_t c = 0; c < picks.size(); ++c) {
      for (MethodRun* run : {&split[c], &mono[c]}) {
        run->optimizer->zero_grad();
        causal_lm_loss(run->lm.forward(ids, {}), ids).backward();
        run->optimizer->step();
      }
      for (size_t i = 0; i < split[c].adapter.size(); ++i) {
        EXPECT_LT(relative_error(split[c].adapter[i], mono[c].adapter[i]), kTolerance)
            << all[picks[c]].name << " step " << step << " tensor " << i;
      }
    }
  }
  EXPECT_EQ(executor->stats().errors, 0u);
}

// Adapter files asking for what is not supported are refused with the field's name.
TEST(PeftFiles, RefusalsNameTheField) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(dir);
  const auto adapter = testing::temp_dir("symbiosis-peft-refusals");
  auto expect_refused = [&](const nlohmann::json& config, const std::string& field) {
    std::ofstream(adapter / "adapter_config.json") << config.dump();
    auto lm = open_causal_lm(*checkpoint);
    try {
      load_peft_adapter(*lm.module, adapter);
      ADD_FAILURE() << "accepted " << config.dump();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + field + "'"), std::string::npos) << e.what();
    }
  };
  const nlohmann::json lora = {{"peft_type", "LORA"}, {"r", 4}, {"lora_alpha", 8}, {"target_modules", {"q_proj"}}};
  auto with = [](nlohmann::json j, const std::string& k, const nlohmann::json& v) {
    j[k] = v;
    return j;
  };
  expect_refused(with(lora, "bias", "all"), "bias");
  expect_refused(with(lora, "modules_to_save", {"lm_head"}), "modules_to_save");
  expect_refused(with(lora, "target_modules", ".*q_proj"), "target_modules");
  expect_refused(with(lora, "rank_pattern", {{"q_proj", -1}}), "rank_pattern");
  expect_refused({{"peft_type", "ADALORA"}, {"total_step", 0}}, "total_step");
  expect_refused({{"peft_type", "ADALORA"}, {"total_step", 10}, {"tinit", 6}, {"tfinal", 4}}, "tinit");
  expect_refused({{"peft_type", "ADALORA"}, {"total_step", 10}, {"use_dora", true}}, "use_dora");
  expect_refused({{"peft_type", "BOFT"}}, "peft_type");
  expect_refused({{"peft_type", "IA3"}, {"target_modules", {"k_proj"}}, {"feedforward_modules", {"down_proj"}}},
                 "feedforward_modules");
  expect_refused({{"peft_type", "PREFIX_TUNING"}, {"num_virtual_tokens", 4}, {"token_dim", 64}}, "token_dim");
  expect_refused({{"peft_type", "PROMPT_TUNING"}, {"num_virtual_tokens", 4}, {"num_layers", 7}}, "num_layers");
  expect_refused({{"peft_type", "P_TUNING"}, {"num_virtual_tokens", 0}}, "num_virtual_tokens");
  expect_refused({{"peft_type", "PROMPT_TUNING"}, {"num_virtual_tokens", 4}, {"task_type", "SEQ_CLS"}}, "task_type");
}

// [Fuzzing] (docs/fuzzing.md; inputs in fuzz/regressions/peft_files/): an adapter_model.safetensors
// whose header length or tensor sizes are hostile is refused naming the file and the tensor, before
// anything is allocated for it (a header length that wrapped once asked for 2^64 bytes, a shape of
// 2^50 elements for 4 PB).
TEST(PeftFiles, HostileSafetensorsAreRefusedBeforeAllocating) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(dir);
  const auto adapter = testing::temp_dir("symbiosis-peft-hostile");
  std::ofstream(adapter / "adapter_config.json")
      << nlohmann::json{{"peft_type", "LORA"}, {"r", 2}, {"target_modules", {"q_proj"}}}.dump();
  const std::string file = (adapter / "adapter_model.safetensors").string();
  auto refusal = [&](uint64_t header_len, const std::string& header) {
    std::ofstream out(adapter / "adapter_model.safetensors", std::ios::binary);
    out.write(reinterpret_cast<const char*>(&header_len), 8);
    out << header << std::string(16, '\0');
    out.close();
    auto lm = open_causal_lm(*checkpoint);
    return testing::error_of([&] { load_peft_adapter(*lm.module, adapter); });
  };
  auto message = refusal(~uint64_t{0} - 3, "{}");  // 8 + the length wraps to 4
  EXPECT_NE(message.find("bad safetensors header length"), std::string::npos) << message;
  const std::string huge = R"({"w": {"dtype": "F32", "shape": [1099511627776, 1024], "data_offsets": [0, 16]}})";
  message = refusal(huge.size(), huge);
  EXPECT_NE(message.find(file + ": tensor 'w': shape"), std::string::npos) << message;
  EXPECT_NE(message.find("needs more bytes than the file holds"), std::string::npos) << message;
  const std::string wrapped = R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [18446744073709551615, 15]}})";
  message = refusal(wrapped.size(), wrapped);
  EXPECT_NE(message.find("tensor 'w' has bad data_offsets"), std::string::npos) << message;
  const std::string typed = R"({"w": {"dtype": "F32", "shape": "four", "data_offsets": [0, 16]}})";
  message = refusal(typed.size(), typed);
  EXPECT_NE(message.find(file + ": tensor 'w': needs dtype (a string), shape and data_offsets"), std::string::npos)
      << message;
}

}  // namespace
}  // namespace symbiosis
