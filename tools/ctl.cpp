// symbiosis-ctl: asks a running executor about itself, and makes keys for it.
//   symbiosis-ctl stats --executor tcp://HOST:PORT [--json] [--executor-key FILE --key FILE]
//   symbiosis-ctl keygen NAME      writes NAME.key (the pair; keep it secret) and NAME.pub
// ([Admission keys] in transport/keys.h; docs/operating.md.)
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <google/protobuf/util/json_util.h>

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
              s.batches() ? double(s.requests()) / s.batches() : 0.0, static_cast<unsigned long>(s.max_batch_requests()),
              static_cast<unsigned long>(s.errors()), static_cast<unsigned long>(s.tokens()), s.tokens() / uptime);
  std::printf("computing %.3f s (delivering results and replying %.3f s of it), mean wait per request %.1f us\n",
              s.compute_seconds(), s.deliver_seconds(), s.requests() ? 1e6 * s.wait_seconds() / s.requests() : 0.0);
  std::printf("calls on clients' own memory %lu, run alone on their client's stream %lu, replayed as graphs %lu\n\n",
              static_cast<unsigned long>(s.direct_calls()), static_cast<unsigned long>(s.concurrent_calls()),
              static_cast<unsigned long>(s.replayed_calls()));
  for (const auto& c : s.classes()) {
    std::printf("%-18s %10lu requests %12lu tokens   mean wait %10.1f us\n",
                symbiosis::proto::LatencyClass_Name(c.latency_class()).c_str(), static_cast<unsigned long>(c.requests()),
                static_cast<unsigned long>(c.tokens()), c.requests() ? 1e6 * c.wait_seconds() / c.requests() : 0.0);
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"symbiosis-ctl: ask a running executor about itself"};
  app.require_subcommand(1);
  std::string endpoint = "tcp://127.0.0.1:5555";
  bool json = false;
  int timeout_ms = 5000;
  std::string executor_key, key_file, name;
  auto* stats = app.add_subcommand("stats", "batching and compute statistics, overall and per layer");
  stats->add_option("--executor", endpoint, "the executor's endpoint")->capture_default_str();
  stats->add_option("--timeout", timeout_ms, "milliseconds to wait for the answer")->capture_default_str();
  stats->add_flag("--json", json, "print JSON instead of a table");
  stats->add_option("--executor-key", executor_key, "an executor with keys: its public key (executor.pub)");
  stats->add_option("--key", key_file, "an executor with keys: an operator's key pair (NAME.key)");
  auto* keygen = app.add_subcommand("keygen", "write a CURVE key pair: NAME.key (keep it secret) and NAME.pub");
  keygen->add_option("name", name, "path and name of the pair, e.g. keys/executor or alice")->required();
  CLI11_PARSE(app, argc, argv);
  std::optional<symbiosis::proto::Stats> s;
  try {
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
