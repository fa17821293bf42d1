#pragma once
// [Overload] accounting that the front door and the scheduler share (docs/operating.md, Limits;
// the limits are ExecutorOptions' max_queued_tokens and max_buffer_bytes).
//
// [Fair shares]
// Each limit is a pool the clients share max-min fairly: a client alone may use all of it, and
// under contention each keeps its share, so that the client refused is the one flooding, not the
// honest ones beside it (an executor that refused whoever came when the pool was full aborted 11 of
// 168 honest training runs during one tenant's flood). A client that holds `held` of a pool of
// `limit`, of which `used` is taken, may take `more` when
//  - the pool has room for it (used + more <= limit); or
//  - it stays within its share however full the pool is (held + more <= limit / holders, holders
//    counting the clients that hold some of the pool, itself included), while the pool stays within
//    twice its limit; or
//  - (queued tokens only) it holds none: one call of any size goes into an empty share, as it went
//    into an empty queue before. So a client that waits for each call's result before the next,
//    as every Client does, is never refused for the queue.
// Otherwise it is refused with RESOURCE_EXHAUSTED, which says that it may send again: the pool is
// full and the call would take its client, which holds some already, past its share; under
// contention the client refused is the one holding more than the others, and what it holds drains.
// What a pool holds past its limit was taken by clients within their shares:
// queued tokens stay within twice --max-queued-tokens plus one call per client (each bounded by
// --max-request-bytes, the clients by --max-clients); buffer bytes within twice --max-buffer-bytes
// (plus the control segments, which the front door takes at the handshake from the pool alone).
// Shares are per tenant where the executor knows who the tenant is: under --keys a tenant is its key
// ([Admission]), and its connections hold one share together, so that opening more connections buys
// no more of a pool. Without keys a tenant's name is only its claim, and every client (connection)
// holds a share of its own (bounded by --max-clients). The client runtime takes a queue refusal as
// back-pressure, and sends the call again ([Back-pressure] in client_runtime/client.cpp).
//
// [Buffer budget]
// Shared memory held for clients counts against one budget, every client's together, because what
// it protects is the executor's host (its /dev/shm, and on a GPU the host memory it pins): each
// same-host client's control segment (taken at its handshake, by the front door) and the payload
// buffers clients register (taken at RegisterBuffer, by the scheduler; a larger buffer replaces the
// smaller, so a client counts its latest). Given back when the client is forgotten. A peer past it
// is refused with RESOURCE_EXHAUSTED naming the limit and --max-buffer-bytes; nothing is mapped.
// Payload buffers are shared by [Fair shares] among the clients that hold one (a control segment,
// the same for every same-host client, is taken from the pool alone). A cuda-ipc client's [Direct
// operands] segments are not counted: they are the client's own GPU allocations, mapped where they
// lie, which the executor neither allocates nor keeps past the client's end.
// Thread safety: every method from any thread.
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "common/status.h"

namespace symbiosis {

// [Fair shares]: what a client's tenant holds of a pool, and how many tenants hold some of it.
struct PoolShare {
  uint64_t held = 0;     // the tenant's part of the pool now (its clients' together)
  uint64_t holders = 1;  // tenants holding some of the pool, the client's own counted
};

// [Fair shares]: whether a client holding `share` may take `more` of a pool of `limit` of which
// `used` is taken (its own part included); `empty_share_takes_any`: the queued-token rule that a
// client holding none may take any amount.
bool fair_share_allows(uint64_t limit, uint64_t used, uint64_t more, const PoolShare& share,
                       bool empty_share_takes_any);

class BufferBudget {
 public:
  explicit BufferBudget(uint64_t limit) : limit_(limit) {}
  BufferBudget(const BufferBudget&) = delete;
  BufferBudget& operator=(const BufferBudget&) = delete;

  // Takes `bytes` of the budget for `what` ("a payload buffer"), or takes nothing and returns the
  // refusal that names the limit and its flag.
  Status take(uint64_t bytes, const std::string& what);
  // The same by [Fair shares], for a client holding `share` of the budget (its payload buffer): it
  // may also take past the limit while it stays within its share.
  Status take(uint64_t bytes, const std::string& what, const PoolShare& share);
  // Whether `bytes` more would fit now (a check before work that take() will guard again).
  Status has_room(uint64_t bytes, const std::string& what) const;
  void give_back(uint64_t bytes) { used_.fetch_sub(bytes); }
  uint64_t used() const { return used_.load(); }
  uint64_t limit() const { return limit_; }

 private:
  Status refusal(uint64_t bytes, uint64_t used, const std::string& what, const PoolShare* share = nullptr) const;
  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

// [Fair shares] of --max-queued-tokens: the tokens of the calls waiting to be batched, by client,
// both where they wait: a call over ZeroMQ in the scheduler's inbox (admitted by the front door's
// post_call, counted until the scheduler takes it out), and every call in the Batcher (as the
// scheduler's thread last published them). The front door admits calls over ZeroMQ, the scheduler
// checks calls through a channel before it queues them: both by the rule above.
// Thread safety: every method from any thread (one mutex; its sections are short).
class QueueShares {
 public:
  explicit QueueShares(int64_t limit) : limit_(limit) {}
  QueueShares(const QueueShares&) = delete;
  QueueShares& operator=(const QueueShares&) = delete;

  // [Fair shares]: the client's calls count for `tenant` (its key's name) beside the tenant's other
  // clients; a client that never joined, or joined with no tenant, is a tenant of its own.
  void join(uint64_t client_id, const std::string& tenant);
  void leave(uint64_t client_id);
  // A call over ZeroMQ: counted as waiting in the inbox, or refused (nothing counted).
  Status admit(uint64_t client_id, uint64_t request_id, int64_t tokens);
  // The scheduler took a call that admit() counted out of its inbox (to queue it, or to refuse it).
  void leave_inbox(uint64_t client_id, int64_t tokens);
  // A call through a channel, about to be queued: ok, or the refusal. Counts nothing: the Batcher's
  // tokens come through note_batched().
  Status check(uint64_t client_id, uint64_t request_id, int64_t tokens) const;
  // The Batcher's pending tokens by client (clients with none left out).
  void note_batched(const std::map<uint64_t, int64_t>& by_client);
  int64_t queued() const;                    // every client's, inbox and Batcher
  int64_t queued(uint64_t client_id) const;  // one client's (its own, not its tenant's)
  int64_t limit() const { return limit_; }

 private:
  Status verdict(uint64_t client_id, uint64_t request_id, int64_t tokens) const;  // under mutex_
  uint64_t tenant_of(uint64_t client_id) const;                                   // under mutex_
  const int64_t limit_;
  mutable std::mutex mutex_;                                 // guards the seven below
  std::map<uint64_t, uint64_t> tenant_;                      // joined clients' tenants, by number
  std::map<std::string, std::pair<uint64_t, int>> tenants_;  // a tenant's number and its joined clients
  uint64_t next_tenant_ = uint64_t{1} << 63;  // tenants' numbers lie past every client id, which numbers a client's own
  std::map<uint64_t, int64_t> inbox_;         // admitted calls' tokens not yet taken out, by client (none: absent)
  std::map<uint64_t, int64_t> batched_;       // the Batcher's, by client (none: absent)
  int64_t inbox_total_ = 0;
  int64_t batched_total_ = 0;
};

// The refusal of request `request_id` of `tokens` tokens while `queued` tokens wait to be batched,
// past `limit` (--max-queued-tokens), of a client that holds `share` of them.
Status queue_full(uint64_t request_id, int64_t tokens, int64_t queued, int64_t limit, const PoolShare& share);

}  // namespace symbiosis
