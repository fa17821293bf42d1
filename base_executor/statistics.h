#pragma once
// The executor's statistics: counters the front door and the scheduler bump, per-layer and
// per-tenant figures, errors by code, batch and wait histograms, and their views: the wire's Stats
// (symbiosis-ctl stats), a log line, and a MetricsSnapshot for the Prometheus endpoint ([Metrics] in
// metrics.h). Thread safety: every method may be called from any thread.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base_executor/base_model.h"
#include "common/status.h"
#include "symbiosis.pb.h"
#include "transport/transport.h"

namespace symbiosis {

// Error codes as the wire names them (StatusCode's values index it).
constexpr size_t kStatusCodes = 9;
const char* status_code_name(size_t code);

// Counts of values in fixed buckets (upper bounds, each counting what is <= it; the last bucket,
// past every bound, is +Inf), with their sum: a Prometheus histogram.
struct Histogram {
  explicit Histogram(std::vector<double> upper_bounds = {})
      : bounds(std::move(upper_bounds)), counts(bounds.size() + 1, 0) {}
  void add(double value);
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // by bucket, not cumulative; counts.back(): past the last bound
  double sum = 0;
  uint64_t count = 0;
};

// Everything the metrics endpoint shows of the statistics, copied at once.
struct MetricsSnapshot {
  struct Layer {
    std::string name;
    uint64_t requests = 0, tokens = 0, forward_batches = 0, backward_batches = 0;
    double compute_seconds = 0;
    std::array<uint64_t, kStatusCodes> errors{};
  };
  struct Tenant {
    std::string name;
    uint64_t requests = 0, tokens = 0;  // answered with a result
    std::array<uint64_t, kStatusCodes> errors{};
  };
  struct LatencyClassFigures {
    const char* name;
    uint64_t requests = 0, tokens = 0;
  };
  double uptime_seconds = 0;
  uint64_t requests = 0, tokens = 0, direct_calls = 0, concurrent_calls = 0, replayed_calls = 0, ahead_calls = 0,
           together_calls = 0, yielding_calls = 0;
  double compute_seconds = 0, deliver_seconds = 0;
  uint64_t queued_calls = 0;
  int64_t queued_tokens = 0;
  std::array<uint64_t, kStatusCodes> errors{};
  std::map<std::string, uint64_t> clients_by_transport;  // every transport, 0 included
  std::vector<Layer> layers;                             // those that ran or refused a call
  std::vector<Tenant> tenants;                           // every tenant seen, in order of arrival
  std::vector<LatencyClassFigures> classes;
  Histogram batch_requests, batch_tokens, wait_seconds;
};

class Statistics {
 public:
  using Clock = std::chrono::steady_clock;
  Statistics(const BaseModel& model, std::string policy);

  std::atomic<uint64_t> clients{0};            // connected now
  std::atomic<uint64_t> same_host_clients{0};  // of which with a payload channel (shm, cuda-ipc, nccl)
  std::atomic<uint64_t> requests{0};           // answered with a result
  std::atomic<uint64_t> errors{0};             // answered with an error (record_error)
  std::atomic<uint64_t> tokens{0};
  std::atomic<uint64_t> direct_calls{0};  // calls whose operands lay in a client's shared segment ([Direct operands])
  std::atomic<uint64_t> concurrent_calls{0};  // calls run alone on their client's compute stream ([Compute streams])
  std::atomic<uint64_t> replayed_calls{
      0};  // captured calls whose GEMM was launched as a graph ([Replayed calls], [Replayed batches])
  std::atomic<uint64_t> ahead_calls{0};     // of those, launched ahead of their inputs ([Steps launched ahead])
  std::atomic<uint64_t> together_calls{0};  // of those, launched with other clients' ([Runs launched together])
  std::atomic<uint64_t> yielding_calls{0};  // fine-tuning calls computed on part of the GPU ([Fine-tuning's SMs])
  std::atomic<uint64_t> compute_nanos{0};   // running batches, delivery included
  std::atomic<uint64_t> deliver_nanos{0};   // the part of compute_nanos spent delivering results
  std::atomic<uint64_t> queue_depth{0};     // calls queued, as the scheduler last saw them
  std::atomic<int64_t> queued_tokens{0};    // their tokens

  // A client was admitted (front door), or forgotten. Tenants are counted by name; past
  // kMaxTenants names, new ones count together as "(other tenants)", so that peers cannot grow the
  // statistics without end.
  static constexpr size_t kMaxTenants = 256;
  void client_joined(uint64_t client_id, const std::string& tenant, TransportKind transport);
  void client_left(uint64_t client_id);
  // A peer was answered with an error: by `code`, by the tenant of `client_id` (0: a peer that is
  // not a client), and by the layer the call named (if it names one the executor serves).
  void record_error(StatusCode code, uint64_t client_id = 0, std::optional<uint32_t> layer = std::nullopt);

  // A batch's calls of each latency class: how many, their tokens, and how long they waited.
  struct ClassCounters {
    uint64_t requests = 0, tokens = 0;
    double wait_seconds = 0;
  };
  using ClassTotals = std::array<ClassCounters, 3>;  // decode, prefill, fine-tuning
  static size_t class_index(LatencyClass latency);
  // One call of a batch.
  struct BatchCall {
    uint64_t client_id = 0;
    int64_t tokens = 0;
    LatencyClass latency = LatencyClass::kFineTuning;
    double wait_seconds = 0;  // from its arrival to the batch's start
  };

  // One batch of one layer and op ran from `started` to `finished`, its results delivered from
  // `computed`; `answered`: its calls got their results (else each was refused, counted by
  // record_error).
  void record_batch(uint32_t layer_id, bool backward, const std::vector<BatchCall>& calls, bool answered,
                    Clock::time_point started, Clock::time_point computed, Clock::time_point finished);
  // [Steps launched ahead]: client_id's calls that ran in no batch, each (layer, tokens), of one
  // latency class: counted as answered calls of their layers, class and tenant, with no wait.
  // `together`: launched with other clients' runs ([Runs launched together]).
  void record_ahead(uint64_t client_id, LatencyClass latency, const std::vector<std::pair<uint32_t, int64_t>>& calls,
                    bool together);
  proto::Stats snapshot() const;
  MetricsSnapshot metrics() const;
  void log() const;

 private:
  struct LayerCounters {
    uint64_t requests = 0, tokens = 0, batches = 0, forward_batches = 0, backward_batches = 0;
    double compute_seconds = 0, wait_seconds = 0;
    std::array<uint64_t, kStatusCodes> errors{};
  };
  struct ClientEntry {
    size_t tenant;  // index into tenants_
    TransportKind transport;
  };
  size_t tenant_slot(const std::string& tenant);  // under mutex_
  const BaseModel& model_;
  const std::string policy_;
  const Clock::time_point started_ = Clock::now();
  mutable std::mutex mutex_;           // guards everything below
  std::vector<LayerCounters> layers_;  // by layer id
  ClassTotals classes_;
  uint64_t max_batch_requests_ = 0;
  std::array<uint64_t, kStatusCodes> errors_by_code_{};
  std::vector<MetricsSnapshot::Tenant> tenants_;
  std::map<std::string, size_t> tenant_index_;
  std::unordered_map<uint64_t, ClientEntry> clients_;  // connected clients, and the latest that left
  std::deque<uint64_t> left_;  // clients that left, oldest first: their calls still queued count for their tenant
  std::array<uint64_t, 4> clients_by_transport_{};  // by TransportKind
  Histogram batch_requests_, batch_tokens_, wait_seconds_;
};

}  // namespace symbiosis
