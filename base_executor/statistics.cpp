#include "base_executor/statistics.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "transport/zmq_wire.h"

namespace symbiosis {

namespace {

constexpr LatencyClass kClasses[] = {LatencyClass::kInferenceDecode, LatencyClass::kInferencePrefill,
                                     LatencyClass::kFineTuning};
constexpr const char* kClassNames[] = {"inference_decode", "inference_prefill", "fine_tuning"};  // by class_index
// Clients that left whose tenant is still known, for their calls still queued.
constexpr size_t kRememberedClients = 1024;

}  // namespace

const char* status_code_name(size_t code) {
  static constexpr const char* kNames[kStatusCodes] = {
      "OK",       "INVALID_ARGUMENT",  "NOT_FOUND",  "RESOURCE_EXHAUSTED", "MALFORMED", "FAILED_PRECONDITION",
      "INTERNAL", "PERMISSION_DENIED", "UNAVAILABLE"};
  return code < kStatusCodes ? kNames[code] : "UNKNOWN";
}

void Histogram::add(double value) {
  size_t bucket = 0;
  while (bucket < bounds.size() && value > bounds[bucket]) bucket++;
  counts[bucket]++;
  sum += value;
  count++;
}

Statistics::Statistics(const BaseModel& model, std::string policy)
    : model_(model),
      policy_(std::move(policy)),
      layers_(model.layer_count()),
      batch_requests_({1, 2, 4, 8, 16, 32, 64, 128}),
      batch_tokens_({1, 8, 64, 256, 1024, 4096, 16384, 65536}),
      wait_seconds_({1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1}) {}

size_t Statistics::tenant_slot(const std::string& tenant) {
  const auto it = tenant_index_.find(tenant);
  if (it != tenant_index_.end()) return it->second;
  const std::string name = tenants_.size() < kMaxTenants ? tenant : "(other tenants)";
  const auto [slot, added] = tenant_index_.emplace(name, tenants_.size());
  if (added) tenants_.push_back({name});
  return slot->second;
}

void Statistics::client_joined(uint64_t client_id, const std::string& tenant, TransportKind transport) {
  std::lock_guard<std::mutex> lock(mutex_);
  clients_[client_id] = {tenant_slot(tenant), transport};
  clients_by_transport_[static_cast<size_t>(transport)]++;
  clients++;
  if (transport != TransportKind::kTcp) same_host_clients++;
}

void Statistics::client_left(uint64_t client_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = clients_.find(client_id);
  if (it == clients_.end()) return;
  clients_by_transport_[static_cast<size_t>(it->second.transport)]--;
  clients--;
  if (it->second.transport != TransportKind::kTcp) same_host_clients--;
  left_.push_back(client_id);
  if (left_.size() > kRememberedClients) {
    clients_.erase(left_.front());
    left_.pop_front();
  }
}

void Statistics::record_error(StatusCode code, uint64_t client_id, std::optional<uint32_t> layer) {
  errors++;
  const auto c = std::min(static_cast<size_t>(code), kStatusCodes - 1);
  std::lock_guard<std::mutex> lock(mutex_);
  errors_by_code_[c]++;
  if (const auto it = clients_.find(client_id); client_id != 0 && it != clients_.end()) {
    tenants_[it->second.tenant].errors[c]++;
  }
  if (layer && *layer < layers_.size()) layers_[*layer].errors[c]++;
}

size_t Statistics::class_index(LatencyClass latency) {
  return latency == LatencyClass::kInferenceDecode ? 0 : latency == LatencyClass::kInferencePrefill ? 1 : 2;
}

void Statistics::record_batch(uint32_t layer_id, bool backward, const std::vector<BatchCall>& calls, bool answered,
                              Clock::time_point started, Clock::time_point computed, Clock::time_point finished) {
  using std::chrono::duration_cast;
  using std::chrono::nanoseconds;
  compute_nanos += duration_cast<nanoseconds>(finished - started).count();
  deliver_nanos += duration_cast<nanoseconds>(finished - computed).count();
  std::lock_guard<std::mutex> lock(mutex_);
  auto& c = layers_[layer_id];
  c.batches++;
  (backward ? c.backward_batches : c.forward_batches)++;
  int64_t batch_tokens = 0;
  for (const auto& call : calls) {
    const auto tokens = static_cast<uint64_t>(call.tokens);
    c.requests++;
    c.tokens += tokens;
    c.wait_seconds += call.wait_seconds;
    auto& latency = classes_[class_index(call.latency)];
    latency.requests++;
    latency.tokens += tokens;
    latency.wait_seconds += call.wait_seconds;
    wait_seconds_.add(call.wait_seconds);
    batch_tokens += call.tokens;
    if (!answered) continue;
    if (const auto it = clients_.find(call.client_id); it != clients_.end()) {
      auto& tenant = tenants_[it->second.tenant];
      tenant.requests++;
      tenant.tokens += tokens;
    }
  }
  batch_requests_.add(static_cast<double>(calls.size()));
  batch_tokens_.add(static_cast<double>(batch_tokens));
  c.compute_seconds += std::chrono::duration<double>(finished - started).count();
  max_batch_requests_ = std::max<uint64_t>(max_batch_requests_, calls.size());
}

void Statistics::record_ahead(uint64_t client_id, LatencyClass latency,
                              const std::vector<std::pair<uint32_t, int64_t>>& calls, bool together) {
  uint64_t total = 0;
  for (const auto& [layer_id, tokens] : calls) total += static_cast<uint64_t>(tokens);
  requests += calls.size();
  tokens += total;
  replayed_calls += calls.size();
  ahead_calls += calls.size();
  if (together) together_calls += calls.size();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [layer_id, call_tokens] : calls) {
    auto& c = layers_[layer_id];
    c.requests++;
    c.tokens += static_cast<uint64_t>(call_tokens);
  }
  auto& counted = classes_[class_index(latency)];
  counted.requests += calls.size();
  counted.tokens += total;
  if (const auto it = clients_.find(client_id); it != clients_.end()) {
    auto& tenant = tenants_[it->second.tenant];
    tenant.requests += calls.size();
    tenant.tokens += total;
  }
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
  s.set_ahead_calls(ahead_calls);
  s.set_together_calls(together_calls);
  s.set_yielding_calls(yielding_calls);
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

MetricsSnapshot Statistics::metrics() const {
  MetricsSnapshot m;
  m.uptime_seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  m.requests = requests;
  m.tokens = tokens;
  m.direct_calls = direct_calls;
  m.concurrent_calls = concurrent_calls;
  m.replayed_calls = replayed_calls;
  m.ahead_calls = ahead_calls;
  m.together_calls = together_calls;
  m.yielding_calls = yielding_calls;
  m.compute_seconds = compute_nanos * 1e-9;
  m.deliver_seconds = deliver_nanos * 1e-9;
  m.queued_calls = queue_depth;
  m.queued_tokens = queued_tokens;
  std::lock_guard<std::mutex> lock(mutex_);
  m.errors = errors_by_code_;
  for (const auto kind : {TransportKind::kTcp, TransportKind::kShm, TransportKind::kCudaIpc, TransportKind::kNccl}) {
    m.clients_by_transport[transport_name(kind)] = clients_by_transport_[static_cast<size_t>(kind)];
  }
  for (size_t id = 0; id < layers_.size(); ++id) {
    const auto& c = layers_[id];
    uint64_t errors = 0;
    for (const auto e : c.errors) errors += e;
    if (c.requests == 0 && errors == 0) continue;
    m.layers.push_back({model_.layer(static_cast<uint32_t>(id)).name, c.requests, c.tokens, c.forward_batches,
                        c.backward_batches, c.compute_seconds, c.errors});
  }
  m.tenants = tenants_;
  for (const auto latency : kClasses) {
    const auto& c = classes_[class_index(latency)];
    m.classes.push_back({kClassNames[class_index(latency)], c.requests, c.tokens});
  }
  m.batch_requests = batch_requests_;
  m.batch_tokens = batch_tokens_;
  m.wait_seconds = wait_seconds_;
  return m;
}

void Statistics::log() const {
  const auto s = snapshot();
  const double uptime = std::max(s.uptime_seconds(), 1e-9);
  spdlog::info(
      "stats ({}): {} clients, {} requests in {} batches ({:.2f} requests/batch, max {}), {} errors, {} tokens "
      "({:.0f} tokens/s), {:.3f} s computing, mean wait {:.1f} us, queue depth {}",
      s.policy(), s.clients(), s.requests(), s.batches(), s.batches() ? double(s.requests()) / s.batches() : 0.0,
      s.max_batch_requests(), s.errors(), s.tokens(), s.tokens() / uptime, s.compute_seconds(),
      s.requests() ? 1e6 * s.wait_seconds() / s.requests() : 0.0, s.queue_depth());
}

}  // namespace symbiosis
