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

double TokenSampler::draw() {
  const uint64_t bits = generator_.get<at::CPUGeneratorImpl>()->random64() >> 11;  // 53 random bits
  return static_cast<double>(bits + 1) * 0x1.0p-53;                                // (0, 1]
}

std::vector<int64_t> choose_tokens(const at::Tensor& logits, const std::vector<TokenSampler*>& samplers) {
  const auto rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(static_cast<int64_t>(samplers.size()) == rows, "choose_tokens: ", samplers.size(), " samplers for ", rows,
              " rows");
  // Each row's settings, one row of `settings` a row of logits, copied to the device at once:
  // whether it samples, temperature, top-k (0: none), the mass top-p keeps, its draw.
  enum Column { kSampled, kTemperature, kTopK, kKeepMass, kDraw, kColumns };
  std::vector<float> settings(static_cast<size_t>(rows) * kColumns);
  int64_t most_k = 0;
  bool any_sampled = false, any_top_p = false;
  for (int64_t i = 0; i < rows; ++i) {
    const auto& p = samplers[i]->params();
    float* row = settings.data() + i * kColumns;
    row[kTemperature] = 1.0f;  // a greedy row's scores, computed and not used, stay finite
    if (p.greedy()) continue;
    const int64_t k = p.top_k > 0 && p.top_k < vocab ? p.top_k : 0;
    row[kSampled] = 1.0f;
    row[kTemperature] = static_cast<float>(p.temperature);
    row[kTopK] = static_cast<float>(k);  // exact: a vocabulary is far below 2^24
    row[kKeepMass] = static_cast<float>(p.top_p);
    row[kDraw] = static_cast<float>(samplers[i]->draw());
    most_k = std::max(most_k, k);
    any_sampled = true;
    any_top_p = any_top_p || p.top_p < 1.0;
  }
  auto tokens = logits.argmax(-1);
  if (any_sampled) {
    // transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in that order.
    const auto on_device = at::from_blob(settings.data(), {rows, kColumns}, at::kFloat)
                               .to(logits.device(), at::kFloat, false, /*copy=*/true);
    const auto column = [&](Column c) { return on_device.narrow(1, c, 1); };
    const float removed = -std::numeric_limits<float>::infinity();
    auto scores = logits / column(kTemperature);
    if (most_k > 0) {
      // Each row's k-th largest score (rows without top-k: -inf, removing nothing).
      const auto k = column(kTopK).to(at::kLong);
      const auto kth = std::get<0>(scores.topk(most_k)).gather(1, (k - 1).clamp_min(0));
      scores = scores.masked_fill(scores < kth.masked_fill(k == 0, removed), removed);
    }
    if (any_top_p) {
      const auto [sorted, order] = scores.sort(/*dim=*/1, /*descending=*/false);
      auto drop = sorted.softmax(1).cumsum(1) <= (1.0f - column(kKeepMass));
      drop.select(1, vocab - 1).fill_(false);  // the most likely token always stays
      scores = scores.masked_fill(drop.scatter(1, order, drop), removed);
    }
    const auto cumulative = scores.softmax(1).cumsum(1);
    const auto total = cumulative.narrow(1, vocab - 1, 1);
    // The first token whose cumulative probability reaches the draw: never one of probability 0;
    // -1 for a row with nothing to draw from (NaN logits).
    const auto drawn = at::searchsorted(cumulative, column(kDraw) * total).clamp_max(vocab - 1);
    const auto valid = total > 0;  // false for NaN
    tokens = at::where(column(kSampled) > 0, at::where(valid, drawn, -1), tokens.unsqueeze(1)).squeeze(1);
  }
  const auto on_host = tokens.cpu();
  std::vector<int64_t> chosen(on_host.data_ptr<int64_t>(), on_host.data_ptr<int64_t>() + rows);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(chosen[i] >= 0, "sampling row ", i, ": its logits hold NaN; there is no distribution to draw from");
  }
  return chosen;
}

}  // namespace symbiosis
