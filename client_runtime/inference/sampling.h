#pragma once
// How a generation request chooses each next token from the model's logits: greedy, or sampled
// with temperature, top-k and top-p from the request's own seeded random stream, as transformers'
// generate does (temperature, then top-k, then top-p, then a draw from the softmax). The same
// logits and seed give the same tokens, so a split run samples what a monolithic run samples.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace symbiosis {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (the most likely token); > 0: sample from softmax(logits / temperature)
  int64_t top_k = 0;         // sample among the k most likely tokens only; 0: all
  double top_p = 1.0;        // sample among the fewest most likely tokens whose probability reaches top_p; (0, 1]
  uint64_t seed = 0;         // the request's random stream (sampled requests only)
  std::vector<int64_t> stop_tokens;  // the request ends once it produces one of these (kept in its output)
  int64_t max_new_tokens = 16;       // the request ends after producing this many tokens
  bool logprobs =
      false;  // report each produced token's log-probability under the model (fp32 log-softmax of its logits)
  int64_t top_logprobs = 0;  // report also this many most likely tokens at each step, with theirs (0 to the vocabulary)

  bool greedy() const { return temperature == 0.0; }
  // Throws naming the field and its allowed range; stop tokens must lie in [0, vocab_size).
  void validate(int64_t vocab_size) const;
};

// One request's random stream: a uniform draw in (0, 1] for each token it samples, from its seed.
// Not thread-safe; one per request.
class TokenSampler {
 public:
  explicit TokenSampler(const SamplingParams& params);
  const SamplingParams& params() const { return params_; }
  double draw();

 private:
  SamplingParams params_;
  at::Generator generator_;
};

// [Batched sampling]: the next token of each row of `logits` ([rows, vocab], fp32, any device),
// row i chosen as samplers[i]'s request asks, all rows in one pass on the logits' device (one copy
// of the ids to the host): greedy rows take the argmax; sampled rows apply temperature, top-k and
// top-p, then take the token where their draw falls in the cumulative distribution (inverse
// transform sampling: one draw a token, so a request's tokens depend on its seed and its logits
// alone, not on the rows it shares a step with).
std::vector<int64_t> choose_tokens(const at::Tensor& logits, const std::vector<TokenSampler*>& samplers);

}  // namespace symbiosis
