#pragma once
// What the generation tests share (CPU and GPU): requests, a generation that logs each request's
// logits step by step, a LoRA for either model, and the comparison of two generations.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client_runtime/inference/generator.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/loss.h"
#include "tests/test_util.h"

namespace symbiosis::testing {

// Each request's logits, step by step (fp32, CPU).
using LogitsLog = std::map<uint64_t, std::vector<at::Tensor>>;

struct Generated {
  std::vector<GenerationResult> results;
  std::vector<std::vector<at::Tensor>> logits;  // per request, per produced token
  int64_t captured = 0;                         // decode graphs the generator captured ([Captured decode])
};

inline Generated generate(const CausalLM& lm, const std::vector<GenerationRequest>& requests,
                          GeneratorOptions options = {}) {
  auto log = std::make_shared<LogitsLog>();
  options.logits_observer = [log](uint64_t id, const at::Tensor& row) {
    (*log)[id].push_back(row.to(at::kCPU, at::kFloat));
  };
  Generator generator(lm, options);
  Generated out;
  out.results = generator.generate(requests);
  out.captured = generator.captured_batch_sizes();
  for (const auto& [id, rows] : *log) out.logits.push_back(rows);  // ids are 1, 2, ... in submission order
  return out;
}

// The same through a [Host decode] Generator: `prefill` prefills, `decode` (a CPU copy) decodes.
inline Generated generate_host_decode(const CausalLM& prefill, const CausalLM& decode,
                                      const std::vector<GenerationRequest>& requests, GeneratorOptions options = {}) {
  auto log = std::make_shared<LogitsLog>();
  options.logits_observer = [log](uint64_t id, const at::Tensor& row) {
    (*log)[id].push_back(row.to(at::kCPU, at::kFloat));
  };
  Generator generator(prefill, decode, options);
  Generated out;
  out.results = generator.generate(requests);
  for (const auto& [id, rows] : *log) out.logits.push_back(rows);
  EXPECT_EQ(generator.cache().free_slots(), generator.cache().sequences());
  return out;
}

inline GenerationRequest request(std::vector<int64_t> prompt, int64_t new_tokens, double temperature = 0.0,
                                 int64_t top_k = 0, double top_p = 1.0, uint64_t seed = 0) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_new_tokens = new_tokens;
  r.sampling.temperature = temperature;
  r.sampling.top_k = top_k;
  r.sampling.top_p = top_p;
  r.sampling.seed = seed;
  r.sampling.logprobs = true;
  return r;
}

// Prompts of different lengths, greedy and sampled: more requests than cache slots, so they join
// and leave the running batch at step boundaries.
inline std::vector<GenerationRequest> mixed_requests() {
  return {request({5, 9, 33, 2, 7}, 7), request({100, 4, 18}, 9, 0.8, 20, 1.0, 1),
          request({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, 5, 1.0, 0, 0.9, 2), request({42}, 8, 0.7, 10, 0.8, 3),
          request({17, 3}, 6)};
}

// A LoRA for either model whose B is drawn (not zero), so it changes what the model computes.
inline LoraConfig test_lora() {
  LoraConfig lora;
  lora.r = 4;
  // Each architecture's attention and an MLP layer (Phi-3's and GPT-NeoX's fused q, k and v).
  lora.target_modules = {"q_proj",   "v_proj",          "c_attn",        "down_proj", "c_fc",
                         "qkv_proj", "query_key_value", "dense_4h_to_h", "fc2"};
  lora.init_b_zero = false;
  return lora;
}

// test_lora() on each architecture's attention alone: its MLP keeps no adapter ([MLP blocks] in
// base_executor/base_model.h).
inline LoraConfig attention_lora() {
  auto lora = test_lora();
  lora.target_modules = {"q_proj", "v_proj", "c_attn", "qkv_proj", "query_key_value"};
  return lora;
}

inline void add_test_lora(CausalLM& lm) {
  at::manual_seed(7);
  add_lora(*lm.module, test_lora());
}

// mixed_requests() with the test LoRA, 3 sequences at once and 24 tokens, through `client` (split)
// and in this process (monolithic): {split, monolithic}.
inline std::pair<Generated, Generated> generate_split_and_monolithic(const Checkpoint& checkpoint,
                                                                     const std::shared_ptr<Client>& client) {
  auto split_lm = open_causal_lm(checkpoint, client);
  auto mono_lm = open_causal_lm(checkpoint);
  add_test_lora(split_lm);
  add_test_lora(mono_lm);
  GeneratorOptions options;
  options.max_sequences = 3;
  options.max_tokens = 24;
  auto split = generate(split_lm, mixed_requests(), options);
  return {std::move(split), generate(mono_lm, mixed_requests(), options)};
}

// The fine-tuning tenant generation tests run beside: `run` trains on `ids` in a thread of its own
// from construction until stop(), at least one step. Its adapter and data are drawn before: the
// thread draws nothing, so what the test draws meanwhile is drawn alike.
class BackgroundTraining {
 public:
  BackgroundTraining(TrainingRun& run, at::Tensor ids)
      : thread_([this, &run, ids = std::move(ids)] {
          while (!stop_ || steps_ == 0) {
            run.optimizer->zero_grad();
            causal_lm_loss(run.lm.forward(ids, {}), ids).backward();
            run.lm.settle();
            run.optimizer->step();
            ++steps_;
          }
        }) {}
  ~BackgroundTraining() { stop(); }
  // Joins the thread; the steps it took.
  int stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    return steps_;
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> steps_{0};
  std::thread thread_;
};

inline void expect_same(const Generated& a, const Generated& b, const std::string& what, double tolerance = 1e-5) {
  ASSERT_EQ(a.results.size(), b.results.size());
  ASSERT_EQ(a.logits.size(), b.logits.size());
  for (size_t i = 0; i < a.results.size(); ++i) {
    EXPECT_EQ(a.results[i].output_ids, b.results[i].output_ids) << what << ", request " << i;
    EXPECT_EQ(a.results[i].finish_reason, b.results[i].finish_reason) << what << ", request " << i;
    ASSERT_EQ(a.logits[i].size(), b.logits[i].size()) << what << ", request " << i;
    for (size_t t = 0; t < a.logits[i].size(); ++t) {
      EXPECT_LT(relative_error(a.logits[i][t], b.logits[i][t]), tolerance)
          << what << ", request " << i << " token " << t;
    }
    for (size_t t = 0; t < a.results[i].logprobs.size(); ++t) {
      EXPECT_NEAR(a.results[i].logprobs[t], b.results[i].logprobs[t], 1e-4) << what << ", request " << i;
    }
  }
}

}  // namespace symbiosis::testing
