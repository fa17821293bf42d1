// Generation (inference/generator.h over models/kv_cache.h): greedy generation with the cache equals
// generation by full recomputation; split generation equals monolithic generation (tokens, sampled
// with seeds, and the logits of every step) under each batching policy while a fine-tuning client
// trains on the same executor; the sample-score-train-sample loop of reinforcement-learning tenants
// equals its monolithic run; greedy generation equals Hugging Face transformers + PEFT `generate`
// for each adapter kind; requests of several adapters in one batch ([Multi-adapter batches]) each
// equal PEFT's generation with their adapter alone; bad requests are refused naming the field and
// the others go on.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <csignal>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <cctype>
#include <map>
#include <sstream>
#include <thread>
#include <torch/cuda.h>

#include "client_runtime/inference/generator.h"
#include "client_runtime/peft/adapter.h"
#include "client_runtime/peft/files.h"
#include "transport/client_transport.h"
#include "tests/client_runtime/inference/generation_util.h"
#include "tests/client_runtime/text/reference_tokenizers.h"
#include "tests/python_reference.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;
using testing::add_test_lora;
using testing::expect_same;
using testing::generate;
using testing::Generated;
using testing::mixed_requests;
using testing::relative_error;
using testing::request;
using testing::test_lora;
constexpr double kTolerance = 1e-5;

// Greedy decoding by running the whole sequence through the model's ordinary forward each step.
std::vector<int64_t> greedy_by_recomputation(const CausalLM& lm, std::vector<int64_t> ids, int64_t new_tokens,
                                             std::vector<at::Tensor>* logits) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < new_tokens; ++i) {
    const auto row = lm.forward(at::tensor(ids, at::kLong).unsqueeze(0), {})[0][-1].to(at::kFloat);
    logits->push_back(row);
    out.push_back(row.argmax().item<int64_t>());
    ids.push_back(out.back());
  }
  return out;
}

class GeneratorTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { checkpoint_ = Checkpoint::open(testing::make_checkpoint(GetParam())); }
  std::shared_ptr<Checkpoint> checkpoint_;
};

TEST_P(GeneratorTest, CachedGreedyEqualsRecomputation) {
  auto lm = open_causal_lm(*checkpoint_);
  add_test_lora(lm);
  std::vector<GenerationRequest> requests = {request({5, 9, 33, 2, 7}, 6), request({100, 4, 18}, 9),
                                             request({1, 2, 3, 4, 5, 6, 7, 8}, 4), request({42}, 7)};
  GeneratorOptions options;
  options.max_sequences = 2;  // the third and fourth join as the first two leave
  options.max_tokens = 32;
  const auto ours = generate(lm, requests, options);
  for (size_t i = 0; i < requests.size(); ++i) {
    std::vector<at::Tensor> logits;
    const auto expected =
        greedy_by_recomputation(lm, requests[i].prompt_ids, requests[i].sampling.max_new_tokens, &logits);
    EXPECT_EQ(ours.results[i].output_ids, expected) << "request " << i;
    EXPECT_EQ(ours.results[i].finish_reason, FinishReason::kLength);
    ASSERT_EQ(ours.logits[i].size(), logits.size());
    for (size_t t = 0; t < logits.size(); ++t) {
      EXPECT_LT(relative_error(ours.logits[i][t], logits[t]), kTolerance) << "request " << i << " token " << t;
      EXPECT_NEAR(ours.results[i].logprobs[t], logits[t].log_softmax(0)[expected[t]].item<float>(), 1e-5);
    }
  }
}

TEST_P(GeneratorTest, TopLogprobsAreEachStepsLikeliestTokens) {
  auto lm = open_causal_lm(*checkpoint_);
  // Rows asking none, 3 and 5 (one of them sampled) in the same steps.
  std::vector<GenerationRequest> requests = {request({5, 9, 33}, 4), request({100, 4}, 5, 0.9, 0, 1.0, 7),
                                             request({42}, 3)};
  requests[1].sampling.top_logprobs = 3;
  requests[2].sampling.top_logprobs = 5;
  std::map<uint64_t, std::vector<at::Tensor>> logits;
  std::map<uint64_t, std::vector<TokenEvent>> events;
  GeneratorOptions options;
  options.logits_observer = [&](uint64_t id, const at::Tensor& row) { logits[id].push_back(row.to(at::kFloat)); };
  Generator generator(lm, options);
  std::vector<uint64_t> ids;
  for (const auto& r : requests) {
    ids.push_back(generator.submit(r, [&](const TokenEvent& e) { events[e.request].push_back(e); }));
  }
  generator.run();
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto k = requests[i].sampling.top_logprobs;
    const auto& mine = events[ids[i]];
    ASSERT_EQ(mine.size(), logits[ids[i]].size()) << "request " << i;
    for (size_t t = 0; t < mine.size(); ++t) {
      const auto log_probs = logits[ids[i]][t].log_softmax(0);
      EXPECT_NEAR(mine[t].logprob, log_probs[mine[t].token].item<float>(), 1e-5);
      ASSERT_EQ(static_cast<int64_t>(mine[t].top_logprobs.size()), k) << "request " << i << " token " << t;
      if (k == 0) continue;
      const auto [values, top] = log_probs.topk(k);
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(mine[t].top_logprobs[j].first, top[j].item<int64_t>()) << "request " << i << " token " << t;
        EXPECT_NEAR(mine[t].top_logprobs[j].second, values[j].item<float>(), 1e-5);
      }
    }
  }
}

TEST_P(GeneratorTest, SampledGenerationRepeatsWithItsSeedAndDiffersWithAnother) {
  auto lm = open_causal_lm(*checkpoint_);
  const std::vector<GenerationRequest> same = {request({5, 9, 33}, 12, 1.5, 0, 1.0, 11)};
  auto other = same;
  other[0].sampling.seed = 12;
  const auto first = generate(lm, same), again = generate(lm, same), differently = generate(lm, other);
  EXPECT_EQ(first.results[0].output_ids, again.results[0].output_ids);
  EXPECT_NE(first.results[0].output_ids, differently.results[0].output_ids);
}

// [Batched sampling] (client_runtime/inference/sampling.h): over 3 000 seeds, each warped row's
// tokens come as often as its warped softmax says, only from its top-k or nucleus, greedy rows
// take the argmax, and a seed's token does not depend on the rows it is drawn beside.
TEST(Sampling, BatchedDrawsFollowEachRowsWarpedDistributionAndItsSeedAlone) {
  const auto logits = at::tensor({0.5f, 2.0f, -1.0f, 1.0f, 0.0f, 1.5f}).repeat({4, 1});
  const auto params = [](double temperature, int64_t top_k, double top_p, uint64_t seed) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.seed = seed;
    return p;
  };
  // Each row's expected frequencies: softmax(logits / t) over the tokens kept.
  const auto expected = [&](double temperature, std::vector<int64_t> kept) {
    const auto kept_ids = at::tensor(kept);
    auto p = at::zeros({6});
    p.index_put_({kept_ids}, (logits[0].index({kept_ids}) / temperature).softmax(0));
    return p;
  };
  const std::vector<at::Tensor> wanted = {expected(1.0, {0, 1, 2, 3, 4, 5}), expected(0.7, {1, 5}),
                                          expected(1.0, {1, 5, 3}),
                                          at::one_hot(at::tensor(int64_t{1}), 6).to(at::kFloat)};
  std::vector<at::Tensor> counts;
  for (int row = 0; row < 4; ++row) counts.push_back(at::zeros({6}));
  const int draws = 3000;
  for (int seed = 0; seed < draws; ++seed) {
    TokenSampler full(params(1.0, 0, 1.0, seed)), top_k(params(0.7, 2, 1.0, seed)), top_p(params(1.0, 0, 0.8, seed)),
        greedy(params(0.0, 0, 1.0, seed));
    const auto tokens = choose_tokens(logits, {&full, &top_k, &top_p, &greedy});
    for (int row = 0; row < 4; ++row) counts[row][tokens[row]] += 1;
    if (seed < 50) {  // the same seed alone draws the same token
      TokenSampler again(params(0.7, 2, 1.0, seed));
      EXPECT_EQ(choose_tokens(logits.narrow(0, 0, 1), {&again})[0], tokens[1]) << "seed " << seed;
    }
  }
  TokenSampler sampled(params(1.0, 0, 1.0, 1));
  const auto nan = at::full({1, 6}, std::numeric_limits<float>::quiet_NaN());
  EXPECT_NE(testing::error_of([&] { choose_tokens(nan, {&sampled}); }).find("sampling row 0: its logits hold NaN"),
            std::string::npos);
  for (int row = 0; row < 4; ++row) {
    const auto frequency = counts[row] / draws;
    EXPECT_TRUE(frequency.masked_select(wanted[row] == 0).eq(0).all().item<bool>())
        << "row " << row << ": " << frequency;
    EXPECT_LT((frequency - wanted[row]).abs().max().item<float>(), 0.03)
        << "row " << row << ": " << frequency << " against " << wanted[row];
  }
}

TEST_P(GeneratorTest, StopTokensEndARequestAndCancelEndsAnother) {
  auto lm = open_causal_lm(*checkpoint_);
  const auto plain = generate(lm, {request({5, 9, 33, 2, 7}, 8)}).results[0].output_ids;
  auto stopping = request({5, 9, 33, 2, 7}, 8);
  stopping.sampling.stop_tokens = {plain[2]};
  Generator generator(lm);
  std::vector<int64_t> stopped, cancelled;
  std::optional<FinishReason> stop_reason, cancel_reason;
  generator.submit(stopping, [&](const TokenEvent& e) {
    if (e.token >= 0) stopped.push_back(e.token);
    if (e.finished) stop_reason = e.finished;
  });
  uint64_t victim = 0;
  victim = generator.submit(request({7, 7, 7}, 50), [&](const TokenEvent& e) {
    if (e.token >= 0) cancelled.push_back(e.token);
    if (e.token >= 0 && cancelled.size() == 3) generator.cancel(victim);
    if (e.finished) cancel_reason = e.finished;
  });
  generator.run();
  const auto first_stop = std::find(plain.begin(), plain.end(), plain[2]) - plain.begin();
  EXPECT_EQ(stopped, std::vector<int64_t>(plain.begin(), plain.begin() + first_stop + 1));
  EXPECT_EQ(stop_reason, FinishReason::kStop);
  EXPECT_EQ(cancel_reason, FinishReason::kCancelled);
  EXPECT_GE(cancelled.size(), 3u);
  EXPECT_LT(cancelled.size(), 50u);
  EXPECT_EQ(generator.running(), 0);
  EXPECT_EQ(generator.cache().free_slots(), generator.cache().sequences());  // every slot given back
}

TEST_P(GeneratorTest, BadRequestsAreRefusedNamingTheFieldAndTheOthersGoOn) {
  auto lm = open_causal_lm(*checkpoint_);
  GeneratorOptions options;
  options.max_tokens = 16;
  options.max_waiting = 3;
  Generator generator(lm, options);
  const int64_t vocab = cached_model(*lm.module).token_embeddings().size(0);
  std::vector<GenerationResult> good(1);
  generator.submit(request({1, 2, 3}, 4), [&](const TokenEvent& e) {
    if (e.token >= 0) good[0].output_ids.push_back(e.token);
  });
  auto refusal = [&](GenerationRequest r) { return testing::error_of([&] { generator.submit(r); }); };
  EXPECT_NE(refusal(request({}, 4)).find("prompt_ids is empty"), std::string::npos);
  EXPECT_NE(refusal(request({1, vocab}, 4))
                .find("prompt_ids[1] is " + std::to_string(vocab) + ", expected a token id in [0, " +
                      std::to_string(vocab) + ")"),
            std::string::npos);
  EXPECT_NE(refusal(request(std::vector<int64_t>(14, 1), 4))
                .find("more than the generator holds per request (max_tokens = 16)"),
            std::string::npos);
  EXPECT_NE(refusal(request({1}, 4, 1.0, 0, 0.0)).find("top_p is 0, expected a value in (0, 1]"), std::string::npos);
  EXPECT_NE(refusal(request({1}, 4, 1.0, 0, 1.5)).find("top_p is 1.5"), std::string::npos);
  EXPECT_NE(refusal(request({1}, 4, -1.0)).find("temperature is -1"), std::string::npos);
  EXPECT_NE(refusal(request({1}, 4, 1.0, -2)).find("top_k is -2, expected >= 0"), std::string::npos);
  auto too_many = request({1}, 4);
  too_many.sampling.top_logprobs = vocab + 1;
  EXPECT_NE(refusal(too_many).find("top_logprobs is " + std::to_string(vocab + 1) + ", expected 0 to the vocabulary's"),
            std::string::npos);
  EXPECT_NE(refusal(request({1}, 0)).find("max_new_tokens is 0, expected at least 1"), std::string::npos);
  auto bad_stop = request({1}, 4);
  bad_stop.sampling.stop_tokens = {-1};
  EXPECT_NE(refusal(bad_stop).find("stop_tokens[0] is -1, expected a token id in [0, "), std::string::npos);
  generator.submit(request({4}, 2));
  generator.submit(request({5}, 2));
  EXPECT_NE(refusal(request({6}, 2)).find("the generator is full: 3 requests wait for a cache slot (max_waiting = 3)"),
            std::string::npos);
  generator.run();
  EXPECT_EQ(good[0].output_ids, generate(lm, {request({1, 2, 3}, 4)}).results[0].output_ids);
  EXPECT_NO_THROW(generator.submit(request({6}, 2)));  // room again
}

TEST_P(GeneratorTest, BadOptionsAreRefusedNamingTheField) {
  auto lm = open_causal_lm(*checkpoint_);
  auto refusal = [&](GeneratorOptions options) { return testing::error_of([&] { Generator generator(lm, options); }); };
  EXPECT_NE(refusal({.max_sequences = 0}).find("max_sequences is 0, expected at least 1"), std::string::npos);
  EXPECT_NE(refusal({.max_tokens = 1}).find("max_tokens is 1, expected at least 2"), std::string::npos);
  EXPECT_NE(refusal({.max_waiting = 0}).find("max_waiting is 0, expected at least 1"), std::string::npos);
  EXPECT_NE(refusal({.max_prefill_tokens = 0}).find("max_prefill_tokens is 0, expected at least 1"), std::string::npos);
  EXPECT_NE(refusal({.capture_warmup = 0}).find("capture_warmup is 0, expected at least 1"), std::string::npos);
}

// [Captured decode]: the fixed-shape decode step a CUDA graph replays (slots and starts read from
// device tensors, attention over the whole cache, masked, the batch padded to its bucket with rows
// that write to the spare slot) computes what the packed decode step computes, for sequences of
// different lengths in slots that are not side by side.
TEST_P(GeneratorTest, FixedShapeDecodeStepEqualsThePackedOne) {
  at::NoGradGuard no_grad;
  auto lm = open_causal_lm(*checkpoint_);
  add_test_lora(lm);
  auto& model = cached_model(*lm.module);
  const auto shape = model_adapter_host(*lm.module).model_shape();
  const std::vector<std::vector<int64_t>> prompts = {{5, 9, 33, 2, 7}, {100, 4, 18}};
  const std::vector<int64_t> slots = {3, 1}, next = {11, 12};
  auto decode_logits = [&](bool fixed) {
    KvCache cache(shape, 4, 16, at::kFloat, at::kCPU, /*spare=*/1);
    std::vector<StepSequence> prefill, decode;
    std::vector<int64_t> ids, starts;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto length = static_cast<int64_t>(prompts[i].size());
      prefill.push_back({slots[i], 0, length});
      decode.push_back({slots[i], length, 1});
      ids.insert(ids.end(), prompts[i].begin(), prompts[i].end());
      starts.push_back(length);
    }
    model.forward_cached(model.embed(at::tensor(ids, at::kLong)).unsqueeze(0), CachedStep(cache, prefill));
    if (!fixed) {
      const auto embeddings = model.embed(at::tensor(next, at::kLong)).unsqueeze(0);
      return model.logits(model.forward_cached(embeddings, CachedStep(cache, decode)))[0];
    }
    // Two padding rows: token 0 into the spare slot at position 0.
    std::vector<int64_t> padded_ids = next, padded_slots = slots;
    padded_ids.insert(padded_ids.end(), 2, 0);
    padded_slots.insert(padded_slots.end(), 2, cache.spare_slot());
    starts.insert(starts.end(), 2, 0);
    const auto step =
        CachedStep::fixed_decode(cache, at::tensor(padded_slots, at::kLong), at::tensor(starts, at::kLong));
    const auto embeddings = model.embed(at::tensor(padded_ids, at::kLong)).unsqueeze(0);
    return model.logits(model.forward_cached(embeddings, step))[0].narrow(0, 0, 2);
  };
  EXPECT_LT(relative_error(decode_logits(true), decode_logits(false)), kTolerance);
}

// "tiny-qwen2" -> "qwen2": a preset's name as a test name.
std::string model_name(const std::string& preset) {
  auto name = preset.substr(preset.find('-') + 1);
  std::replace_if(
      name.begin(), name.end(), [](char c) { return !std::isalnum(c); }, '_');
  return name;
}

// Qwen2 and Mistral attend over sliding windows ([Sliding window] in models/llama.h) that these
// requests outgrow, in prefill and in decode.
INSTANTIATE_TEST_SUITE_P(Models, GeneratorTest,
                         ::testing::Values("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2",
                                           "tiny-gpt2", "tiny-gpt-bigcode", "tiny-phi3", "tiny-phi3-longrope",
                                           "tiny-gpt-neox", "tiny-phi", "tiny-opt", "tiny-opt-projected"),
                         [](const auto& info) { return model_name(info.param); });

// Split equals monolithic under each batching policy, with a fine-tuning client training on the
// same executor all along: the same tokens (sampled with seeds too) and the same logits at every step.
class SplitGenerationTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(SplitGenerationTest, SplitEqualsMonolithicWhileAnotherTenantTrains) {
  const auto& [preset, policy] = GetParam();
  const auto dir = testing::make_checkpoint(preset);
  const auto checkpoint = Checkpoint::open(dir);
  ExecutorOptions executor_options;
  executor_options.batching.policy = parse_batching_policy(policy);
  executor_options.batching.lockstep_timeout = std::chrono::milliseconds(20);
  auto executor = testing::start_executor(dir, executor_options);

  auto run = testing::make_training_run(*checkpoint, testing::connect(*executor, *checkpoint),
                                        testing::lora_adapter(test_lora()), {}, 1e-3, 5);
  testing::BackgroundTraining fine_tuning(run, at::randint(200, {2, 12}, at::kLong));
  const auto [split, mono] =
      testing::generate_split_and_monolithic(*checkpoint, testing::connect(*executor, *checkpoint));
  EXPECT_GT(fine_tuning.stop(), 0);
  expect_same(split, mono, policy);
  EXPECT_EQ(executor->stats().errors, 0u);
  // The runtime set the classes: prefill and decode calls were counted apart from training (a
  // batch is counted just after its replies went out).
  std::map<proto::LatencyClass, uint64_t> requests;
  testing::wait_until(
      [&] {
        const auto stats = request_stats(executor->endpoint(), 10000);
        for (const auto& c : stats.classes()) requests[c.latency_class()] = c.requests();
        return requests[proto::INFERENCE_PREFILL] > 0 && requests[proto::INFERENCE_DECODE] > 0 &&
               requests[proto::FINE_TUNING] > 0;
      },
      std::chrono::seconds(5));
  EXPECT_GT(requests[proto::INFERENCE_PREFILL], 0u);
  EXPECT_GT(requests[proto::INFERENCE_DECODE], 0u);
  EXPECT_GT(requests[proto::FINE_TUNING], 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, SplitGenerationTest,
    ::testing::Combine(::testing::Values("tiny-llama", "tiny-mistral", "tiny-gemma2", "tiny-gpt2", "tiny-gpt-bigcode"),
                       ::testing::Values("none", "lockstep", "opportunistic")),
    [](const auto& info) { return model_name(std::get<0>(info.param)) + "_" + std::get<1>(info.param); });

// [Decode halves]: a split generator whose decode steps run in two halves, the second over a second
// connection to the executor (tenant "NAME/half2"), gives the monolithic tokens and logits while
// requests join and leave (halves of 3 and 2 sequences, then fewer; one sequence runs whole). With
// the cache offloaded, or a monolithic model, it is refused naming why.
TEST(SplitGeneration, DecodeHalvesOverTwoConnectionsGiveTheMonolithicTokens) {
  for (const std::string preset : {"tiny-llama", "tiny-gpt2"}) {
    const auto dir = testing::make_checkpoint(preset);
    const auto checkpoint = Checkpoint::open(dir);
    auto executor = testing::start_executor(dir);
    auto split_lm = open_causal_lm(*checkpoint, testing::connect(*executor, *checkpoint));
    auto mono_lm = open_causal_lm(*checkpoint);
    testing::add_test_lora(split_lm);
    testing::add_test_lora(mono_lm);
    GeneratorOptions options{.max_sequences = 5, .max_tokens = 24};
    const auto mono = generate(mono_lm, mixed_requests(), options);
    options.decode_halves = true;
    {
      const Generator halves(split_lm, options);
      EXPECT_EQ(executor->stats().clients, 2u) << preset;  // the model's connection and the second half's
    }
    expect_same(generate(split_lm, mixed_requests(), options), mono, preset + " in decode halves");
    EXPECT_EQ(executor->stats().errors, 0u);
    auto offloaded = options;
    offloaded.offload_cache = true;
    EXPECT_NE(testing::error_of([&] {
                Generator refused(split_lm, offloaded);
              }).find("decode_halves and offload_cache do not go together"),
              std::string::npos);
    EXPECT_NE(
        testing::error_of([&] { Generator refused(mono_lm, options); }).find("decode_halves: the model is monolithic"),
        std::string::npos);
  }
}

// [Served tied head] (base_executor/base_model.cpp): with --lm-head, the executor serves a head tied
// to the input embeddings from them, as the layer lm_head; a tenant of each family binds it and
// calls it for its logits (one more virtual layer than without), and generates what the monolithic
// model generates. Gemma 2 ties its head by default, and soft-caps the served head's logits; GPT-2
// ties it to wte, OPT to its decoder's embeddings.
TEST(SplitGeneration, ATiedHeadServedFromTheEmbeddingsGivesTheMonolithicTokens) {
  for (const std::string preset : {"tiny-llama-tied", "tiny-gemma2", "tiny-gpt2", "tiny-opt"}) {
    const auto dir = testing::make_checkpoint(preset);
    const auto checkpoint = Checkpoint::open(dir);
    ASSERT_FALSE(checkpoint->contains("lm_head.weight")) << preset;
    ExecutorOptions served;
    served.layers.lm_head = true;
    auto executor = testing::start_executor(dir, served);
    auto plain = testing::start_executor(dir);
    const auto client = testing::connect(*executor, *checkpoint);
    const auto* head = client->find_layer("lm_head");
    ASSERT_NE(head, nullptr) << preset;
    // The head is the embedding table, [vocab, hidden], whatever the family names it.
    std::vector<int64_t> table;
    for (const char* name :
         {"model.embed_tokens.weight", "transformer.wte.weight", "model.decoder.embed_tokens.weight"}) {
      if (checkpoint->contains(name)) table = checkpoint->record(name).shape;
    }
    ASSERT_EQ(table.size(), 2u) << preset;
    EXPECT_EQ(head->in_features, table[1]) << preset;
    EXPECT_EQ(head->out_features, table[0]) << preset;
    EXPECT_EQ(open_causal_lm(*checkpoint, client).virtual_layers,
              open_causal_lm(*checkpoint, testing::connect(*plain, *checkpoint)).virtual_layers + 1)
        << preset;
    const auto [split, mono] = testing::generate_split_and_monolithic(*checkpoint, client);
    expect_same(split, mono, preset);
    EXPECT_EQ(executor->stats().errors, 0u);
  }
}

// [MLP blocks] and [MLP bridges] (base_executor/base_model.h): an executor serving each gated MLP
// whole, as by default (SwiGLU; GeGLU for Gemma 2; Phi-3's gate_up_proj), and each block but the last
// also as a bridge into the next layer's q, k and v (not Gemma 2's, whose norms sit around its MLP),
// gives a decoding tenant whose MLP has no adapter the monolithic tokens and logits in fewer calls:
// one an MLP where it made two, and over TCP, with bridges, one fewer a layer still (over shared
// memory a tenant calls no bridge); a tenant with an adapter
// on its MLP calls the layers as before, as exact. A block's and a bridge's backward are refused,
// naming them.
TEST(SplitGeneration, MlpBlocksAndBridgesGiveTheMonolithicTokensInFewerCalls) {
  for (const std::string preset : {"tiny-llama", "tiny-gemma2", "tiny-phi3", "tiny-qwen2", "tiny-qwen3"}) {
    const auto dir = testing::make_checkpoint(preset);
    const auto checkpoint = Checkpoint::open(dir);
    const bool bridged = preset != "tiny-gemma2";
    auto executor = testing::start_executor(dir);  // blocks and bridges served: the default
    ExecutorOptions no_bridges, no_blocks;
    no_bridges.layers.mlp_bridges = false;
    no_blocks.layers.mlp_blocks = false;
    auto blocks_only = testing::start_executor(dir, no_bridges);
    auto plain = testing::start_executor(dir, no_blocks);
    ClientOptions tcp;  // bridges go over TCP alone
    tcp.transport = "tcp";
    // Generated by a model over `client` (monolithic without one) with `lora`, and the calls it sent.
    auto run = [&](const std::shared_ptr<Client>& client, const LoraConfig& lora) {
      auto lm = client ? open_causal_lm(*checkpoint, client) : open_causal_lm(*checkpoint);
      at::manual_seed(7);
      add_lora(*lm.module, lora);
      GeneratorOptions options;
      options.max_sequences = 3;
      options.max_tokens = 24;
      auto generated = generate(lm, mixed_requests(), options);
      return std::make_pair(std::move(generated), client ? client->calls() : 0);
    };
    for (const auto& [lora, mlp_adapted] :
         {std::make_pair(testing::attention_lora(), false), std::make_pair(test_lora(), true)}) {
      const auto where = preset + (mlp_adapted ? ", adapter on the MLP" : ", adapter on the attention");
      const auto [bridges, bridge_calls] = run(testing::connect(*executor, *checkpoint, tcp), lora);
      const auto [blocks, block_calls] = run(testing::connect(*blocks_only, *checkpoint, tcp), lora);
      const auto [layers, layer_calls] = run(testing::connect(*plain, *checkpoint, tcp), lora);
      const auto [local, local_calls] = run(testing::connect(*executor, *checkpoint), lora);  // shared memory
      const auto mono = run(nullptr, lora).first;
      expect_same(bridges, mono, where);
      expect_same(blocks, mono, where);
      expect_same(layers, mono, where);
      expect_same(local, mono, where);
      EXPECT_EQ(local_calls, block_calls) << where;  // no bridge over shared memory
      if (mlp_adapted) {
        EXPECT_EQ(bridge_calls, layer_calls) << where;
        EXPECT_EQ(block_calls, layer_calls) << where;
      } else {
        EXPECT_LT(block_calls, layer_calls) << where;
        if (bridged) {
          EXPECT_LT(bridge_calls, block_calls) << where;
        } else {
          EXPECT_EQ(bridge_calls, block_calls) << where;
        }
      }
    }
    EXPECT_EQ(executor->stats().errors, 0u) << preset;
    const auto client = testing::connect(*executor, *checkpoint);
    std::vector<const LayerInfo*> blocks, bridges;
    for (const auto& entry : client->groups()) {
      if (entry.activation.empty()) continue;
      (entry.name.find('>') == std::string::npos ? blocks : bridges).push_back(&entry);
    }
    ASSERT_EQ(blocks.size(), 2u) << preset;  // the tiny models' two layers
    EXPECT_EQ(blocks[0]->name, "model.layers.0.mlp") << preset;
    EXPECT_EQ(blocks[0]->activation, preset == "tiny-gemma2" ? "gelu_pytorch_tanh" : "silu") << preset;
    EXPECT_EQ(blocks[0]->in_features, blocks[0]->out_features) << preset;
    ASSERT_EQ(bridges.size(), bridged ? 1u : 0u) << preset;  // into the second layer
    if (bridged) {
      const auto& bridge = *bridges[0];
      EXPECT_EQ(bridge.name, "model.layers.0.mlp>model.layers.1.self_attn") << preset;
      ASSERT_EQ(bridge.members.size(), 2u) << preset;
      EXPECT_EQ(bridge.members[0], blocks[0]->id) << preset;
      int64_t attention = 0;  // the next layer's q, k and v entry's width: [h2 | n2 | q, k and v]
      for (const auto& entries : {client->layers(), client->groups()}) {
        for (const auto& entry : entries) {
          if (entry.id == bridge.members[1]) attention = entry.out_features;
        }
      }
      EXPECT_GT(attention, 0) << preset;
      EXPECT_EQ(bridge.out_features, 2 * bridge.in_features + attention) << preset;
    }
    for (const auto* entry : {blocks[0], bridged ? bridges[0] : blocks[1]}) {
      try {
        client->backward_input(*entry, at::randn({2, entry->out_features}));
        ADD_FAILURE() << preset << ": " << entry->name << "'s backward was not refused";
      } catch (const c10::Error& e) {
        const auto kind = entry->name.find('>') == std::string::npos ? "MLP block" : "MLP bridge";
        EXPECT_NE(std::string(e.what()).find(std::string(kind) + ", which computes FORWARD only"), std::string::npos)
            << e.what();
      }
    }
  }
}

// The loop reinforcement-learning tenants run, in one process: sample from the adapter, score the
// samples, train on the best one, sample again. Split and monolithic give the same second round.
TEST(ReinforcementLoop, SampleScoreTrainSampleEqualsMonolithic) {
  auto served = testing::serve_model("tiny-llama");
  std::vector<Generated> second_rounds;
  for (const auto& client : {served.client, std::shared_ptr<Client>()}) {
    auto run = testing::make_training_run(*served.checkpoint, client, testing::lora_adapter(test_lora()), {}, 5e-2, 21);
    const std::vector<GenerationRequest> prompts = {request({3, 14, 15}, 8, 1.0, 0, 1.0, 1),
                                                    request({3, 14, 15}, 8, 1.0, 0, 1.0, 2)};
    GeneratorOptions options;
    options.max_tokens = 16;
    const auto first = generate(run.lm, prompts, options);
    // Score: the sample with more even tokens wins; one training step on it.
    auto score = [](const GenerationResult& r) {
      return std::count_if(r.output_ids.begin(), r.output_ids.end(), [](int64_t t) { return t % 2 == 0; });
    };
    const auto& best = score(first.results[0]) >= score(first.results[1]) ? first.results[0] : first.results[1];
    std::vector<int64_t> ids = best.prompt_ids;
    ids.insert(ids.end(), best.output_ids.begin(), best.output_ids.end());
    const auto batch = at::tensor(ids, at::kLong).unsqueeze(0);
    run.optimizer->zero_grad();
    causal_lm_loss(run.lm.forward(batch, {}), batch).backward();
    run.lm.settle();
    run.optimizer->step();
    second_rounds.push_back(generate(run.lm, prompts, options));
    // The step changed what the adapter generates from.
    EXPECT_GT(relative_error(second_rounds.back().logits[0][0], first.logits[0][0]), 1e-4);
  }
  expect_same(second_rounds[0], second_rounds[1], "second round");
}

// Greedy generation equals Hugging Face transformers + PEFT, token for token, with an adapter PEFT
// made (loaded here from its files), split and monolithic: always greedy decoding by PEFT's forward
// (what its training computes), and `generate` where PEFT's `generate` agrees with that forward
// (tests/reference/peft_generate.py says where, in these versions, it does not).
class HfGenerateTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

// The prompts the PEFT reference runs generate from, and peft_generate.py's arguments for them.
const std::vector<std::vector<int64_t>> kPeftPrompts = {{5, 9, 33, 2, 7}, {100, 4, 18}, {61}};
constexpr int64_t kPeftNewTokens = 8;

// Writes kPeftPrompts to work/inputs.safetensors.
void write_peft_prompts(const fs::path& work) {
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  for (size_t i = 0; i < kPeftPrompts.size(); ++i) {
    inputs.emplace_back("prompt_" + std::to_string(i), at::tensor(kPeftPrompts[i], at::kLong).to(at::kFloat));
  }
  write_safetensors(work / "inputs.safetensors", inputs);
}

// The arguments of a run on write_peft_prompts' prompts in `work` of `method` (none: the base),
// writing `output` and saving the adapter PEFT makes to `adapter`.
std::vector<std::string> peft_generate_args(const fs::path& checkpoint, const fs::path& work, const fs::path& output,
                                            const std::string& method, const fs::path& adapter) {
  std::vector<std::string> args{
      "--checkpoint", checkpoint.string(), "--inputs",     (work / "inputs.safetensors").string(),
      "--output",     output.string(),     "--new-tokens", std::to_string(kPeftNewTokens)};
  if (method != "none") args.insert(args.end(), {"--method", method, "--adapter", adapter.string()});
  return args;
}

TEST_P(HfGenerateTest, GreedyEqualsTransformersPeftGenerate) {
  const auto& [preset, method] = GetParam();
  const auto work = testing::temp_dir("symbiosis-hf-generate-" + preset + "-" + method);
  const auto& prompts = kPeftPrompts;
  constexpr int64_t kNewTokens = kPeftNewTokens;
  auto served = testing::serve_model(preset);
  write_peft_prompts(work);
  const auto args = peft_generate_args(served.dir, work, work / "hf.safetensors", method, work / "adapter");
  const int status = testing::run_reference("peft_generate.py", args, work / "python.log");
  if (status == 3) GTEST_SKIP() << "transformers/peft not installed for " << SYMBIOSIS_PYTHON;
  ASSERT_EQ(status, 0) << "see " << work / "python.log";
  std::vector<GenerationRequest> requests;
  for (const auto& p : prompts) requests.push_back(request(p, kNewTokens));
  for (const auto& client : {served.client, std::shared_ptr<Client>()}) {
    auto lm = open_causal_lm(*served.checkpoint, client);
    if (method != "none") load_peft_adapter(*lm.module, work / "adapter");
    const auto ours = generate(lm, requests);
    // PEFT's generate paths that agree with its forward for this method.
    std::vector<std::string> references = {"forward"};
    if (method == "none" || method == "lora" || method == "ia3") references.push_back("generate");
    if (method != "prefix_tuning") references.push_back("generate_nocache");
    for (size_t i = 0; i < prompts.size(); ++i) {
      for (const auto& reference : references) {
        const auto theirs =
            testing::read_safetensors_f32(work / "hf.safetensors", reference + "_" + std::to_string(i)).to(at::kLong);
        EXPECT_EQ(ours.results[i].output_ids,
                  std::vector<int64_t>(theirs.data_ptr<int64_t>(), theirs.data_ptr<int64_t>() + theirs.numel()))
            << (client ? "split" : "monolithic") << ", prompt " << i << ", PEFT's " << reference;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, HfGenerateTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-gpt2", "tiny-gpt-bigcode"),
                                            ::testing::Values("lora", "ia3", "prompt_tuning", "prefix_tuning")),
                         [](const auto& info) {
                           return model_name(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                         });

// [Llama family]: Qwen2, Mistral and Gemma 2, the base model ("none") and with a LoRA; prompts plus
// new tokens outgrow their sliding windows (5, 4 and 4 tokens), so transformers' sliding-window cache
// is held to ours, and Gemma 2's soft caps hold in the cached decode.
INSTANTIATE_TEST_SUITE_P(
    LlamaFamily, HfGenerateTest,
    ::testing::Combine(::testing::Values("tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2"),
                       ::testing::Values("none", "lora")),
    [](const auto& info) { return model_name(std::get<0>(info.param)) + "_" + std::get<1>(info.param); });

// [Phi-3] (its fused layers, partial rotary and a window of 5 that prompts and new tokens outgrow) and
// the [GPT-NeoX family] (GPT-NeoX, Phi, OPT's learned positions): the base model, LoRA on each one's
// attention and MLP, IA3 (PEFT's own targets, GPT-NeoX's fused query_key_value among them; Phi-3 has
// none in PEFT) and prefix tuning through the cache.
INSTANTIATE_TEST_SUITE_P(NewFamilies, HfGenerateTest,
                         ::testing::Combine(::testing::Values("tiny-phi3", "tiny-phi3-longrope", "tiny-gpt-neox",
                                                              "tiny-phi", "tiny-opt", "tiny-opt-projected"),
                                            ::testing::Values("none", "lora", "ia3", "prefix_tuning")),
                         [](const auto& info) {
                           return model_name(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                         });

// [Multi-adapter batches]: requests of two PEFT-made LoRA adapters of different ranks and targets
// (X: r 4 on the attention; Y: rsLoRA over every linear layer with rank and alpha patterns) and of
// the base model, in one generator of 4 sequences, so that the three kinds share prefill and decode
// steps: each adapter request's greedy tokens equal transformers + PEFT `generate` with its adapter
// alone, and every request's tokens and logits equal our generator built with that adapter alone
// (or none: the base, whose forward hf_reference_test holds to transformers'); split and
// monolithic. The same generator built with X as its own adapter serves X to requests that name
// none beside Y's.
class MultiAdapterTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MultiAdapterTest, EachRequestEqualsItsAdapterAloneInPeftAndInOurGenerator) {
  const auto& preset = GetParam();
  const auto work = testing::temp_dir("symbiosis-multi-adapter-" + preset);
  const auto& prompts = kPeftPrompts;
  constexpr int64_t kNewTokens = kPeftNewTokens;
  auto served = testing::serve_model(preset);
  write_peft_prompts(work);
  // The adapters ("": the base), PEFT's method for each; PEFT makes the adapters and gives their tokens.
  const std::vector<std::pair<std::string, std::string>> kinds = {
      {"x", "lora"}, {"y", "lora_rslora_patterns"}, {"", "none"}};
  std::map<std::string, std::vector<std::vector<int64_t>>> peft_tokens;
  std::vector<std::future<int>> runs;  // both at once
  const auto output = [&](const std::string& name) { return work / ("hf-" + name); };
  for (size_t k = 0; k < 2; ++k) {
    const auto& [name, method] = kinds[k];
    const auto args = peft_generate_args(served.dir, work, output(name).string() + ".safetensors", method, work / name);
    const auto log = output(name).string() + ".log";
    runs.push_back(
        std::async(std::launch::async, [args, log] { return testing::run_reference("peft_generate.py", args, log); }));
  }
  for (size_t k = 0; k < runs.size(); ++k) {
    const auto& name = kinds[k].first;
    const int status = runs[k].get();
    if (status == 3) GTEST_SKIP() << "transformers/peft not installed for " << SYMBIOSIS_PYTHON;
    ASSERT_EQ(status, 0) << "see " << output(name).string() << ".log";
    const auto out = output(name).string() + ".safetensors";
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto t = testing::read_safetensors_f32(out, "generate_" + std::to_string(i)).to(at::kLong);
      peft_tokens[name].emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
    }
  }
  // Every prompt with every adapter, interleaved: more requests than sequences, so they join and
  // leave batches of mixed adapters.
  std::vector<GenerationRequest> requests;
  for (const auto& p : prompts) {
    for (const auto& [name, method] : kinds) {
      requests.push_back(request(p, kNewTokens));
      requests.back().adapter = name;
    }
  }
  GeneratorOptions options;
  options.max_sequences = 4;
  options.max_tokens = 24;
  options.max_lora_rank = 8;
  for (const auto& client : {served.client, std::shared_ptr<Client>()}) {
    const std::string where = client ? "split" : "monolithic";
    auto lm = open_causal_lm(*served.checkpoint, client);
    auto log = std::make_shared<testing::LogitsLog>();
    auto logged = options;
    // [Decode halves] for one of the models: each half's rows take their own adapters.
    logged.decode_halves = client && preset == "tiny-gpt2";
    logged.logits_observer = [log](uint64_t id, const at::Tensor& row) { (*log)[id].push_back(row.to(at::kFloat)); };
    Generator generator(lm, logged);
    generator.load_adapter("x", work / "x");
    generator.load_adapter("y", work / "y");
    EXPECT_EQ(generator.adapters(), (std::vector<std::string>{"x", "y"}));
    testing::Generated mixed;
    mixed.results = generator.generate(requests);
    for (const auto& [id, rows] : *log) mixed.logits.push_back(rows);
    // Each adapter alone: PEFT, and our generator with it as the model's own.
    for (size_t k = 0; k < kinds.size(); ++k) {
      const auto& name = kinds[k].first;
      auto alone_lm = open_causal_lm(*served.checkpoint, client);
      if (!name.empty()) load_peft_adapter(*alone_lm.module, work / name);
      std::vector<GenerationRequest> alone_requests;
      testing::Generated picked;
      for (size_t i = 0; i < prompts.size(); ++i) {
        const auto r = i * kinds.size() + k;
        alone_requests.push_back(requests[r]);
        alone_requests.back().adapter.clear();
        picked.results.push_back(mixed.results[r]);
        picked.logits.push_back(mixed.logits[r]);
        if (name.empty()) continue;
        EXPECT_EQ(mixed.results[r].output_ids, peft_tokens[name][i])
            << where << ", adapter '" << name << "', prompt " << i << ", against PEFT's generate";
      }
      expect_same(picked, generate(alone_lm, alone_requests, options), where + ", adapter '" + name + "' alone");
    }
    EXPECT_EQ(generator.cache().free_slots(), generator.cache().sequences());
  }
  // X as the model's own adapter, Y loaded beside it: requests naming none get X.
  auto own_lm = open_causal_lm(*served.checkpoint);
  load_peft_adapter(*own_lm.module, work / "x");
  const auto own_state = lora_state(*own_lm.module).size();
  Generator generator(own_lm, options);
  generator.load_adapter("y", work / "y");
  std::vector<GenerationRequest> own_requests;
  for (const auto& p : prompts) {
    for (const std::string name : {"", "y"}) {
      own_requests.push_back(request(p, kNewTokens));
      own_requests.back().adapter = name;
    }
  }
  const auto results = generator.generate(own_requests);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(results[2 * i].output_ids, peft_tokens["x"][i]) << "own adapter x, prompt " << i;
    EXPECT_EQ(results[2 * i + 1].output_ids, peft_tokens["y"][i]) << "y beside own adapter x, prompt " << i;
  }
  // Between steps the model computes as it did (x applied): a tenant may train x meanwhile.
  {
    at::NoGradGuard no_grad;
    auto x_lm = open_causal_lm(*served.checkpoint);
    load_peft_adapter(*x_lm.module, work / "x");
    const auto ids = at::tensor(prompts[0], at::kLong).unsqueeze(0);
    EXPECT_LT(relative_error(own_lm.forward(ids, {}), x_lm.forward(ids, {})), 1e-6);
  }
  // Unloading y gives the layers their own adapter back: the generator goes on as one of x.
  generator.unload_adapter("y");
  const auto after = generator.generate({request(prompts[0], kNewTokens)});
  EXPECT_EQ(after[0].output_ids, peft_tokens["x"][0]);
  EXPECT_EQ(lora_state(*own_lm.module).size(), own_state);
}

INSTANTIATE_TEST_SUITE_P(Models, MultiAdapterTest, ::testing::Values("tiny-llama", "tiny-gpt2"),
                         [](const auto& info) { return model_name(info.param); });

// [Multi-adapter batches]: what load_adapter, unload_adapter and submit refuse, naming what is
// wrong; an unloaded adapter's requests finish on it, and its slot is free after them.
TEST(MultiAdapter, BadAdaptersAndNamesAreRefusedAndUnloadingWaitsForItsRequests) {
  const auto work = testing::temp_dir("symbiosis-multi-adapter-refusals");
  auto checkpoint = Checkpoint::open(testing::make_checkpoint("tiny-llama"));
  auto gpt2 = Checkpoint::open(testing::make_checkpoint("tiny-gpt2"));
  // Adapters made here: r 4 on q_proj and v_proj, and GPT-2's c_attn.
  auto save = [&](const Checkpoint& c, LoraConfig config, const std::string& name) {
    auto lm = open_causal_lm(c);
    at::manual_seed(3);
    config.init_b_zero = false;
    add_lora(*lm.module, config);
    save_lora(*lm.module, config, work / name);
    return work / name;
  };
  LoraConfig attention;
  attention.r = 4;
  attention.target_modules = {"q_proj", "v_proj"};
  const auto good = save(*checkpoint, attention, "good");
  LoraConfig c_attn;
  c_attn.target_modules = {"c_attn"};
  const auto other_model = save(*gpt2, c_attn, "gpt2");
  // A copy of `good` with its config edited.
  auto edited = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const auto dir = work / name;
    fs::create_directories(dir);
    fs::copy_file(good / "adapter_model.safetensors", dir / "adapter_model.safetensors",
                  fs::copy_options::overwrite_existing);
    nlohmann::json config;
    std::ifstream(good / "adapter_config.json") >> config;
    edit(config);
    std::ofstream(dir / "adapter_config.json") << config.dump();
    return dir;
  };
  const auto ia3 = edited("ia3", [](auto& j) { j["peft_type"] = "IA3"; });
  const auto dora = edited("dora", [](auto& j) { j["use_dora"] = true; });
  const auto wide = edited("wide", [](auto& j) { j["r"] = 8; });  // tensors of rank 4: shapes differ

  auto lm = open_causal_lm(*checkpoint);
  auto refusal = [&](GeneratorOptions options) { return testing::error_of([&] { Generator generator(lm, options); }); };
  EXPECT_NE(refusal({.max_loras = -1}).find("max_loras is -1, expected at least 0"), std::string::npos);
  EXPECT_NE(refusal({.max_lora_rank = 0}).find("max_lora_rank is 0, expected 1 to 512"), std::string::npos);
  GeneratorOptions options;
  options.max_loras = 1;
  options.max_lora_rank = 4;
  Generator generator(lm, options);
  auto load = [&](const std::string& name, const fs::path& dir) {
    return testing::error_of([&] { generator.load_adapter(name, dir); });
  };
  EXPECT_NE(load("a", ia3).find("field 'peft_type' is 'IA3'; a multi-adapter generator serves LORA adapters only"),
            std::string::npos);
  EXPECT_NE(load("a", dora).find("field 'use_dora' is true"), std::string::npos);
  const auto foreign = load("a", other_model);
  EXPECT_NE(foreign.find("target_modules (c_attn) matched no base layer of the model (llama)"), std::string::npos)
      << foreign;
  EXPECT_NE(load("a", wide).find("has rank 8, more than the generator's max_lora_rank (4)"), std::string::npos);
  EXPECT_NE(load("", good).find("the name is empty"), std::string::npos);
  EXPECT_TRUE(generator.adapters().empty());
  Generator wider(lm, {.max_lora_rank = 8});
  const auto shapes = testing::error_of([&] { wider.load_adapter("a", wide); });
  EXPECT_NE(shapes.find("lora_A.weight' has shape [4, "), std::string::npos) << shapes;
  EXPECT_NE(shapes.find("expected [8, "), std::string::npos) << shapes;

  generator.load_adapter("a", good);
  EXPECT_NE(load("a", good).find("an adapter named 'a' is loaded already"), std::string::npos);
  EXPECT_NE(load("b", good).find("the generator holds max_loras (1) adapters already (1 loaded: a)"),
            std::string::npos);
  auto named = [](std::string adapter) {
    auto r = request({5, 9, 33}, 6);
    r.adapter = std::move(adapter);
    return r;
  };
  EXPECT_NE(testing::error_of([&] {
              generator.submit(named("b"));
            }).find("adapter is 'b', which is not loaded; loaded adapters: a"),
            std::string::npos);
  // Unloaded with a request waiting: the request runs on it; the name is gone at once.
  std::vector<int64_t> tokens;
  generator.submit(named("a"), [&](const TokenEvent& e) {
    if (e.token >= 0) tokens.push_back(e.token);
  });
  generator.unload_adapter("a");
  EXPECT_TRUE(generator.adapters().empty());
  EXPECT_NE(testing::error_of([&] { generator.submit(named("a")); }).find("loaded adapters: none"), std::string::npos);
  EXPECT_NE(testing::error_of([&] { generator.unload_adapter("a"); }).find("'a' is not loaded"), std::string::npos);
  EXPECT_NE(load("b", good).find("1 unloaded, finishing their requests"), std::string::npos);
  generator.run();
  auto alone = open_causal_lm(*checkpoint);
  load_peft_adapter(*alone.module, good);
  EXPECT_EQ(tokens, generate(alone, {request({5, 9, 33}, 6)}).results[0].output_ids);
  EXPECT_NE(tokens, generate(lm, {request({5, 9, 33}, 6)}).results[0].output_ids);  // the adapter changes them
  generator.step();  // the boundary after its last request frees the slot
  EXPECT_EQ(load("b", good), "(no error)");
  // A model whose own adapter is not LoRA cannot tell rows apart.
  auto ia3_lm = open_causal_lm(*checkpoint);
  add_ia3(*ia3_lm.module, IA3Config{});
  Generator ia3_generator(ia3_lm);
  EXPECT_NE(testing::error_of([&] {
              ia3_generator.load_adapter("a", good);
            }).find("this generator's model cannot serve several adapters"),
            std::string::npos);
}

// [Multi-adapter batches] from memory: an adapter's files' contents handed over (as symbiosis-tinker's
// runs hand over the sampler weights they just saved) generate what the folder generates, and
// contents that are wrong are refused as the files would be, naming the folder.
TEST(MultiAdapter, ContentsInMemoryServeAsTheirFolderAndAreCheckedAlike) {
  const auto work = testing::temp_dir("symbiosis-multi-adapter-contents");
  auto checkpoint = Checkpoint::open(testing::make_checkpoint("tiny-llama"));
  auto lm = open_causal_lm(*checkpoint);
  LoraConfig config;
  config.r = 4;
  config.target_modules = {"q_proj", "v_proj"};
  config.init_b_zero = false;
  {
    auto trained = open_causal_lm(*checkpoint);
    at::manual_seed(5);
    add_lora(*trained.module, config);
    save_lora(*trained.module, config, work / "saved");
  }
  std::stringstream config_json;
  config_json << std::ifstream(work / "saved" / "adapter_config.json").rdbuf();
  const AdapterContents contents{work / "saved", config_json.str(), peft::read_tensors(work / "saved")};
  GeneratorOptions options;
  options.max_loras = 2;
  options.max_lora_rank = 4;
  Generator generator(lm, options);
  generator.load_adapter("file", work / "saved");
  generator.load_adapter("memory", contents);
  auto named = [](std::string adapter) {
    auto r = request({5, 9, 33}, 6);
    r.adapter = std::move(adapter);
    return r;
  };
  const auto results = generator.generate({named("file"), named("memory"), named("")});
  EXPECT_EQ(results[1].output_ids, results[0].output_ids);
  EXPECT_EQ(results[1].logprobs, results[0].logprobs);
  EXPECT_NE(results[2].output_ids, results[0].output_ids);  // the adapter changes them
  generator.unload_adapter("file");
  generator.step();
  auto refusal = [&](AdapterContents bad) { return testing::error_of([&] { generator.load_adapter("bad", bad); }); };
  auto wrong_shape = contents;
  wrong_shape.tensors.begin()->second = at::zeros({3, 3});
  const auto shape = refusal(wrong_shape);
  EXPECT_NE(shape.find((work / "saved" / "adapter_model.safetensors").string()), std::string::npos) << shape;
  EXPECT_NE(shape.find("has shape [3, 3], expected"), std::string::npos) << shape;
  auto ia3 = contents;
  ia3.config_json = R"({"peft_type": "IA3"})";
  EXPECT_NE(refusal(ia3).find("field 'peft_type' is 'IA3'; a multi-adapter generator serves LORA adapters only"),
            std::string::npos);
  auto not_json = contents;
  not_json.config_json = "{";
  EXPECT_NE(refusal(not_json).find("bad JSON in"), std::string::npos);
  EXPECT_EQ(generator.adapters(), std::vector<std::string>{"memory"});
}

// symbiosis-generate, split and monolithic, on JSON Lines with a request that is refused: the same
// lines, the refusal naming the line's field, the other requests answered.
TEST(GenerateCli, SplitEqualsMonolithicAndABadLineIsRefusedAlone) {
  auto served = testing::serve_model("tiny-gpt2");
  const auto work = testing::temp_dir("symbiosis-generate-cli");
  {
    std::ofstream input(work / "requests.jsonl");
    input << R"({"prompt_ids": [5, 9, 33], "max_new_tokens": 4, "logprobs": true})"
          << "\n"
          << R"({"prompt_ids": [7, 7], "top_p": 2.0})"
          << "\n"
          << R"({"prompt_ids": "seven"})"
          << "\n"
          << R"({"prompt_ids": [100, 4, 18, 3], "temperature": 0.9, "seed": 4})"
          << "\n"
          << R"({"prompt_ids": [1, 2], "stop_token_ids": ["eos"]})"
          << "\n"
          << R"({"prompt_ids": [1, 2], "max_tokens": 3})"
          << "\n";
  }
  std::map<std::string, std::map<int64_t, nlohmann::json>> lines;  // by run, by index
  for (const std::string run : {"split", "monolithic"}) {
    const auto out = work / (run + ".jsonl");
    const int status =
        testing::shell(testing::binary("examples/symbiosis-generate") + " --model '" + served.dir.string() +
                       "' --executor " + served.executor->endpoint() + (run == "monolithic" ? " --monolithic" : "") +
                       " --max-new-tokens 6 --input '" + (work / "requests.jsonl").string() + "' > '" + out.string() +
                       "' 2> '" + (work / (run + ".log")).string() + "'");
    EXPECT_EQ(status, 1) << run << ": a refused line makes the exit status 1; see " << work;
    std::ifstream in(out);
    for (std::string text; std::getline(in, text);) {
      const auto line = nlohmann::json::parse(text);
      lines[run][line.at("index").get<int64_t>()] = line;
    }
  }
  ASSERT_EQ(lines["split"].size(), 6u);
  EXPECT_EQ(lines["split"], lines["monolithic"]);
  EXPECT_EQ(lines["split"][1]["output_ids"].size(), 4u);
  EXPECT_EQ(lines["split"][1]["logprobs"].size(), 4u);
  EXPECT_EQ(lines["split"][1]["finish_reason"], "length");
  EXPECT_NE(lines["split"][2]["error"].get<std::string>().find("top_p is 2, expected a value in (0, 1]"),
            std::string::npos);
  EXPECT_NE(lines["split"][3]["error"].get<std::string>().find(
                "field 'prompt_ids' is \"seven\", expected a list of integer token ids"),
            std::string::npos);
  EXPECT_EQ(lines["split"][4]["output_ids"].size(), 6u);
  EXPECT_NE(lines["split"][5]["error"].get<std::string>().find(
                "field 'stop_token_ids' is [\"eos\"], expected a list of integer token ids"),
            std::string::npos);
  EXPECT_NE(
      lines["split"][6]["error"].get<std::string>().find("field 'max_tokens' is unknown, expected only prompt_ids"),
      std::string::npos);
}

// [Stop strings] through symbiosis-generate (a tiny Llama with a SentencePiece tokenizer): a stop
// string taken from a reply's text ends the same request with finish_reason "stop", its text the
// reply's up to the stop string, its tokens a prefix of the reply's; --prompt streams the same text;
// a stop that is not text is refused naming the field.
TEST(GenerateCli, AStopStringEndsTheRequestBeforeItsText) {
  std::string why;
  const auto* reference = testing::reference_tokenizers(why);
  if (!reference) GTEST_SKIP() << why;
  const auto work = testing::temp_dir("symbiosis-generate-stop");
  const auto model =
      testing::with_tokenizer(*reference, "spm_unigram", testing::make_checkpoint("tiny-llama"), work / "model");
  const std::string generate = testing::binary("examples/symbiosis-generate") + " --monolithic --model " +
                               model.string() + " --max-new-tokens 40 --stop-token-ids ''";
  auto reply_to = [&](const nlohmann::json& request, const std::string& name, int status) {
    std::ofstream(work / (name + ".jsonl")) << request.dump() << "\n";
    EXPECT_EQ(testing::shell(generate + " --input " + (work / (name + ".jsonl")).string() + " > " +
                             (work / (name + ".out")).string()),
              status)
        << name;
    std::ifstream in(work / (name + ".out"));
    std::string line;
    std::getline(in, line);
    return nlohmann::json::parse(line);
  };
  const auto whole = reply_to({{"prompt", "hello world"}}, "whole", 0);
  const std::string text = whole.at("text");
  ASSERT_GE(text.size(), 6u) << whole.dump();
  size_t begin = text.size() / 2, end = begin + 2;
  while ((static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) ++begin;
  while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
  const std::string stop = text.substr(begin, end - begin);

  const auto stopped = reply_to({{"prompt", "hello world"}, {"stop", stop}}, "stopped", 0);
  EXPECT_EQ(stopped.at("finish_reason"), "stop") << stopped.dump();
  EXPECT_EQ(stopped.at("text"), text.substr(0, text.find(stop))) << "stop " << nlohmann::json(stop).dump();
  const auto ids = stopped.at("output_ids").get<std::vector<int64_t>>(),
             all = whole.at("output_ids").get<std::vector<int64_t>>();
  ASSERT_LT(ids.size(), all.size());
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), all.begin()));

  const auto streamed = work / "streamed.txt";
  ASSERT_EQ(testing::shell(generate + " --prompt 'hello world' --stop '" + stop + "' > " + streamed.string()), 0);
  std::ifstream streamed_in(streamed);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(streamed_in), {}), stopped.at("text").get<std::string>() + "\n");

  const auto bad = reply_to({{"prompt", "hello world"}, {"stop", 5}}, "bad", 1);
  EXPECT_NE(bad.at("error").get<std::string>().find("field 'stop' is 5, expected a string or a list of strings"),
            std::string::npos)
      << bad.dump();
}

// A tool given --device cuda:0 on a host without a GPU says so, naming the flag (as the executor
// does), not with the driver's message.
TEST(GenerateCli, ACudaDeviceOnAHostWithoutAGpuIsRefusedNamingTheFlag) {
  if (torch::cuda::device_count() > 0) GTEST_SKIP() << "this host has a CUDA GPU";
  const auto model = testing::make_checkpoint("tiny-llama");
  const auto work = testing::temp_dir("symbiosis-no-gpu");
  for (const std::string tool : {"symbiosis-generate --prompt hi", "symbiosis-finetune --train /dev/null"}) {
    const auto err = work / "err.log";
    const int status =
        testing::shell(testing::binary("examples/" + tool.substr(0, tool.find(' '))) + tool.substr(tool.find(' ')) +
                       " --monolithic --device cuda:0 --model " + model.string() + " > /dev/null 2> " + err.string());
    EXPECT_EQ(status, 2) << tool;
    std::ifstream in(err);
    const std::string said(std::istreambuf_iterator<char>(in), {});
    EXPECT_NE(said.find("--device cuda:0: no CUDA GPU is available here"), std::string::npos) << tool << ": " << said;
  }
}

// [Interrupted generation] (examples/generate.cpp): a SIGINT to symbiosis-generate ends every
// request with what it produced so far: one line each, finish_reason "cancelled", its output a
// prefix of what it would have produced, and the exit status 130.
TEST(GenerateCli, ASignalAnswersEveryRequestWithWhatItHas) {
  const auto model = testing::make_checkpoint("tiny-llama");
  const auto work = testing::temp_dir("symbiosis-generate-signal");
  {
    std::ofstream input(work / "requests.jsonl");
    for (int i = 0; i < 3; ++i) input << R"({"stop_token_ids": [], "prompt_ids": [5, 9, )" << 30 + i << "]}\n";
  }
  const std::string command =
      testing::binary("examples/symbiosis-generate") + " --monolithic --model " + model.string() +
      " --max-new-tokens 100000 --max-tokens 100010 --max-sequences 3 --input " + (work / "requests.jsonl").string();
  const pid_t pid = testing::spawn(
      {"/bin/sh", "-c",
       "exec " + command + " > " + (work / "out.jsonl").string() + " 2> " + (work / "err.log").string()});
  std::this_thread::sleep_for(std::chrono::seconds(3));  // loaded, and decoding (100 000 tokens take minutes)
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  std::ifstream in(work / "out.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string text; std::getline(in, text);) lines.push_back(nlohmann::json::parse(text));
  ASSERT_EQ(lines.size(), 3u) << "see " << work;
  for (const auto& line : lines) {
    EXPECT_EQ(line.at("finish_reason"), "cancelled") << line.dump();
    EXPECT_LT(line.at("output_ids").size(), 100000u);
  }
  // What a request had is what it would have produced: a prefix of its run to as many tokens.
  const auto& first = lines[0];
  const auto produced = first.at("output_ids").size();
  if (produced > 0) {
    const auto again = work / "again.jsonl";
    {
      std::ofstream one(work / "one.jsonl");
      one << nlohmann::json{{"prompt_ids", first.at("prompt_ids")},
                            {"max_new_tokens", produced},
                            {"stop_token_ids", nlohmann::json::array()}}
                 .dump()
          << "\n";
    }
    ASSERT_EQ(testing::shell(testing::binary("examples/symbiosis-generate") + " --monolithic --model " +
                             model.string() + " --max-tokens 100010 --max-sequences 1 --input " +
                             (work / "one.jsonl").string() + " > " + again.string()),
              0);
    std::ifstream again_in(again);
    std::string text;
    std::getline(again_in, text);
    EXPECT_EQ(nlohmann::json::parse(text).at("output_ids"), first.at("output_ids"));
  }
}

}  // namespace
}  // namespace symbiosis
