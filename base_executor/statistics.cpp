#include "base_executor/statistics.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "transport/zmq_wire.h"

namespace symbiosis {

Statistics::Statistics(const BaseModel& model, std::string policy)
    : model_(model), policy_(std::move(policy)), layers_(model.layer_count()) {}

namespace {

constexpr LatencyClass kClasses[] = {LatencyClass::kInferenceDecode, LatencyClass::kInferencePrefill,
                                     LatencyClass::kFineTuning};

}  // namespace

size_t Statistics::class_index(LatencyClass latency) {
  return latency == LatencyClass::kInferenceDecode ? 0 : latency == LatencyClass::kInferencePrefill ? 1 : 2;
}

void Statistics::record_batch(uint32_t layer_id, bool backward, const ClassTotals& classes, Clock::time_point started,
                              Clock::time_point computed, Clock::time_point finished) {
  using std::chrono::duration_cast;
  using std::chrono::nanoseconds;
  compute_nanos += duration_cast<nanoseconds>(finished - started).count();
  deliver_nanos += duration_cast<nanoseconds>(finished - computed).count();
  std::lock_guard<std::mutex> lock(mutex_);
  auto& c = layers_[layer_id];
  c.batches++;
  (backward ? c.backward_batches : c.forward_batches)++;
  uint64_t batch_requests = 0;
  for (size_t i = 0; i < classes.size(); ++i) {
    c.requests += classes[i].requests;
    c.tokens += classes[i].tokens;
    c.wait_seconds += classes[i].wait_seconds;
    classes_[i].requests += classes[i].requests;
    classes_[i].tokens += classes[i].tokens;
    classes_[i].wait_seconds += classes[i].wait_seconds;
    batch_requests += classes[i].requests;
  }
  c.compute_seconds += std::chrono::duration<double>(finished - started).count();
  max_batch_requests_ = std::max<uint64_t>(max_batch_requests_, batch_requests);
}

proto::Stats Statistics::snapshot() const {
  proto::Stats s;
  s.set_clients(clients);
  s.set_requests(requests);
  s.set_errors(errors);
  s.set_tokens(tokens);
  s.set_compute_seconds(compute_nanos * 1e-9);
  s.set_deliver_seconds(deliver_nanos * 1e-9);
  s.set_direct_calls(direct_calls);
  s.set_concurrent_calls(concurrent_calls);
  s.set_replayed_calls(replayed_calls);
  s.set_policy(policy_);
  s.set_uptime_seconds(std::chrono::duration<double>(Clock::now() - started_).count());
  s.set_queue_depth(queue_depth);
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t batches = 0;
  double wait = 0;
  for (size_t id = 0; id < layers_.size(); ++id) {
    const auto& c = layers_[id];
    batches += c.batches;
    wait += c.wait_seconds;
    if (c.requests == 0) continue;
    auto* layer = s.add_layers();
    layer->set_layer_id(static_cast<uint32_t>(id));
    layer->set_name(model_.layer(static_cast<uint32_t>(id)).name);
    layer->set_requests(c.requests);
    layer->set_tokens(c.tokens);
    layer->set_batches(c.batches);
    layer->set_compute_seconds(c.compute_seconds);
    layer->set_wait_seconds(c.wait_seconds);
    layer->set_op_forward(c.forward_batches);
    layer->set_op_backward(c.backward_batches);
  }
  s.set_batches(batches);
  s.set_wait_seconds(wait);
  s.set_max_batch_requests(max_batch_requests_);
  for (const auto latency : kClasses) {
    const auto& c = classes_[class_index(latency)];
    if (c.requests == 0) continue;
    auto* stats = s.add_classes();
    stats->set_latency_class(wire::to_proto(latency));
    stats->set_requests(c.requests);
    stats->set_tokens(c.tokens);
    stats->set_wait_seconds(c.wait_seconds);
  }
  return s;
}

void Statistics::log() const {
  const auto s = snapshot();
  const double uptime = std::max(s.uptime_seconds(), 1e-9);
  spdlog::info(
      "stats ({}): {} clients, {} requests in {} batches ({:.2f} requests/batch, max {}), {} errors, {} tokens "
      "({:.0f} tokens/s), {:.3f} s computing, mean wait {:.1f} us, queue depth {}",
      s.policy(), s.clients(), s.requests(), s.batches(),
      s.batches() ? double(s.requests()) / s.batches() : 0.0, s.max_batch_requests(), s.errors(), s.tokens(),
      s.tokens() / uptime, s.compute_seconds(), s.requests() ? 1e6 * s.wait_seconds() / s.requests() : 0.0,
      s.queue_depth());
}

}  // namespace symbiosis
