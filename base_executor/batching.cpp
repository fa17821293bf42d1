#include "base_executor/batching.h"

#include <c10/util/Exception.h>

namespace symbiosis {

BatchingPolicy parse_batching_policy(const std::string& name) {
  if (name == "none") return BatchingPolicy::kNone;
  if (name == "lockstep") return BatchingPolicy::kLockstep;
  if (name == "opportunistic") return BatchingPolicy::kOpportunistic;
  TORCH_CHECK(false, "unknown batching policy '", name, "' (expected none, lockstep or opportunistic)");
}

const char* batching_policy_name(BatchingPolicy policy) {
  switch (policy) {
    case BatchingPolicy::kNone: return "none";
    case BatchingPolicy::kLockstep: return "lockstep";
    case BatchingPolicy::kOpportunistic: return "opportunistic";
  }
  return "?";
}

void BatchingOptions::validate() const {
  TORCH_CHECK(max_wait.count() >= 0, "batching option max_wait must be >= 0, got ", max_wait.count(), " us");
  TORCH_CHECK(max_batch_tokens > 0, "batching option max_batch_tokens must be positive, got ", max_batch_tokens);
  TORCH_CHECK(lockstep_timeout.count() > 0, "batching option lockstep_timeout must be positive");
  TORCH_CHECK(companion_window.count() >= 0, "batching option companion_window must be >= 0");
  TORCH_CHECK(decode_align_wait.count() >= 0, "executor option --decode-align-wait must be >= 0, got ",
              decode_align_wait.count(), " us");
  TORCH_CHECK(decode_wait.count() >= 0 && prefill_wait.count() >= 0 && fine_tuning_wait.count() >= 0 &&
                  per_token_wait.count() >= 0,
              "batching wait budgets must be >= 0");
  TORCH_CHECK(judge_window.count() >= 0, "executor option --judge-window must be >= 0, got ", judge_window.count(),
              " ms");
  TORCH_CHECK(judge_explore_every >= 2, "batching option judge_explore_every must be >= 2, got ", judge_explore_every);
  TORCH_CHECK(decode_first_streak >= 0, "executor option --decode-first-streak must be >= 0, got ",
              decode_first_streak);
}

std::chrono::nanoseconds BatchingOptions::budget(LatencyClass latency, int64_t tokens) const {
  std::chrono::nanoseconds base = latency == LatencyClass::kInferenceDecode    ? decode_wait
                                  : latency == LatencyClass::kInferencePrefill ? prefill_wait
                                                                               : fine_tuning_wait;
  return std::min<std::chrono::nanoseconds>(max_wait, base + per_token_wait * tokens);
}

}  // namespace symbiosis
