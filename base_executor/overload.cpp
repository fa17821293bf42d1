#include "base_executor/overload.h"

#include <algorithm>
#include <cstdint>

namespace symbiosis {

// [Fair shares]
bool fair_share_allows(uint64_t limit, uint64_t used, uint64_t more, const PoolShare& share,
                       bool empty_share_takes_any) {
  if (more <= limit - std::min(used, limit)) return true;  // the pool has room
  if (empty_share_takes_any && share.held == 0) return true;
  const uint64_t fair = limit / std::max<uint64_t>(share.holders, 1);
  const bool within_share = share.held <= fair && more <= fair - share.held;
  const uint64_t twice = limit > UINT64_MAX / 2 ? UINT64_MAX : 2 * limit;
  const bool within_twice = used <= twice && more <= twice - used;
  return within_share && within_twice;
}

namespace {

// What a refusal says of the client's share: why this client, and not another, was refused.
std::string share_text(const PoolShare& share, uint64_t limit, const char* unit, const char* holders_are) {
  const uint64_t holders = std::max<uint64_t>(share.holders, 1);
  return "; this client's tenant holds " + std::to_string(share.held) + " " + unit + ", and its fair share is " +
         std::to_string(limit / holders) + " (the limit shared among " + std::to_string(holders) + " " +
         (holders == 1 ? "tenant" : "tenants") + " " + holders_are + ")";
}

}  // namespace

Status BufferBudget::refusal(uint64_t bytes, uint64_t used, const std::string& what, const PoolShare* share) const {
  return {StatusCode::kResourceExhausted,
          what + " of " + std::to_string(bytes) + " bytes would bring the shared memory the executor holds for its " +
              "clients to " + std::to_string(used + bytes) + " bytes, over its limit of " + std::to_string(limit_) +
              " bytes (max_buffer_bytes; raise it with --max-buffer-bytes)" +
              (share != nullptr ? share_text(*share, limit_, "bytes", "holding payload buffers") : "") +
              "; try again once other clients leave"};
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

Status BufferBudget::take(uint64_t bytes, const std::string& what, const PoolShare& share) {
  uint64_t used = used_.load();
  do {
    if (!fair_share_allows(limit_, used, bytes, share, /*empty_share_takes_any=*/false)) {
      return refusal(bytes, used, what, &share);
    }
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return Status::ok();
}

Status queue_full(uint64_t request_id, int64_t tokens, int64_t queued, int64_t limit, const PoolShare& share) {
  return {StatusCode::kResourceExhausted,
          "request " + std::to_string(request_id) + " of " + std::to_string(tokens) +
              " tokens would bring the calls waiting to be batched to " + std::to_string(queued + tokens) +
              " tokens, over the executor's limit of " + std::to_string(limit) +
              " (max_queued_tokens; raise it with --max-queued-tokens)" +
              share_text(share, static_cast<uint64_t>(limit), "tokens", "with calls waiting") +
              "; send it again once this client's calls drain"};
}

void QueueShares::join(uint64_t client_id, const std::string& tenant) {
  if (tenant.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, added] = tenants_.try_emplace(tenant, next_tenant_, 0);
  if (added) ++next_tenant_;
  ++it->second.second;
  tenant_[client_id] = it->second.first;
}

void QueueShares::leave(uint64_t client_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto joined = tenant_.find(client_id);
  if (joined == tenant_.end()) return;
  for (auto it = tenants_.begin(); it != tenants_.end(); ++it) {
    if (it->second.first == joined->second && --it->second.second == 0) {
      tenants_.erase(it);
      break;
    }
  }
  tenant_.erase(joined);
}

uint64_t QueueShares::tenant_of(uint64_t client_id) const {
  const auto it = tenant_.find(client_id);
  return it != tenant_.end() ? it->second : client_id;
}

// [Fair shares] of the queue, by tenant. Callers hold mutex_.
Status QueueShares::verdict(uint64_t client_id, uint64_t request_id, int64_t tokens) const {
  const int64_t used = inbox_total_ + batched_total_;
  // A negative count is the call check's to refuse, naming the shape. While the pool has room (the
  // common case: this runs for every per-layer call), no share is computed.
  if (tokens < 0 || tokens <= limit_ - std::min(used, limit_)) return Status::ok();
  // What each tenant's clients hold in the inbox and the Batcher together.
  std::map<uint64_t, int64_t> by_tenant;
  for (const auto& [id, queued] : inbox_) by_tenant[tenant_of(id)] += queued;
  for (const auto& [id, queued] : batched_) by_tenant[tenant_of(id)] += queued;
  const auto mine = by_tenant.find(tenant_of(client_id));
  const int64_t held = mine != by_tenant.end() ? mine->second : 0;
  const PoolShare share{static_cast<uint64_t>(held), by_tenant.size() + (held == 0 ? 1 : 0)};
  if (fair_share_allows(static_cast<uint64_t>(limit_), static_cast<uint64_t>(used), static_cast<uint64_t>(tokens),
                        share, /*empty_share_takes_any=*/true)) {
    return Status::ok();
  }
  return queue_full(request_id, tokens, used, limit_, share);
}

Status QueueShares::admit(uint64_t client_id, uint64_t request_id, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto status = verdict(client_id, request_id, tokens);
  if (status.is_ok() && tokens > 0) {
    inbox_[client_id] += tokens;
    inbox_total_ += tokens;
  }
  return status;
}

void QueueShares::leave_inbox(uint64_t client_id, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = inbox_.find(client_id);
  if (it == inbox_.end() || tokens <= 0) return;
  const int64_t taken = std::min(tokens, it->second);
  inbox_total_ -= taken;
  if ((it->second -= taken) == 0) inbox_.erase(it);
}

Status QueueShares::check(uint64_t client_id, uint64_t request_id, int64_t tokens) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return verdict(client_id, request_id, tokens);
}

void QueueShares::note_batched(const std::map<uint64_t, int64_t>& by_client) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (by_client == batched_) return;
  batched_ = by_client;
  batched_total_ = 0;
  for (const auto& [id, tokens] : batched_) batched_total_ += tokens;
}

int64_t QueueShares::queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return inbox_total_ + batched_total_;
}

int64_t QueueShares::queued(uint64_t client_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto a = inbox_.find(client_id);
  const auto b = batched_.find(client_id);
  return (a != inbox_.end() ? a->second : 0) + (b != batched_.end() ? b->second : 0);
}

}  // namespace symbiosis
