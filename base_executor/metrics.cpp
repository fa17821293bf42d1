#include "base_executor/metrics.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <thread>

#ifdef SYMBIOSIS_WITH_METRICS
#include <httplib.h>
#endif
#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace symbiosis {
namespace {

bool valid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    const size_t length = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (length == 0 || i + length > text.size()) return false;
    for (size_t k = 1; k < length; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xc0) != 0x80) return false;
    }
    i += length;
  }
  return true;
}

// A label value as the text format takes it. Tenant names are a peer's bytes ([Untrusted input]):
// control characters, and every byte past ASCII of a name that is no UTF-8, show as '?'.
std::string escaped(std::string_view value) {
  const bool utf8 = valid_utf8(value);
  std::string out;
  for (const char ch : value) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == '\\' || ch == '"') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f || (c >= 0x80 && !utf8)) {
      out += '?';
    } else {
      out += ch;
    }
  }
  return out;
}

std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", value);
  return text;
}

// Appends metric families: a header once, then samples.
class Writer {
 public:
  void family(const char* name, const char* type, const char* help) {
    text_ += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& name, const std::string& labels, double value) {
    text_ += name;
    if (!labels.empty()) text_ += "{" + labels + "}";
    text_ += " " + number(value) + "\n";
  }
  // A family of one sample.
  void single(const char* name, const char* type, const char* help, double value) {
    family(name, type, help);
    sample(name, "", value);
  }
  // A family with a sample for each item (a layer, a tenant), labelled `label` with its name.
  template <typename Item, typename Value>
  void each(const char* name, const char* type, const char* help, const char* label, const std::vector<Item>& items,
            Value value) {
    family(name, type, help);
    for (const auto& item : items) sample(name, std::string(label) + "=\"" + escaped(item.name) + "\"", value(item));
  }
  // A counter family of each item's errors by code (the codes it had).
  template <typename Item>
  void errors_of_each(const char* name, const char* help, const char* label, const std::vector<Item>& items) {
    family(name, "counter", help);
    for (const auto& item : items) {
      for (size_t code = 1; code < kStatusCodes; ++code) {
        if (item.errors[code] == 0) continue;
        sample(name, std::string(label) + "=\"" + escaped(item.name) + "\",code=\"" + status_code_name(code) + "\"",
               static_cast<double>(item.errors[code]));
      }
    }
  }
  void histogram(const char* name, const char* help, const Histogram& h) {
    family(name, "histogram", help);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.counts.size(); ++i) {
      cumulative += h.counts[i];
      sample(std::string(name) + "_bucket", "le=\"" + (i < h.bounds.size() ? number(h.bounds[i]) : "+Inf") + "\"",
             static_cast<double>(cumulative));
    }
    sample(std::string(name) + "_sum", "", h.sum);
    sample(std::string(name) + "_count", "", static_cast<double>(h.count));
  }
  std::string take() { return std::move(text_); }

 private:
  std::string text_;
};

uint64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

double count(uint64_t value) { return static_cast<double>(value); }

}  // namespace

std::string prometheus_text(const MetricsSnapshot& m, const MetricsGauges& gauges) {
  using Layer = MetricsSnapshot::Layer;
  using Tenant = MetricsSnapshot::Tenant;
  using Class = MetricsSnapshot::LatencyClassFigures;
  Writer w;
  w.single("symbiosis_uptime_seconds", "gauge", "Seconds since the executor started.", m.uptime_seconds);
  w.family("symbiosis_clients", "gauge", "Clients connected now, by transport.");
  for (const auto& [transport, clients] : m.clients_by_transport) {
    w.sample("symbiosis_clients", "transport=\"" + escaped(transport) + "\"", count(clients));
  }
  w.single("symbiosis_requests_total", "counter", "Calls answered with a result.", count(m.requests));
  w.single("symbiosis_tokens_total", "counter", "Tokens of the calls answered with a result.", count(m.tokens));
  w.family("symbiosis_errors_total", "counter", "Errors answered to peers, by code.");
  for (size_t code = 1; code < kStatusCodes; ++code) {
    w.sample("symbiosis_errors_total", std::string("code=\"") + status_code_name(code) + "\"", count(m.errors[code]));
  }
  w.single("symbiosis_compute_seconds_total", "counter", "Seconds the scheduler spent running batches (busy time).",
           m.compute_seconds);
  w.single("symbiosis_deliver_seconds_total", "counter", "Of the compute seconds, those spent delivering results.",
           m.deliver_seconds);
  w.single("symbiosis_direct_calls_total", "counter", "Calls whose operands lay in a client's shared segment.",
           count(m.direct_calls));
  w.single("symbiosis_concurrent_calls_total", "counter", "Calls run alone on their client's compute stream.",
           count(m.concurrent_calls));
  w.single("symbiosis_replayed_calls_total", "counter", "Captured calls whose GEMM was launched as a graph.",
           count(m.replayed_calls));
  w.single("symbiosis_ahead_calls_total", "counter",
           "Of the replayed calls, those launched ahead of their inputs (steps launched ahead).", count(m.ahead_calls));
  w.single("symbiosis_together_calls_total", "counter",
           "Of the calls launched ahead, those launched with other clients' (runs launched together).",
           count(m.together_calls));
  w.single("symbiosis_yielding_calls_total", "counter",
           "Fine-tuning calls computed on part of the GPU while tenants decoded (--finetune-sm-percent).",
           count(m.yielding_calls));

  w.each("symbiosis_class_requests_total", "counter", "Calls batched, by latency class.", "class", m.classes,
         [](const Class& c) { return count(c.requests); });
  w.each("symbiosis_class_tokens_total", "counter", "Tokens of the calls batched, by latency class.", "class",
         m.classes, [](const Class& c) { return count(c.tokens); });

  w.each("symbiosis_layer_requests_total", "counter", "Calls batched, by layer.", "layer", m.layers,
         [](const Layer& l) { return count(l.requests); });
  w.each("symbiosis_layer_tokens_total", "counter", "Tokens of the calls batched, by layer.", "layer", m.layers,
         [](const Layer& l) { return count(l.tokens); });
  w.family("symbiosis_layer_batches_total", "counter", "Batches run, by layer and op (forward, backward).");
  for (const auto& l : m.layers) {
    w.sample("symbiosis_layer_batches_total", "layer=\"" + escaped(l.name) + "\",op=\"forward\"",
             count(l.forward_batches));
    w.sample("symbiosis_layer_batches_total", "layer=\"" + escaped(l.name) + "\",op=\"backward\"",
             count(l.backward_batches));
  }
  w.each("symbiosis_layer_compute_seconds_total", "counter", "Seconds spent running the layer's batches.", "layer",
         m.layers, [](const Layer& l) { return l.compute_seconds; });
  w.errors_of_each("symbiosis_layer_errors_total", "Calls of the layer answered with an error, by code.", "layer",
                   m.layers);

  w.each("symbiosis_tenant_requests_total", "counter", "Calls answered with a result, by tenant.", "tenant", m.tenants,
         [](const Tenant& t) { return count(t.requests); });
  w.each("symbiosis_tenant_tokens_total", "counter", "Tokens of the calls answered with a result, by tenant.", "tenant",
         m.tenants, [](const Tenant& t) { return count(t.tokens); });
  w.errors_of_each("symbiosis_tenant_errors_total", "Errors answered to the tenant's clients, by code.", "tenant",
                   m.tenants);

  w.histogram("symbiosis_batch_requests", "Calls per batch.", m.batch_requests);
  w.histogram("symbiosis_batch_tokens", "Tokens per batch.", m.batch_tokens);
  w.histogram("symbiosis_wait_seconds", "Seconds each call waited from its arrival to its batch's start.",
              m.wait_seconds);

  w.single("symbiosis_queued_calls", "gauge", "Calls waiting to be batched.", count(m.queued_calls));
  w.single("symbiosis_queued_tokens", "gauge", "Tokens of the calls waiting to be batched.",
           static_cast<double>(m.queued_tokens));
  w.single("symbiosis_max_queued_tokens", "gauge", "The limit on queued tokens (--max-queued-tokens).",
           static_cast<double>(gauges.max_queued_tokens));
  w.single("symbiosis_buffer_bytes", "gauge", "Shared memory held for clients: control segments and payload buffers.",
           count(gauges.buffer_bytes));
  w.single("symbiosis_max_buffer_bytes", "gauge", "The limit on it (--max-buffer-bytes).",
           count(gauges.max_buffer_bytes));
  w.single("symbiosis_max_clients", "gauge", "The limit on clients connected at once (--max-clients).",
           count(gauges.max_clients));
  w.single("symbiosis_resident_bytes", "gauge", "The executor process's resident memory.", count(resident_bytes()));
#ifdef SYMBIOSIS_WITH_CUDA
  if (gauges.gpu >= 0) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(gauges.gpu));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const std::string device = "device=\"cuda:" + std::to_string(gauges.gpu) + "\"";
    w.family("symbiosis_gpu_allocated_bytes", "gauge", "GPU memory in LibTorch's tensors (the caching allocator).");
    w.sample("symbiosis_gpu_allocated_bytes", device, count(stats.allocated_bytes[all].current));
    w.family("symbiosis_gpu_reserved_bytes", "gauge", "GPU memory the caching allocator holds from CUDA.");
    w.sample("symbiosis_gpu_reserved_bytes", device, count(stats.reserved_bytes[all].current));
  }
#endif
  return w.take();
}

MetricsAddress parse_metrics_listen(const std::string& listen) {
  const auto what = "executor option --metrics-listen '";
  const auto expected = " (expected HOST:PORT, e.g. 127.0.0.1:9100; port 0 picks a free one)";
  const auto colon = listen.rfind(':');
  TORCH_CHECK(colon != std::string::npos && colon != 0, what, listen, "' names no host and port", expected);
  MetricsAddress address;
  address.host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  TORCH_CHECK(!port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos &&
                  std::stoi(port) <= 65535,
              what, listen, "': port '", port, "' is not a number from 0 to 65535", expected);
  address.port = std::stoi(port);
  auto& host = address.host;
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  TORCH_CHECK(host.find("://") == std::string::npos && host.find('/') == std::string::npos, what, listen,
              "' is an address for HTTP, without a scheme or path", expected);
  address.loopback = host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
  return address;
}

#ifdef SYMBIOSIS_WITH_METRICS

struct MetricsServer::Impl {
  httplib::Server server;
  std::thread thread;
};

MetricsServer::MetricsServer(const std::string& listen, std::function<std::string()> render)
    : impl_(std::make_unique<Impl>()) {
  const auto address = parse_metrics_listen(listen);
  const std::string& host = address.host;
  const int asked = address.port;
  auto& server = impl_->server;
  server.new_task_queue = [] { return new httplib::ThreadPool(2); };  // scrapes are rare and small
  server.Get("/metrics", [render](const httplib::Request&, httplib::Response& response) {
    response.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.set_error_handler([](const httplib::Request&, httplib::Response& response) {
    response.set_content("symbiosis-executor serves its metrics at /metrics\n", "text/plain");
  });
  const int port = asked == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, asked) ? asked : -1);
  TORCH_CHECK(port > 0, "executor option --metrics-listen ", listen,
              ": cannot listen there (is the port taken, or the host not this machine's?)");
  url_ = "http://" + (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port) +
         "/metrics";
  impl_->thread = std::thread([this] { impl_->server.listen_after_bind(); });
  // stop() ends only a server that runs: the destructor must not come before it does.
  while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

MetricsServer::~MetricsServer() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

#else

struct MetricsServer::Impl {};

MetricsServer::MetricsServer(const std::string& listen, std::function<std::string()>) {
  TORCH_CHECK(false, "executor option --metrics-listen ", listen,
              ": this executor was built without cpp-httplib (Debian's libcpp-httplib-dev), so it serves no metrics; "
              "install it and build again");
}

MetricsServer::~MetricsServer() = default;

#endif

}  // namespace symbiosis
