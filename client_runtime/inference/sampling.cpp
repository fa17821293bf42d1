#include "client_runtime/inference/sampling.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>

namespace symbiosis {

void SamplingParams::validate(int64_t vocab_size) const {
  TORCH_CHECK(std::isfinite(temperature) && temperature >= 0.0, "temperature is ", temperature,
              ", expected a finite value >= 0 (0: greedy)");
  TORCH_CHECK(top_k >= 0, "top_k is ", top_k, ", expected >= 0 (0: no limit)");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "top_p is ", top_p, ", expected a value in (0, 1]");
  TORCH_CHECK(max_new_tokens >= 1, "max_new_tokens is ", max_new_tokens, ", expected at least 1");
  TORCH_CHECK(top_logprobs >= 0 && top_logprobs <= vocab_size, "top_logprobs is ", top_logprobs,
              ", expected 0 to the vocabulary's ", vocab_size);
  for (size_t i = 0; i < stop_tokens.size(); ++i) {
    TORCH_CHECK(stop_tokens[i] >= 0 && stop_tokens[i] < vocab_size, "stop_tokens[", i, "] is ", stop_tokens[i],
                ", expected a token id in [0, ", vocab_size, ")");
  }
}

TokenSampler::TokenSampler(const SamplingParams& params)
    : params_(params), generator_(at::make_generator<at::CPUGeneratorImpl>(params.seed)) {}

int64_t TokenSampler::sample(const at::Tensor& logits) {
  if (params_.greedy()) return logits.argmax().item<int64_t>();
  // transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in that order.
  const float removed = -std::numeric_limits<float>::infinity();
  auto scores = logits.to(at::kCPU, at::kFloat) / params_.temperature;
  if (params_.top_k > 0 && params_.top_k < scores.size(0)) {
    const auto kth = std::get<0>(scores.topk(params_.top_k)).select(0, params_.top_k - 1);
    scores = scores.masked_fill(scores < kth, removed);
  }
  if (params_.top_p < 1.0) {
    const auto [sorted, order] = scores.sort(/*dim=*/0, /*descending=*/false);
    auto drop = sorted.softmax(0).cumsum(0) <= (1.0 - params_.top_p);
    drop.select(0, drop.size(0) - 1).fill_(false);  // the most likely token always stays
    scores = scores.masked_fill(drop.scatter(0, order, drop), removed);
  }
  return at::multinomial(scores.softmax(0), 1, /*replacement=*/false, generator_).item<int64_t>();
}

}  // namespace symbiosis
