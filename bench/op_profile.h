#pragma once
// [Op profile] Where a program's host time goes: while it records, every top-level LibTorch
// operation (an operator the model called, an autograd node the backward ran, a call to the
// executor: symbiosis::executor_call, [CPU decode attention]: symbiosis::cpu_decode_attention) is
// counted and timed from its start to its end, nested operations inside it included. On a GPU most
// operations launch one kernel or more, so the count is also a floor on the kernel launches.
// symbiosis-bench-client (--op-profile) observes every thread (the model's and autograd's);
// symbiosis-bench-long-context (--profile-ops) only its stepping thread, so that the attention's
// worker threads add nothing of their own.
#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace symbiosis::bench {

class OpProfile {
 public:
  enum class Threads { kAll, kThisOne };
  // One at a time: LibTorch's callbacks are plain functions, so they find the profile in a static.
  explicit OpProfile(Threads threads);
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Whether operations that start from now on are counted; any thread may set it.
  std::atomic<bool> recording{true};

  struct Op {
    std::string name;
    int64_t count = 0;
    double seconds = 0;
  };
  // The operations counted so far, the longest first.
  std::vector<Op> ops() const;

 private:
  static std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn);
  static void end(const at::RecordFunction& fn, at::ObserverContext* context);

  at::CallbackHandle handle_;
  mutable std::mutex mutex_;
  std::map<std::string, Op> ops_;  // guarded by mutex_
};

}  // namespace symbiosis::bench
