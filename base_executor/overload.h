#pragma once
// [Overload] accounting that the front door and the scheduler share (docs/operating.md, Overload;
// the limits are ExecutorOptions' max_queued_tokens and max_buffer_bytes).
//
// [Buffer budget]
// Shared memory held for clients counts against one budget, every client's together, because what
// it protects is the executor's host (its /dev/shm, and on a GPU the host memory it pins): each
// same-host client's control segment (taken at its handshake, by the front door) and the payload
// buffers clients register (taken at RegisterBuffer, by the scheduler; a larger buffer replaces the
// smaller, so a client counts its latest). Given back when the client is forgotten. A peer past it
// is refused with RESOURCE_EXHAUSTED naming the limit and --max-buffer-bytes; nothing is mapped.
// No per-client share: one client's buffer is at most what its largest call needs (the client
// runtime doubles it as calls grow, bounded by --max-request-bytes), and --max-clients bounds how
// many there are. A cuda-ipc client's [Direct operands] segments are not counted: they are the
// client's own GPU allocations, mapped where they lie, which the executor neither allocates nor
// keeps past the client's end.
// Thread safety: every method from any thread.
#include <atomic>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace symbiosis {

class BufferBudget {
 public:
  explicit BufferBudget(uint64_t limit) : limit_(limit) {}
  BufferBudget(const BufferBudget&) = delete;
  BufferBudget& operator=(const BufferBudget&) = delete;

  // Takes `bytes` of the budget for `what` ("a payload buffer"), or takes nothing and returns the
  // refusal that names the limit and its flag.
  Status take(uint64_t bytes, const std::string& what);
  // Whether `bytes` more would fit now (a check before work that take() will guard again).
  Status has_room(uint64_t bytes, const std::string& what) const;
  void give_back(uint64_t bytes) { used_.fetch_sub(bytes); }
  uint64_t used() const { return used_.load(); }
  uint64_t limit() const { return limit_; }

 private:
  Status refusal(uint64_t bytes, uint64_t used, const std::string& what) const;
  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

// The refusal of request `request_id` of `tokens` tokens while `queued` tokens wait to be batched,
// past `limit` (--max-queued-tokens).
Status queue_full(uint64_t request_id, int64_t tokens, int64_t queued, int64_t limit);

}  // namespace symbiosis
