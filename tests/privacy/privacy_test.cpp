// [Noise masking]: a masked tenant computes what the model computes monolithically (fine-tuning:
// logits, loss, every LoRA gradient, the adapter after AdamW steps; generation: the same tokens),
// for Llama and GPT-2 (whose biases the tenant adds itself) over tcp and shm, under each batching
// policy, with banks rotated or kept; what the executor is sent differs from the activations by the configured noise and is
// nearly uncorrelated with them, and no two rows of a call share their noise; bad options are
// refused naming the field.
#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/lora.h"
#include "privacy/noise_mask.h"
#include "tests/client_runtime/inference/generation_util.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

// fp32 masking: x + s·n rounds at the noise's scale, so each unmasked result is off by about the
// noise ratio (4) times fp32's epsilon of its input's RMS; through a model and its gradients (whose
// small entries share a call's scale with its large ones), within 5e-4 (1e-4 to 2e-4 seen).
constexpr double kTolerance = 5e-4;

ClientOptions masked(const std::string& transport, int64_t rotate_after = 0) {
  ClientOptions options;
  options.transport = transport;
  options.privacy.mask = true;
  options.privacy.secret = 20261125;
  options.privacy.rotate_after = rotate_after;
  return options;
}

// A preset's checkpoint, an executor in this process under `policy` and a masked client of it.
testing::ServedModel serve_masked(const std::string& preset, const std::string& transport, const std::string& policy,
                                  int64_t rotate_after = 0) {
  testing::ServedModel served;
  served.dir = testing::make_checkpoint(preset);
  served.checkpoint = Checkpoint::open(served.dir);
  ExecutorOptions options;
  options.batching.policy = parse_batching_policy(policy);
  served.executor = testing::start_executor(served.dir, options);
  served.client = testing::connect(*served.executor, *served.checkpoint, masked(transport, rotate_after));
  return served;
}

// (preset, transport, batching policy)
class MaskedTenantTest : public ::testing::TestWithParam<std::tuple<std::string, std::string, std::string>> {};

TEST_P(MaskedTenantTest, TrainsAsTheMonolithicModelDoes) {
  const auto& [preset, transport, policy] = GetParam();
  auto served = serve_masked(preset, transport, policy);
  ASSERT_EQ(served.client->transport(), transport);
  LoraConfig lora = testing::test_lora();
  auto split = testing::make_training_run(*served.checkpoint, served.client, testing::lora_adapter(lora), {}, 1e-2, 1234);
  auto mono = testing::make_training_run(*served.checkpoint, nullptr, testing::lora_adapter(lora), {}, 1e-2, 1234);
  at::manual_seed(7);
  const auto ids = at::randint(0, 200, {2, 12}, at::kLong);
  testing::expect_same_training(split, mono, ids, 3, kTolerance);
  // Never rotated: one bank a layer (or group) and direction used.
  const auto* mask = served.client->noise_mask();
  EXPECT_EQ(mask->banks_drawn(), mask->banks_held());
  EXPECT_GT(mask->banks_held(), 0);
}

TEST_P(MaskedTenantTest, GeneratesWhatTheMonolithicModelGenerates) {
  const auto& [preset, transport, policy] = GetParam();
  auto served = serve_masked(preset, transport, policy, /*rotate_after=*/3);
  auto split_lm = open_causal_lm(*served.checkpoint, served.client);
  auto mono_lm = open_causal_lm(*served.checkpoint, nullptr);
  testing::add_test_lora(split_lm);
  testing::add_test_lora(mono_lm);
  GeneratorOptions options;
  options.max_sequences = 3;
  options.max_tokens = 24;
  const auto split = testing::generate(split_lm, testing::mixed_requests(), options);
  testing::expect_same(split, testing::generate(mono_lm, testing::mixed_requests(), options), preset + " masked",
                       kTolerance);
  // Rotated every 3 calls: each layer and direction drew several banks.
  const auto* mask = served.client->noise_mask();
  EXPECT_GT(mask->banks_drawn(), 3 * mask->banks_held());
}

std::string test_name(const ::testing::TestParamInfo<MaskedTenantTest::ParamType>& info) {
  return std::get<0>(info.param).substr(5) + "_" + std::get<1>(info.param) + "_" + std::get<2>(info.param);
}

INSTANTIATE_TEST_SUITE_P(Models, MaskedTenantTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-gpt2"), ::testing::Values("tcp", "shm"),
                                            ::testing::Values("opportunistic")),
                         test_name);
INSTANTIATE_TEST_SUITE_P(Policies, MaskedTenantTest,
                         ::testing::Combine(::testing::Values("tiny-llama"), ::testing::Values("shm"),
                                            ::testing::Values("none", "lockstep")),
                         test_name);

// The stronger mode: the tenant computes the banks' effects from its own copy of the base weights
// (effects_checkpoint), so the executor never sees a noise row alone: a masked training run makes
// exactly the calls an unmasked one makes, and equals the monolithic run.
class LocalEffectsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LocalEffectsTest, TrainsAsTheMonolithicModelDoesWithNoCallBeyondAnUnmaskedTenants) {
  const std::string preset = GetParam();
  const auto dir = testing::make_checkpoint(preset);
  const auto checkpoint = Checkpoint::open(dir);
  auto executor = testing::start_executor(dir);
  auto options = masked("shm");
  options.privacy.effects_checkpoint = dir.string();
  auto client = testing::connect(*executor, *checkpoint, options);
  auto plain = testing::connect(*executor, *checkpoint, ClientOptions{.transport = "shm"});
  const LoraConfig lora = testing::test_lora();
  auto split = testing::make_training_run(*checkpoint, client, testing::lora_adapter(lora), {}, 1e-2, 1234);
  auto unmasked = testing::make_training_run(*checkpoint, plain, testing::lora_adapter(lora), {}, 1e-2, 1234);
  auto mono = testing::make_training_run(*checkpoint, nullptr, testing::lora_adapter(lora), {}, 1e-2, 1234);
  auto mono_again = testing::make_training_run(*checkpoint, nullptr, testing::lora_adapter(lora), {}, 1e-2, 1234);
  at::manual_seed(7);
  const auto ids = at::randint(0, 200, {2, 12}, at::kLong);
  testing::expect_same_training(split, mono, ids, 3, kTolerance);
  testing::expect_same_training(unmasked, mono_again, ids, 3, 1e-5);
  EXPECT_EQ(client->calls(), plain->calls());
  EXPECT_GT(client->noise_mask()->banks_held(), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, LocalEffectsTest, ::testing::Values("tiny-llama", "tiny-gpt2"),
                         [](const auto& info) { return info.param.substr(5); });

TEST(LocalEffectsTest, ACheckpointOfAnotherModelIsRefused) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  auto executor = testing::start_executor(dir);
  auto options = masked("tcp");
  options.privacy.effects_checkpoint = testing::make_checkpoint("tiny-gpt2").string();
  const auto error = testing::error_of([&] { testing::connect(*executor, *Checkpoint::open(dir), options); });
  EXPECT_NE(error.find("privacy option effects_checkpoint: "), std::string::npos) << error;
  EXPECT_NE(error.find("holds another model than the executor's"), std::string::npos) << error;
}

// What the executor is sent: here the executor's part is the product with a known weight, and
// every row sent is recorded. The results equal x·Wᵀ + b and g·W; what is sent is the activation
// plus noise of noise_ratio (4) times its norm, and its correlation with the activations stays
// under 0.3 (1/√17 ≈ 0.24 expected).
TEST(NoiseMaskTest, TheExecutorSeesNoiseOfTheConfiguredScaleAndTheResultIsExact) {
  at::manual_seed(3);
  LayerInfo layer;
  layer.id = 4;
  layer.name = "layer";
  layer.in_features = 64;
  layer.out_features = 48;
  layer.bias = true;
  const auto weight = at::randn({48, 64}, at::kDouble).to(at::kFloat);
  const auto bias = at::randn({48}).to(at::kFloat);
  std::vector<at::Tensor> sent;  // the masked calls' inputs, after the bank's own call
  int calls = 0;
  const NoiseMask::Send executor = [&](NoiseMask::Op op, const at::Tensor& x) {
    if (++calls > 1 && op == NoiseMask::Op::kForwardNoBias) sent.push_back(x.clone());
    if (op == NoiseMask::Op::kBackwardInput) return at::mm(x, weight);
    return op == NoiseMask::Op::kForward ? at::addmm(bias, x, weight.t()) : at::mm(x, weight.t());
  };
  PrivacyOptions options;
  options.mask = true;
  options.secret = 5;
  options.bank_rows = 256;
  NoiseMask mask(options);
  std::vector<at::Tensor> inputs;
  for (int i = 0; i < 16; ++i) {
    const auto x = 0.1 * at::randn({32, 64});
    inputs.push_back(x);
    const auto y = mask.forward(layer, x, /*with_bias=*/true, executor);
    EXPECT_LT(testing::relative_error(y, at::addmm(bias, x, weight.t())), 1e-5);
    const auto g = at::randn({32, 48});
    EXPECT_LT(testing::relative_error(mask.backward_input(layer, g, executor), at::mm(g, weight)), 1e-5);
  }
  ASSERT_EQ(sent.size(), inputs.size());
  const auto raw = at::cat(inputs), seen = at::cat(sent);
  const double ratio = (seen - raw).norm().item<double>() / raw.norm().item<double>();
  EXPECT_GT(ratio, 3.6);
  EXPECT_LT(ratio, 4.4);
  const auto a = raw.flatten() - raw.mean(), b = seen.flatten() - seen.mean();
  const double correlation = (a * b).sum().item<double>() / (a.norm() * b.norm()).item<double>();
  EXPECT_LT(std::abs(correlation), 0.3);
  // No two rows of a call share their noise (their difference would be their inputs' difference).
  const auto noise = sent.back() - inputs.back();
  const auto distances = at::cdist(noise, noise) + 1e9 * at::eye(noise.size(0));
  EXPECT_GT(distances.min().item<double>(), 0.1);
  EXPECT_EQ(mask.banks_drawn(), 2);  // one bank forward, one backward, never rotated
}

TEST(NoiseMaskTest, BadOptionsAreRefusedNamingTheField) {
  PrivacyOptions options;
  options.mask = true;
  options.bank_rows = 0;
  EXPECT_NE(testing::error_of([&] { NoiseMask mask(options); }).find("privacy option bank_rows must be at least 1, got 0"),
            std::string::npos);
  options.bank_rows = 8;
  options.noise_ratio = 0;
  ClientOptions client;
  client.privacy = options;
  EXPECT_NE(testing::error_of([&] { client.validate(); }).find("privacy option noise_ratio must be positive"),
            std::string::npos);
  client.privacy.noise_ratio = 1;
  client.privacy.mix = 9;
  EXPECT_NE(testing::error_of([&] { client.validate(); }).find("privacy option mix must be in [1, 8], got 9"),
            std::string::npos);
  client.privacy.mix = 2;
  client.privacy.rotate_after = -2;
  EXPECT_NE(testing::error_of([&] { client.validate(); }).find("rotate_after must be >= 0 (0: never), got -2"),
            std::string::npos);
}

}  // namespace
}  // namespace symbiosis
