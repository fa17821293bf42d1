#pragma once
// [Metrics]
// The executor's Prometheus endpoint (--metrics-listen HOST:PORT; docs/operating.md, Metrics): GET
// /metrics answers the statistics (statistics.h) in Prometheus' text format 0.0.4, made anew for
// each scrape: per-layer and per-tenant requests, tokens and errors by code, histograms of batch
// sizes and of the time calls waited for their batch, compute time, clients by transport, the
// [Overload] figures and their limits, and memory (resident; the GPU's caching allocator on CUDA).
// Counters count from the executor's start. Served over plain HTTP (Debian's cpp-httplib) by a
// thread pool of its own, so a scrape never waits on the front door or the scheduler; it has no
// authentication, so ExecutorOptions::validate refuses an address beyond loopback unless --insecure.
// `symbiosis-ctl top` (tools/ctl.cpp) reads it.
// Thread safety: construct and destroy on one thread; the server's threads only read statistics.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "base_executor/statistics.h"

namespace symbiosis {

// What the metrics show beyond the statistics, read at each scrape.
struct MetricsGauges {
  int64_t max_queued_tokens = 0;
  uint64_t buffer_bytes = 0, max_buffer_bytes = 0;
  uint64_t max_clients = 0;
  int gpu = -1;  // the executor's CUDA device index; -1: on the CPU
};

// The Prometheus text of `snapshot` and `gauges`, with the process's memory read now.
std::string prometheus_text(const MetricsSnapshot& snapshot, const MetricsGauges& gauges);

// --metrics-listen, read: HOST (IPv6 without its brackets), PORT (0: a free one), and whether HOST is
// this host's loopback only (127.0.0.0/8, localhost, [::1]).
struct MetricsAddress {
  std::string host;
  int port = 0;
  bool loopback = false;
};
// `listen` ("HOST:PORT") read; throws (TORCH_CHECK) naming the option, the value and the expected form
// when it is not one.
MetricsAddress parse_metrics_listen(const std::string& listen);

class MetricsServer {
 public:
  // Binds `listen` (HOST:PORT; port 0 picks a free one) and serves what `render` returns on
  // threads of its own; throws naming the address when it cannot.
  MetricsServer(const std::string& listen, std::function<std::string()> render);
  ~MetricsServer();  // stops serving and joins its threads
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  // http://HOST:PORT/metrics, with the port bound.
  const std::string& url() const { return url_; }

 private:
  struct Impl;  // the HTTP library's server and thread
  std::unique_ptr<Impl> impl_;
  std::string url_;
};

}  // namespace symbiosis
