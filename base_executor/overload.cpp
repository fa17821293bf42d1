#include "base_executor/overload.h"

#include <algorithm>

namespace symbiosis {

Status BufferBudget::refusal(uint64_t bytes, uint64_t used, const std::string& what) const {
  return {StatusCode::kResourceExhausted,
          what + " of " + std::to_string(bytes) + " bytes would bring the shared memory the executor holds for its " +
              "clients to " + std::to_string(used + bytes) + " bytes, over its limit of " + std::to_string(limit_) +
              " bytes (max_buffer_bytes; raise it with --max-buffer-bytes); try again once other clients leave"};
}

Status BufferBudget::has_room(uint64_t bytes, const std::string& what) const {
  const uint64_t used = used_.load();
  return bytes > limit_ - std::min(used, limit_) ? refusal(bytes, used, what) : Status::ok();
}

Status BufferBudget::take(uint64_t bytes, const std::string& what) {
  uint64_t used = used_.load();
  do {
    if (bytes > limit_ - std::min(used, limit_)) return refusal(bytes, used, what);
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return Status::ok();
}

Status queue_full(uint64_t request_id, int64_t tokens, int64_t queued, int64_t limit) {
  return {StatusCode::kResourceExhausted,
          "request " + std::to_string(request_id) + " of " + std::to_string(tokens) +
              " tokens would bring the calls waiting to be batched to " + std::to_string(queued + tokens) +
              " tokens, over the executor's limit of " + std::to_string(limit) +
              " (max_queued_tokens; raise it with --max-queued-tokens); send it again once the queue drains"};
}

}  // namespace symbiosis
