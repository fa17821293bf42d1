#include "bench/op_profile.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

namespace symbiosis::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Started : at::ObserverContext {
  Clock::time_point at;
};

std::atomic<OpProfile*> active{nullptr};
// This thread's operations under way: one that starts at depth 0 is top-level.
thread_local int depth = 0;

}  // namespace

OpProfile::OpProfile(Threads threads) {
  OpProfile* none = nullptr;
  TORCH_CHECK(active.compare_exchange_strong(none, this), "one OpProfile at a time");
  auto callback = at::RecordFunctionCallback(&OpProfile::start, &OpProfile::end).needsInputs(false);
  handle_ = threads == Threads::kAll ? at::addGlobalCallback(callback) : at::addThreadLocalCallback(callback);
}

OpProfile::~OpProfile() {
  at::removeCallback(handle_);
  active = nullptr;
}

std::unique_ptr<at::ObserverContext> OpProfile::start(const at::RecordFunction&) {
  OpProfile* self = active.load();
  if (self == nullptr || !self->recording || depth++ != 0) return nullptr;
  auto context = std::make_unique<Started>();
  context->at = Clock::now();
  return context;
}

void OpProfile::end(const at::RecordFunction& fn, at::ObserverContext* context) {
  if (depth > 0) --depth;  // none where the operation started while nothing recorded
  OpProfile* self = active.load();
  if (context == nullptr || self == nullptr) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - static_cast<Started*>(context)->at).count();
  std::lock_guard<std::mutex> lock(self->mutex_);
  auto& op = self->ops_[fn.name()];
  op.count++;
  op.seconds += seconds;
}

std::vector<OpProfile::Op> OpProfile::ops() const {
  std::vector<Op> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [name, op] : ops_) out.push_back({name, op.count, op.seconds});
  }
  std::sort(out.begin(), out.end(), [](const Op& a, const Op& b) { return a.seconds > b.seconds; });
  return out;
}

}  // namespace symbiosis::bench
