#pragma once
// The executor's statistics: counters the front door and the scheduler bump, per-layer batch
// figures the batch runner records, and their snapshot as the wire's Stats (symbiosis-ctl stats)
// or a log line. Thread safety: every method may be called from any thread.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "base_executor/base_model.h"
#include "symbiosis.pb.h"

namespace symbiosis {

class Statistics {
 public:
  using Clock = std::chrono::steady_clock;
  Statistics(const BaseModel& model, std::string policy);

  std::atomic<uint64_t> clients{0};            // connected now
  std::atomic<uint64_t> same_host_clients{0};  // of which with a payload channel (shm, cuda-ipc, nccl)
  std::atomic<uint64_t> requests{0};           // answered with a result
  std::atomic<uint64_t> errors{0};             // answered with an error
  std::atomic<uint64_t> tokens{0};
  std::atomic<uint64_t> direct_calls{0};      // calls whose operands lay in a client's shared segment ([Direct operands])
  std::atomic<uint64_t> concurrent_calls{0};  // calls run alone on their client's compute stream ([Compute streams])
  std::atomic<uint64_t> replayed_calls{0};    // captured calls whose GEMM was launched as a graph ([Replayed calls], [Replayed batches])
  std::atomic<uint64_t> compute_nanos{0};     // running batches, delivery included
  std::atomic<uint64_t> deliver_nanos{0};     // the part of compute_nanos spent delivering results
  std::atomic<uint64_t> queue_depth{0};       // calls queued, as the scheduler last saw them

  // A batch's calls of each latency class: how many, their tokens, and how long they waited.
  struct ClassCounters {
    uint64_t requests = 0, tokens = 0;
    double wait_seconds = 0;
  };
  using ClassTotals = std::array<ClassCounters, 3>;  // decode, prefill, fine-tuning
  static size_t class_index(LatencyClass latency);

  // One batch of one layer and op ran from `started` to `finished`, its results delivered from
  // `computed`; `classes` counts its calls.
  void record_batch(uint32_t layer_id, bool backward, const ClassTotals& classes, Clock::time_point started,
                    Clock::time_point computed, Clock::time_point finished);
  proto::Stats snapshot() const;
  void log() const;

 private:
  struct LayerCounters {
    uint64_t requests = 0, tokens = 0, batches = 0, forward_batches = 0, backward_batches = 0;
    double compute_seconds = 0, wait_seconds = 0;
  };
  const BaseModel& model_;
  const std::string policy_;
  const Clock::time_point started_ = Clock::now();
  mutable std::mutex mutex_;             // guards the two below
  std::vector<LayerCounters> layers_;    // by layer id
  ClassTotals classes_;
  uint64_t max_batch_requests_ = 0;
};

}  // namespace symbiosis
