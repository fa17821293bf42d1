// [Host decode] (inference/heterogeneous.h): a generation prefilled with one copy of the model and
// decoded with a CPU copy over a cache in host memory equals the all-CPU split generation and the
// monolithic one (the same tokens, sampled with seeds too, and every step's logits), for Llama and
// GPT-2 with a LoRA, across the prefill-to-decode switch of each request while others decode; the
// CPU copy's adapter follows the prefill model's as it is trained; a cache beyond the host capacity
// is refused naming the sizes. On this CPU-only machine the prefill device is the CPU too: the code
// path is the GPU one apart from the device (the cache written per layer as the prefill computes,
// attended over as computed: [Offloaded prefill] in models/kv_cache.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <sstream>

#include "client_runtime/cpu_product.h"
#include "client_runtime/inference/generator.h"
#include "client_runtime/inference/heterogeneous.h"
#include "client_runtime/models/attention.h"
#include "tests/client_runtime/inference/generation_util.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

using testing::add_test_lora;
using testing::expect_same;
using testing::Generated;
using testing::mixed_requests;
using testing::request;

using testing::generate_host_decode;

// A LoRA like add_test_lora's but drawn from another seed: what the mirror must overwrite.
void add_other_lora(CausalLM& lm) {
  at::manual_seed(1234);
  add_lora(*lm.module, testing::test_lora());
}

GeneratorOptions small_options() {
  GeneratorOptions options;
  options.max_sequences = 2;  // five requests: they join while others decode
  options.max_tokens = 24;
  return options;
}

class HostDecodeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HostDecodeTest, EqualsAllCpuSplitAndMonolithic) {
  auto served = testing::serve_model(GetParam());
  ClientOptions decode_options;
  decode_options.tenant = "host-decode";
  decode_options.device = "cpu";
  auto decode_client = testing::connect(*served.executor, *served.checkpoint, decode_options);
  auto prefill_lm = open_causal_lm(*served.checkpoint, served.client);
  auto decode_lm = open_causal_lm(*served.checkpoint, decode_client);
  add_test_lora(prefill_lm);
  add_other_lora(decode_lm);
  const auto heterogeneous = generate_host_decode(prefill_lm, decode_lm, mixed_requests(), small_options());

  auto all_cpu_client = testing::connect(*served.executor, *served.checkpoint);
  auto all_cpu_lm = open_causal_lm(*served.checkpoint, all_cpu_client);
  add_test_lora(all_cpu_lm);
  auto mono_lm = open_causal_lm(*served.checkpoint);
  add_test_lora(mono_lm);
  expect_same(heterogeneous, testing::generate(all_cpu_lm, mixed_requests(), small_options()), "all-CPU split");
  // The prefill model's client made the prefill calls and the CPU copy's the decode calls: the
  // same steps as the all-CPU client's, divided.
  EXPECT_GT(served.client->calls(), 0u);
  EXPECT_GT(decode_client->calls(), served.client->calls());
  EXPECT_EQ(served.client->calls() + decode_client->calls(), all_cpu_client->calls());
  expect_same(heterogeneous, testing::generate(mono_lm, mixed_requests(), small_options()), "monolithic");
  for (const auto& result : heterogeneous.results) EXPECT_EQ(result.finish_reason, FinishReason::kLength);
  EXPECT_EQ(served.executor->stats().errors, 0u);
}

// No executor: both sides monolithic (the CPU copy computes its base layers in-process).
TEST_P(HostDecodeTest, MonolithicBothSidesEqualsMonolithic) {
  const auto checkpoint = Checkpoint::open(testing::make_checkpoint(GetParam()));
  auto prefill_lm = open_causal_lm(*checkpoint), decode_lm = open_causal_lm(*checkpoint),
       mono_lm = open_causal_lm(*checkpoint);
  add_test_lora(prefill_lm);
  add_other_lora(decode_lm);
  add_test_lora(mono_lm);
  expect_same(generate_host_decode(prefill_lm, decode_lm, mixed_requests(), small_options()),
              testing::generate(mono_lm, mixed_requests(), small_options()), "monolithic host decode");
}

// The tenant trains the adapter between steps (the reinforcement-learning loop): the decode side
// generates from the trained adapter, with no copy when it has not changed.
TEST_P(HostDecodeTest, TheDecodeSideFollowsTheTrainedAdapter) {
  const auto checkpoint = Checkpoint::open(testing::make_checkpoint(GetParam()));
  auto prefill_lm = open_causal_lm(*checkpoint), decode_lm = open_causal_lm(*checkpoint);
  add_test_lora(prefill_lm);
  add_test_lora(decode_lm);
  const std::vector<GenerationRequest> requests = {request({5, 9, 33, 2, 7}, 8), request({100, 4, 18}, 6)};
  Generator generator(prefill_lm, decode_lm, small_options());
  const auto before = generator.generate(requests);
  {
    at::NoGradGuard no_grad;  // an optimizer's step, in place
    for (auto& p : prefill_lm.module->parameters()) {
      if (p.requires_grad()) p.add_(at::randn_like(p) * 0.5);
    }
  }
  const auto after = generator.generate(requests);
  const auto reference = testing::generate(prefill_lm, requests, small_options());
  ASSERT_EQ(after.size(), reference.results.size());
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_EQ(after[i].output_ids, reference.results[i].output_ids) << "request " << i;
  EXPECT_NE(before[0].output_ids, after[0].output_ids);  // the step changed what it generates

  AdapterMirror mirror(*prefill_lm.module, *decode_lm.module);
  EXPECT_GT(mirror.parameters(), 0);
  EXPECT_EQ(mirror.refresh(), 0);  // nothing changed since the construction's copy
}

TEST_P(HostDecodeTest, ACacheBeyondTheHostCapacityIsRefusedNamingTheSizes) {
  const auto checkpoint = Checkpoint::open(testing::make_checkpoint(GetParam()));
  auto prefill_lm = open_causal_lm(*checkpoint), decode_lm = open_causal_lm(*checkpoint);
  const auto shape = model_adapter_host(*prefill_lm.module).model_shape();
  const int64_t per_position = KvCache::bytes_per_position(shape, at::kFloat);
  EXPECT_EQ(per_position, 2 * shape.num_layers * shape.num_key_value_heads * shape.head_dim * 4);
  auto options = small_options();  // 2 x 24 positions
  options.host_cache_capacity_bytes = per_position * 2 * 24 - 1;
  const auto refused = testing::error_of([&] { Generator generator(prefill_lm, decode_lm, options); });
  EXPECT_NE(
      refused.find("the KV cache of max_sequences (2) x max_tokens (24) positions needs " +
                   std::to_string(per_position * 48) + " bytes (" + std::to_string(per_position) +
                   " a position), more than host_cache_capacity_bytes (" + std::to_string(per_position * 48 - 1) + ")"),
      std::string::npos)
      << refused;
  // The cache fits; a request longer than the capacity is refused at submit, naming its size, and
  // the others go on.
  options.host_cache_capacity_bytes = per_position * 2 * 24;
  Generator generator(prefill_lm, decode_lm, options);
  const auto too_long = testing::error_of([&] { generator.submit(request(std::vector<int64_t>(40, 3), 9)); });
  EXPECT_NE(too_long.find("prompt_ids (40 tokens) + max_new_tokens (9) + virtual tokens (0) need a KV cache of " +
                          std::to_string(per_position * 49) + " bytes (49 positions x " + std::to_string(per_position) +
                          " bytes), more than host_cache_capacity_bytes (" + std::to_string(per_position * 48) + ")"),
            std::string::npos)
      << too_long;
  const auto results = generator.generate({request({5, 9, 33}, 4)});
  EXPECT_EQ(results[0].output_ids.size(), 4u);
  // The all-CPU generator's cache is in host memory too: the same limit holds.
  options.host_cache_capacity_bytes = 1;
  EXPECT_NE(testing::error_of([&] {
              Generator all_cpu(prefill_lm, options);
            }).find("more than host_cache_capacity_bytes (1)"),
            std::string::npos);
  options.host_cache_capacity_bytes = -1;
  EXPECT_NE(testing::error_of([&] {
              Generator all_cpu(prefill_lm, options);
            }).find("host_cache_capacity_bytes is -1, expected at least 0 (0: no limit)"),
            std::string::npos);
}

TEST_P(HostDecodeTest, ModelsThatDoNotMatchAreRefused) {
  const auto checkpoint = Checkpoint::open(testing::make_checkpoint(GetParam()));
  auto prefill_lm = open_causal_lm(*checkpoint), decode_lm = open_causal_lm(*checkpoint);
  add_test_lora(prefill_lm);
  EXPECT_NE(testing::error_of([&] {
              Generator generator(prefill_lm, decode_lm, small_options());
            }).find("the decode-side model has no trainable parameter "),
            std::string::npos);
  auto bf16_lm = open_causal_lm(*checkpoint, nullptr, {.dtype = at::kBFloat16});
  add_test_lora(bf16_lm);
  EXPECT_NE(testing::error_of([&] {
              Generator generator(prefill_lm, bf16_lm, small_options());
            }).find("open both from one checkpoint in one dtype"),
            std::string::npos);
}

// symbiosis-generate --host-decode, split and monolithic, and --offload-cache print what the all-CPU
// split run prints.
TEST(GenerateCliHostDecode, EqualsThePlainRun) {
  auto served = testing::serve_model("tiny-llama");
  const auto work = testing::temp_dir("symbiosis-generate-host-decode");
  {
    std::ofstream input(work / "requests.jsonl");
    input << R"({"prompt_ids": [5, 9, 33], "max_new_tokens": 4, "logprobs": true})"
          << "\n"
          << R"({"prompt_ids": [100, 4, 18, 3], "temperature": 0.9, "seed": 4})"
          << "\n"
          << R"({"prompt_ids": [1, 2]})"
          << "\n";
  }
  std::map<std::string, std::string> outputs;
  const std::map<std::string, std::string> flags_of = {{"plain", ""},
                                                       {"host-decode", " --host-decode"},
                                                       {"host-decode-monolithic", " --host-decode --monolithic"},
                                                       {"offload-cache", " --offload-cache"}};
  for (const auto& [run, flags] : flags_of) {
    const auto out = work / (run + ".jsonl");
    const int status =
        testing::shell(testing::binary("examples/symbiosis-generate") + " --model '" + served.dir.string() +
                       "' --executor " + served.executor->endpoint() + flags +
                       " --max-sequences 2 --max-new-tokens 6 --input '" + (work / "requests.jsonl").string() +
                       "' > '" + out.string() + "' 2> '" + (work / (run + ".log")).string() + "'");
    EXPECT_EQ(status, 0) << run << ": see " << work;
    std::ifstream in(out);
    std::stringstream text;
    text << in.rdbuf();
    outputs[run] = text.str();
  }
  EXPECT_FALSE(outputs["plain"].empty());
  EXPECT_EQ(outputs["host-decode"], outputs["plain"]);
  EXPECT_EQ(outputs["host-decode-monolithic"], outputs["plain"]);
  EXPECT_EQ(outputs["offload-cache"], outputs["plain"]);
}

// [Offloaded decode] (models/kv_cache.h), the baseline: the cache in host memory and each layer
// staged where the model computes at every decode step. On this CPU-only machine the "GPU" is the
// CPU: the staging, the slots' rows, the write-back of each new token and the masks are the GPU's
// code path, the copies synchronous. Three slots for five requests: requests join while others
// decode, at different lengths (masked) and in slots that are not side by side.
std::string model_name(const std::string& preset);

class OffloadedDecodeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(OffloadedDecodeTest, EqualsThePlainGenerator) {
  auto served = testing::serve_model(GetParam());
  auto lm = open_causal_lm(*served.checkpoint, served.client);
  add_test_lora(lm);
  auto options = small_options();
  options.max_sequences = 3;
  const auto plain = testing::generate(lm, mixed_requests(), options);
  options.offload_cache = true;
  auto log = std::make_shared<testing::LogitsLog>();
  options.logits_observer = [log](uint64_t id, const at::Tensor& row) { (*log)[id].push_back(row.to(at::kFloat)); };
  Generator generator(lm, options);
  ASSERT_TRUE(generator.cache().decode_device().has_value());
  testing::Generated offloaded;
  offloaded.results = generator.generate(mixed_requests());
  for (const auto& [id, rows] : *log) offloaded.logits.push_back(rows);
  expect_same(offloaded, plain, "offloaded cache");
  EXPECT_EQ(generator.cache().free_slots(), 3);
  auto mono_lm = open_causal_lm(*served.checkpoint);
  add_test_lora(mono_lm);
  auto mono_options = small_options();
  mono_options.offload_cache = true;
  expect_same(testing::generate(mono_lm, mixed_requests(), mono_options), plain, "monolithic offloaded cache");
}

INSTANTIATE_TEST_SUITE_P(Models, OffloadedDecodeTest, ::testing::Values("tiny-llama", "tiny-gpt2", "tiny-mistral"),
                         [](const auto& info) { return model_name(info.param); });

// The staging itself: a layer's positions [0, length) of the step's slots, in the step's order, and
// nothing else; a new token written back lands at its sequence's start.
TEST(OffloadedDecode, StagesTheStepsSlotsPrefixesAndWritesNewTokensBack) {
  ModelShape shape;
  shape.num_layers = 3;
  shape.num_key_value_heads = 2;
  shape.head_dim = 4;
  KvCache cache(shape, 4, 8, at::kFloat, at::kCPU, 0, false, at::Device(at::kCPU));
  for (int64_t layer = 0; layer < 3; ++layer) {
    cache.keys(layer).copy_(at::randn_like(cache.keys(layer)));
    cache.values(layer).copy_(at::randn_like(cache.values(layer)));
  }
  for (const std::vector<int64_t>& slots : {std::vector<int64_t>{3, 0}, std::vector<int64_t>{1, 2, 3}}) {
    cache.stage(1, slots, 5);
    const auto [keys, values] = cache.staged(1);
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto row = static_cast<int64_t>(i);
      EXPECT_TRUE(keys[row].narrow(1, 0, 5).equal(cache.keys(1)[slots[i]].narrow(1, 0, 5))) << "slot " << slots[i];
      EXPECT_TRUE(values[row].narrow(1, 0, 5).equal(cache.values(1)[slots[i]].narrow(1, 0, 5))) << "slot " << slots[i];
    }
  }
  const auto new_keys = at::randn({2, 2, 4}), new_values = at::randn({2, 2, 4});
  cache.write_back(2, {{3, 6, 1}, {0, 2, 1}}, new_keys, new_values);
  EXPECT_TRUE(cache.keys(2)[3].select(1, 6).equal(new_keys[0]));
  EXPECT_TRUE(cache.values(2)[0].select(1, 2).equal(new_values[1]));
  EXPECT_NE(testing::error_of([&] {
              KvCache on_gpu(shape, 1, 8, at::kFloat, at::Device(at::kCUDA), 0, false, at::Device(at::kCUDA));
            }).find("an offloaded cache lies in host memory, but the device is cuda"),
            std::string::npos);
}

TEST(OffloadedDecode, IsRefusedWithAHostDecodeModel) {
  const auto checkpoint = Checkpoint::open(testing::make_checkpoint("tiny-llama"));
  auto prefill_lm = open_causal_lm(*checkpoint), decode_lm = open_causal_lm(*checkpoint);
  auto options = small_options();
  options.offload_cache = true;
  EXPECT_NE(testing::error_of([&] {
              Generator generator(prefill_lm, decode_lm, options);
            }).find("offload_cache and a host-decode model are two placements of the cache: choose one"),
            std::string::npos);
}

// [CPU decode attention] (models/attention.h) against LibTorch's attention over the same keys:
// grouped-query heads, sequences at different positions in slots out of order, a sliding window
// and another scale; fp32 to its rounding, bf16 to bf16's.
TEST(CpuDecodeAttention, EqualsLibTorchsAttention) {
  at::manual_seed(3);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const int64_t window : {0, 300}) {
      const int64_t heads = 8, kv_heads = 2, head_dim = 32, tokens = 700;
      const auto keys = at::randn({4, kv_heads, tokens, head_dim}).to(dtype);
      const auto values = at::randn({4, kv_heads, tokens, head_dim}).to(dtype);
      const auto q = at::randn({3, heads, head_dim}).to(dtype);
      const std::vector<int64_t> rows = {2, 0, 3}, positions = {699, 0, 513};
      const double scale = window ? 0.1 : 0.0;
      const auto out = detail::cpu_decode_attention(q, keys, values, rows, positions, window, scale);
      ASSERT_EQ(out.sizes(), q.sizes());
      for (size_t b = 0; b < rows.size(); ++b) {
        const int64_t first = window ? std::max<int64_t>(0, positions[b] - window + 1) : 0,
                      count = positions[b] + 1 - first;
        auto span = [&](const at::Tensor& t) { return t[rows[b]].narrow(1, first, count).unsqueeze(0).to(at::kFloat); };
        const auto expected = detail::attention_over(q[b].unsqueeze(0).unsqueeze(2).to(at::kFloat), span(keys),
                                                     span(values), {}, {.scale = scale})[0]
                                  .squeeze(1);
        const double tolerance = dtype == at::kFloat ? 1e-5 : 1e-2;
        EXPECT_LT(testing::relative_error(out[b].to(at::kFloat), expected), tolerance)
            << c10::toString(dtype) << " window " << window << " sequence " << b;
      }
    }
  }
  EXPECT_FALSE(detail::cpu_decode_attention_supports(at::zeros({1, 4, 32}), at::zeros({1, 2, 8, 32}), {.softcap = 50}));
  EXPECT_FALSE(
      detail::cpu_decode_attention_supports(at::zeros({1, 4, 24}, at::kHalf), at::zeros({1, 2, 8, 24}, at::kHalf), {}));
}

// [CPU decode threads] (models/attention.h): inside a StepThreads LibTorch runs at one thread and a
// WideThreads gives back the step's threads; each puts back what it found; inactive, nothing changes.
TEST(CpuDecodeThreads, AStepRunsAtOneThreadAndItsWideOperationsAtTheStepsThreads) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  {
    const detail::StepThreads step(true);
    EXPECT_EQ(at::get_num_threads(), 1);
    EXPECT_EQ(detail::StepThreads::wide(), 2);
    {
      const detail::WideThreads wide;
      EXPECT_EQ(at::get_num_threads(), 2);
    }
    EXPECT_EQ(at::get_num_threads(), 1);
  }
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(detail::StepThreads::wide(), 0);
  {
    const detail::StepThreads inactive(false);
    const detail::WideThreads wide;
    EXPECT_EQ(at::get_num_threads(), 2);
  }
  at::set_num_threads(threads);
}

// A split model's CPU decode steps run at one thread (what the logits observer sees there: it is
// called inside the step), its prefill steps and a monolithic model's decode steps at all of them;
// the generator leaves the count as it found it.
TEST(CpuDecodeThreads, SplitCpuDecodeStepsRunAtOneThread) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  auto served = testing::serve_model("tiny-llama");
  auto split_lm = open_causal_lm(*served.checkpoint, served.client);
  auto mono_lm = open_causal_lm(*served.checkpoint);
  for (auto* lm : {&split_lm, &mono_lm}) {
    std::vector<int> seen;  // at each token: the prefill's, then the decode steps'
    GeneratorOptions options = small_options();
    options.logits_observer = [&](uint64_t, const at::Tensor&) { seen.push_back(at::get_num_threads()); };
    Generator generator(*lm, options);
    generator.generate({request({5, 9, 33}, 4)});
    ASSERT_EQ(seen.size(), 4u);
    EXPECT_EQ(seen[0], 2);
    for (size_t i = 1; i < seen.size(); ++i) EXPECT_EQ(seen[i], lm == &split_lm ? 1 : 2) << "token " << i;
    EXPECT_EQ(at::get_num_threads(), 2);
  }
  at::set_num_threads(threads);
}

// [CPU decode product] (client_runtime/cpu_product.h) against LibTorch's product in fp32 rounded to
// bf16 once (what its bf16 product computes): a decode step's rows against a weight, AVX-512 or not;
// what it does not take goes to at::linear.
TEST(CpuDecodeProduct, EqualsLibTorchsProductRoundedOnce) {
  at::manual_seed(5);
  const auto weight = at::randn({1000, 96}).to(at::kBFloat16);
  for (const int64_t rows : {1, 3, 16}) {
    const auto x = at::randn({1, rows, 96}).to(at::kBFloat16);
    ASSERT_TRUE(nn::detail::cpu_decode_product_supports(x, weight));
    const auto out = nn::detail::cpu_decode_product(x, weight);
    ASSERT_EQ(out.sizes(), at::IntArrayRef({1, rows, 1000}));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    const auto expected = at::linear(x.to(at::kFloat), weight.to(at::kFloat)).to(at::kBFloat16);
    // The same fp32 sums in another order, rounded once: equal but where a sum lies at a rounding boundary.
    EXPECT_LT(testing::relative_error(out.to(at::kFloat), expected.to(at::kFloat)), 1e-2) << rows << " rows";
    EXPECT_GT(out.eq(expected).to(at::kFloat).mean().item<float>(), 0.99) << rows << " rows";
  }
  EXPECT_FALSE(nn::detail::cpu_decode_product_supports(at::randn({17, 96}).to(at::kBFloat16), weight));
  EXPECT_FALSE(nn::detail::cpu_decode_product_supports(at::randn({1, 96}), weight));
  EXPECT_FALSE(nn::detail::cpu_decode_product_supports(at::randn({1, 48}).to(at::kBFloat16), weight));
  EXPECT_FALSE(nn::detail::cpu_decode_product_supports(at::randn({1, 96}).to(at::kBFloat16).requires_grad_(), weight));
  EXPECT_NE(testing::error_of([&] {
              nn::detail::cpu_decode_product(at::randn({1, 96}), weight);
            }).find("cpu_decode_product takes x [..., in] and a contiguous weight [out, in], both bf16"),
            std::string::npos);
}

std::string model_name(const std::string& preset) {
  auto name = preset.substr(preset.find('-') + 1);
  std::replace_if(
      name.begin(), name.end(), [](char c) { return !std::isalnum(c); }, '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Models, HostDecodeTest, ::testing::Values("tiny-llama", "tiny-gpt2"),
                         [](const auto& info) { return model_name(info.param); });

}  // namespace
}  // namespace symbiosis
