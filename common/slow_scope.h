#pragma once
// [Slow scopes]
// Warns as a scope ends, when it took 100 ms or more: "<what> took N ms". For work that may wait
// for the GPU on a thread others need (the scheduler's, a channel's teardown, a client's allocator
// lock held): a stall there shows up in the log with what held it. The includer links spdlog.
#include <spdlog/spdlog.h>

#include <chrono>
#include <string>
#include <utility>

namespace symbiosis {

class SlowScope {
 public:
  explicit SlowScope(std::string what) : what_(std::move(what)) {}
  ~SlowScope() {
    const auto took =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started_);
    if (took >= std::chrono::milliseconds(100)) spdlog::warn("{} took {} ms", what_, took.count());
  }
  SlowScope(const SlowScope&) = delete;
  SlowScope& operator=(const SlowScope&) = delete;

 private:
  std::string what_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

}  // namespace symbiosis
