// symbiosis-ctl: asks a running executor about itself, and makes keys for it.
//   symbiosis-ctl stats --executor tcp://HOST:PORT [--json] [--executor-key FILE --key FILE]
//   symbiosis-ctl trace start --out PATH --executor tcp://HOST:PORT   the executor traces its batches
//   symbiosis-ctl trace stop --executor tcp://HOST:PORT                 ... and writes PATH ([Traces])
//   symbiosis-ctl keygen NAME      writes NAME.key (the pair; keep it secret) and NAME.pub
//   symbiosis-ctl top --metrics http://HOST:PORT [--interval S] [--once]
//                                  per-tenant and per-layer rates from the executor's metrics
// ([Admission keys] in transport/keys.h; [Metrics] in base_executor/metrics.h; [Traces] in
// base_executor/tracing.h; docs/operating.md, docs/tracing.md.)
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>
#include <google/protobuf/util/json_util.h>

#ifdef SYMBIOSIS_WITH_METRICS
#include <httplib.h>
#endif

#include <c10/util/Exception.h>

#include "transport/client_transport.h"
#include "transport/keys.h"

namespace {

void print_table(const symbiosis::proto::Stats& s) {
  const double uptime = std::max(s.uptime_seconds(), 1e-9);
  std::printf("policy %s, up %.1f s, %lu clients, queue depth %lu\n", s.policy().c_str(), s.uptime_seconds(),
              static_cast<unsigned long>(s.clients()), static_cast<unsigned long>(s.queue_depth()));
  std::printf("requests %lu in %lu batches (mean %.2f, max %lu), errors %lu, tokens %lu (%.0f tokens/s)\n",
              static_cast<unsigned long>(s.requests()), static_cast<unsigned long>(s.batches()),
              s.batches() ? double(s.requests()) / s.batches() : 0.0,
              static_cast<unsigned long>(s.max_batch_requests()), static_cast<unsigned long>(s.errors()),
              static_cast<unsigned long>(s.tokens()), s.tokens() / uptime);
  std::printf("computing %.3f s (delivering results and replying %.3f s of it), mean wait per request %.1f us\n",
              s.compute_seconds(), s.deliver_seconds(), s.requests() ? 1e6 * s.wait_seconds() / s.requests() : 0.0);
  std::printf(
      "calls on clients' own memory %lu, run alone on their client's stream %lu, replayed as graphs %lu (launched "
      "ahead of their inputs %lu, of which with other clients' %lu); fine-tuning calls on part of the GPU while "
      "tenants decoded %lu\n\n",
      static_cast<unsigned long>(s.direct_calls()), static_cast<unsigned long>(s.concurrent_calls()),
      static_cast<unsigned long>(s.replayed_calls()), static_cast<unsigned long>(s.ahead_calls()),
      static_cast<unsigned long>(s.together_calls()), static_cast<unsigned long>(s.yielding_calls()));
  for (const auto& c : s.classes()) {
    std::printf("%-18s %10lu requests %12lu tokens   mean wait %10.1f us\n",
                symbiosis::proto::LatencyClass_Name(c.latency_class()).c_str(),
                static_cast<unsigned long>(c.requests()), static_cast<unsigned long>(c.tokens()),
                c.requests() ? 1e6 * c.wait_seconds() / c.requests() : 0.0);
  }
  if (s.classes_size() > 0) std::printf("\n");
  std::printf("%-5s %-48s %10s %10s %9s %12s %12s\n", "id", "layer", "requests", "tokens", "batches", "compute ms",
              "mean wait us");
  for (const auto& l : s.layers()) {
    std::printf("%-5u %-48s %10lu %10lu %9lu %12.2f %12.1f\n", l.layer_id(), l.name().c_str(),
                static_cast<unsigned long>(l.requests()), static_cast<unsigned long>(l.tokens()),
                static_cast<unsigned long>(l.batches()), 1e3 * l.compute_seconds(),
                l.requests() ? 1e6 * l.wait_seconds() / l.requests() : 0.0);
  }
}

// [Metrics]: `top` reads the executor's Prometheus text. One scrape: each sample by metric name,
// then by its labels as written ("tenant=\"alice\"").
using Samples = std::map<std::string, std::map<std::string, double>>;

Samples parse_metrics(const std::string& text) {
  Samples samples;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const auto brace = line.find('{');
    const auto space = line.rfind(' ');
    if (space == std::string::npos) continue;
    std::string name, labels;
    if (brace != std::string::npos && brace < space) {
      const auto close = line.rfind('}', space);
      if (close == std::string::npos) continue;
      name = line.substr(0, brace);
      labels = line.substr(brace + 1, close - brace - 1);
    } else {
      name = line.substr(0, space);
    }
    try {
      samples[name][labels] = std::stod(line.substr(space + 1));
    } catch (const std::exception&) {
      // Not a sample of ours (a value such as NaN written otherwise): skipped.
    }
  }
  return samples;
}

// The value of `label` in labels as written, e.g. tenant in `tenant="alice",code="NOT_FOUND"`.
std::string label_value(const std::string& labels, const std::string& label) {
  const auto at = labels.find(label + "=\"");
  if (at == std::string::npos) return "";
  std::string value;
  for (size_t i = at + label.size() + 2; i < labels.size() && labels[i] != '"'; ++i) {
    if (labels[i] == '\\' && i + 1 < labels.size()) ++i;
    value += labels[i];
  }
  return value;
}

double value_of(const Samples& s, const std::string& name, const std::string& labels = "") {
  const auto metric = s.find(name);
  if (metric == s.end()) return 0;
  const auto sample = metric->second.find(labels);
  return sample == metric->second.end() ? 0 : sample->second;
}

// Each key of `label`'s values among `name`'s samples with the sum of their values (over other labels).
std::map<std::string, double> by_label(const Samples& s, const std::string& name, const std::string& label) {
  std::map<std::string, double> values;
  const auto metric = s.find(name);
  if (metric == s.end()) return values;
  for (const auto& [labels, value] : metric->second) values[label_value(labels, label)] += value;
  return values;
}

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    unit++;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

// One screen of `top`: totals from `now`, rates over the `seconds` since `before`.
void print_top(const std::string& url, const Samples& before, const Samples& now, double seconds) {
  auto rate = [&](double now_value, double before_value) {
    return seconds > 0 ? std::max(0.0, now_value - before_value) / seconds : 0.0;
  };
  std::printf("executor metrics %s, up %.1f s, clients:", url.c_str(), value_of(now, "symbiosis_uptime_seconds"));
  for (const auto& [transport, count] : by_label(now, "symbiosis_clients", "transport")) {
    std::printf(" %s %.0f", transport.c_str(), count);
  }
  const double requests = value_of(now, "symbiosis_requests_total"), tokens = value_of(now, "symbiosis_tokens_total");
  const double busy =
      rate(value_of(now, "symbiosis_compute_seconds_total"), value_of(before, "symbiosis_compute_seconds_total"));
  std::printf(
      "\nrequests %.0f (%.1f/s), tokens %.0f (%.0f/s), compute busy %.0f%%, queued %.0f calls / %.0f tokens "
      "(limit %.0f)\n",
      requests, rate(requests, value_of(before, "symbiosis_requests_total")), tokens,
      rate(tokens, value_of(before, "symbiosis_tokens_total")), 100 * busy, value_of(now, "symbiosis_queued_calls"),
      value_of(now, "symbiosis_queued_tokens"), value_of(now, "symbiosis_max_queued_tokens"));
  std::printf("shared memory for clients %s of %s, resident %s",
              bytes_text(value_of(now, "symbiosis_buffer_bytes")).c_str(),
              bytes_text(value_of(now, "symbiosis_max_buffer_bytes")).c_str(),
              bytes_text(value_of(now, "symbiosis_resident_bytes")).c_str());
  for (const auto& [device, allocated] : by_label(now, "symbiosis_gpu_allocated_bytes", "device")) {
    std::printf(", %s allocated %s", device.c_str(), bytes_text(allocated).c_str());
  }
  std::printf("\nerrors:");
  bool any_error = false;
  for (const auto& [code, count] : by_label(now, "symbiosis_errors_total", "code")) {
    if (count == 0) continue;
    std::printf(" %s %.0f", code.c_str(), count);
    any_error = true;
  }
  std::printf("%s\n\n", any_error ? "" : " none");

  const auto tenant_errors = by_label(now, "symbiosis_tenant_errors_total", "tenant");
  const auto tenant_requests = by_label(now, "symbiosis_tenant_requests_total", "tenant");
  const auto tenant_tokens = by_label(now, "symbiosis_tenant_tokens_total", "tenant");
  const auto tenant_requests_before = by_label(before, "symbiosis_tenant_requests_total", "tenant");
  const auto tenant_tokens_before = by_label(before, "symbiosis_tenant_tokens_total", "tenant");
  auto at = [](const std::map<std::string, double>& values, const std::string& key) {
    const auto it = values.find(key);
    return it == values.end() ? 0.0 : it->second;
  };
  std::printf("%-32s %12s %10s %14s %12s %8s\n", "tenant", "requests", "req/s", "tokens", "tokens/s", "errors");
  for (const auto& [tenant, count] : tenant_requests) {
    std::printf("%-32s %12.0f %10.1f %14.0f %12.0f %8.0f\n", tenant.empty() ? "(unnamed)" : tenant.c_str(), count,
                rate(count, at(tenant_requests_before, tenant)), at(tenant_tokens, tenant),
                rate(at(tenant_tokens, tenant), at(tenant_tokens_before, tenant)), at(tenant_errors, tenant));
  }
  const auto layer_requests = by_label(now, "symbiosis_layer_requests_total", "layer");
  const auto layer_tokens = by_label(now, "symbiosis_layer_tokens_total", "layer");
  const auto layer_batches = by_label(now, "symbiosis_layer_batches_total", "layer");
  const auto layer_compute = by_label(now, "symbiosis_layer_compute_seconds_total", "layer");
  const auto layer_errors = by_label(now, "symbiosis_layer_errors_total", "layer");
  const auto layer_requests_before = by_label(before, "symbiosis_layer_requests_total", "layer");
  const auto layer_tokens_before = by_label(before, "symbiosis_layer_tokens_total", "layer");
  const auto layer_compute_before = by_label(before, "symbiosis_layer_compute_seconds_total", "layer");
  std::printf("\n%-44s %10s %9s %12s %11s %9s %8s %7s\n", "layer", "requests", "req/s", "tokens", "tokens/s", "batches",
              "busy %", "errors");
  for (const auto& [layer, count] : layer_requests) {
    std::printf("%-44s %10.0f %9.1f %12.0f %11.0f %9.0f %8.1f %7.0f\n", layer.c_str(), count,
                rate(count, at(layer_requests_before, layer)), at(layer_tokens, layer),
                rate(at(layer_tokens, layer), at(layer_tokens_before, layer)), at(layer_batches, layer),
                100 * rate(at(layer_compute, layer), at(layer_compute_before, layer)), at(layer_errors, layer));
  }
  std::fflush(stdout);
}

#ifdef SYMBIOSIS_WITH_METRICS
// The metrics text at `url` (http://HOST:PORT[/PATH], /metrics by default); throws naming the URL
// and what went wrong.
std::string scrape(const std::string& url) {
  if (url.rfind("http://", 0) != 0) {
    throw std::runtime_error("--metrics must be http://HOST:PORT (the executor's --metrics-listen), got '" + url + "'");
  }
  const auto path_at = url.find('/', 7);
  const std::string origin = url.substr(0, path_at);
  const std::string path = path_at == std::string::npos ? "/metrics" : url.substr(path_at);
  httplib::Client client(origin);
  client.set_connection_timeout(std::chrono::seconds(5));
  client.set_read_timeout(std::chrono::seconds(5));
  auto result = client.Get(path);
  if (!result) {
    throw std::runtime_error("cannot read the metrics at " + origin + path + ": " + httplib::to_string(result.error()) +
                             " (is the executor running with --metrics-listen, and is this its address?)");
  }
  if (result->status != 200) {
    throw std::runtime_error("the metrics at " + origin + path + " answered HTTP " + std::to_string(result->status));
  }
  return result->body;
}
#else
std::string scrape(const std::string&) {
  throw std::runtime_error("this symbiosis-ctl was built without cpp-httplib (Debian's libcpp-httplib-dev): no top");
}
#endif

// `top`: scrapes every `interval` seconds and shows totals and rates since the scrape before;
// `once`: one screen (two scrapes `interval` apart), then it returns.
int run_top(const std::string& url, double interval, bool once) {
  const bool terminal = ::isatty(STDOUT_FILENO) && !once;
  auto before = parse_metrics(scrape(url));
  auto taken = std::chrono::steady_clock::now();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::duration<double>(interval));
    auto now = parse_metrics(scrape(url));
    const auto at = std::chrono::steady_clock::now();
    if (terminal) std::printf("\x1b[H\x1b[2J");  // clear the screen, cursor home
    print_top(url, before, now, std::chrono::duration<double>(at - taken).count());
    if (once) return 0;
    before = std::move(now);
    taken = at;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"symbiosis-ctl: ask a running executor about itself"};
  app.require_subcommand(1);
  std::string endpoint = "tcp://127.0.0.1:5555";
  bool json = false;
  int timeout_ms = 5000;
  std::string executor_key, key_file, name;
  // The options of a request to the executor.
  const auto asks_the_executor = [&](CLI::App* command) {
    command->add_option("--executor", endpoint, "the executor's endpoint")->capture_default_str();
    command->add_option("--timeout", timeout_ms, "milliseconds to wait for the answer")->capture_default_str();
    command->add_option("--executor-key", executor_key, "an executor with keys: its public key (executor.pub)");
    command->add_option("--key", key_file, "an executor with keys: an operator's key pair (NAME.key)");
  };
  auto* stats = app.add_subcommand("stats", "batching and compute statistics, overall and per layer");
  asks_the_executor(stats);
  stats->add_flag("--json", json, "print JSON instead of a table");
  std::string action, trace_path;
  auto* trace = app.add_subcommand("trace",
                                   "start the executor's trace (a Chrome trace of its batches' host "
                                   "operations and GPU kernels), or stop it and have it written");
  asks_the_executor(trace);
  trace->add_option("action", action, "start or stop")->required()->check(CLI::IsMember({"start", "stop"}));
  trace->add_option("--out", trace_path, "start: the trace file to write, on the executor's host");
  auto* keygen = app.add_subcommand("keygen", "write a CURVE key pair: NAME.key (keep it secret) and NAME.pub");
  keygen->add_option("name", name, "path and name of the pair, e.g. keys/executor or alice")->required();
  std::string metrics_url = "http://127.0.0.1:9100";
  double interval = 2;
  bool once = false;
  auto* top = app.add_subcommand("top", "live per-tenant and per-layer rates from the executor's metrics endpoint");
  top->add_option("--metrics", metrics_url, "the executor's --metrics-listen, as http://HOST:PORT")
      ->capture_default_str();
  top->add_option("--interval", interval, "seconds between refreshes")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 3600.0));
  top->add_flag("--once", once, "print one screen (rates over one interval) and exit");
  CLI11_PARSE(app, argc, argv);
  std::optional<symbiosis::proto::Stats> s;
  try {
    if (top->parsed()) return run_top(metrics_url, interval, once);
    if (keygen->parsed()) {
      symbiosis::keys::write(name, symbiosis::keys::generate());
      std::cout << "wrote " << name << ".key (secret: keep it to its owner) and " << name << ".pub\n";
      return 0;
    }
    if (executor_key.empty() != key_file.empty()) throw std::runtime_error("--executor-key and --key go together");
    symbiosis::ClientKeys keys;
    if (!executor_key.empty()) {
      keys = {symbiosis::keys::public_key(executor_key), symbiosis::keys::read(key_file, /*need_secret=*/true)};
    }
    if (trace->parsed()) {
      if (action == "start" && trace_path.empty()) throw std::runtime_error("trace start needs --out PATH");
      const auto written = symbiosis::request_trace(endpoint, timeout_ms, action == "start", trace_path, keys);
      if (action == "start") {
        std::cout << "tracing; `symbiosis-ctl trace stop` writes " << written.path() << "\n";
      } else {
        std::cout << "wrote " << written.path() << " (" << written.batches() << " batches)\n";
      }
      return 0;
    }
    s = symbiosis::request_stats(endpoint, timeout_ms, keys);
  } catch (const c10::Error& e) {
    std::cerr << "symbiosis-ctl: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-ctl: " << e.what() << "\n";
    return 1;
  }
  if (json) {
    std::string text;
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(*s, &text, options);
    std::cout << text << std::endl;
  } else {
    print_table(*s);
  }
  return 0;
}
