#pragma once
// What the example programs share: the flags that say which executor a tenant uses, as whom and
// how privately (--executor, --executor-key, --key, --tenant, --connect-timeout-ms, --reconnect-ms,
// --mask, --mask-effects-here, --noise-ratio, and
// --monolithic where the program offers it), and the connection options they describe; and how a
// program reports the error it ends with, or the crash.
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <exception>
#include <iostream>
#include <string>

#include <symbiosis/client.h>

#include "common/checkpoint.h"

namespace symbiosis::examples {

// --device as the program was given it: "cpu", or "cuda:N" where this host has that GPU; refused
// naming the flag (as the executor refuses its own) rather than with the driver's message.
inline at::Device require_device(const std::string& name) {
  const at::Device device(name);
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  TORCH_CHECK(!device.is_cuda() || gpus > 0, "--device ", name, ": no CUDA GPU is available here");
  TORCH_CHECK(!device.is_cuda() || device.index() < gpus, "--device ", name, ": this host has ", gpus,
              " CUDA GPU(s), cuda:0 to cuda:", gpus - 1);
  return device;
}

struct TenantFlags {
  std::string executor = "tcp://127.0.0.1:5555";
  std::string tenant;
  std::string executor_key, key_file;  // [Admission keys]: an executor started with --keys
  bool mask = false;                   // [Noise masking] (privacy/noise_mask.h)
  bool mask_effects_here = false;      // ... with the noise's effects computed from the model's checkpoint here
  double noise_ratio = PrivacyOptions{}.noise_ratio;
  int connect_timeout_ms = ClientOptions{}.connect_timeout_ms;
  int reconnect_ms = ClientOptions{}.reconnect_ms;  // [Executor restart] (client_runtime/client.cpp)
  bool monolithic = false;
};

inline void add_tenant_flags(CLI::App& app, TenantFlags& flags, bool monolithic_flag) {
  app.add_option("--executor", flags.executor, "executor endpoint")->capture_default_str();
  app.add_option("--executor-key", flags.executor_key,
                 "an executor started with --keys: its public key (executor.pub)");
  app.add_option("--key", flags.key_file, "an executor started with --keys: this tenant's key pair (NAME.key)");
  app.add_option("--tenant", flags.tenant, "name shown in the executor's log")->capture_default_str();
  app.add_option("--connect-timeout-ms", flags.connect_timeout_ms,
                 "how long to wait for the executor's answer to the handshake")
      ->capture_default_str();
  app.add_option("--reconnect-ms", flags.reconnect_ms,
                 "how long to try to connect again to an executor that stopped or restarted (0: never)")
      ->capture_default_str();
  app.add_flag("--mask", flags.mask,
               "mask activations and gradients with noise only this process knows (docs/privacy.md)");
  app.add_option("--noise-ratio", flags.noise_ratio, "with --mask: the noise's norm against each call's input's")
      ->capture_default_str();
  app.add_flag(
      "--mask-effects-here", flags.mask_effects_here,
      "mask, and compute the noise's effects here from --model's weights: the executor never sees a noise row");
  if (monolithic_flag)
    app.add_flag("--monolithic", flags.monolithic, "compute the base layers in this process instead");
}

// A client of the executor the flags name, as their tenant, of the checkpoint's model.
inline ClientOptions client_options(const TenantFlags& flags, const Checkpoint& checkpoint) {
  ClientOptions options;
  options.endpoint = flags.executor;
  options.tenant = flags.tenant;
  options.executor_key = flags.executor_key;
  options.key_file = flags.key_file;
  options.connect_timeout_ms = flags.connect_timeout_ms;
  options.reconnect_ms = flags.reconnect_ms;
  options.expected_model_hash = checkpoint.model_hash();
  options.privacy.mask = flags.mask || flags.mask_effects_here;
  options.privacy.noise_ratio = flags.noise_ratio;
  if (flags.mask_effects_here) options.privacy.effects_checkpoint = checkpoint.dir().string();
  return options;
}

// [Crash report]: a tenant that crashes (a segmentation fault, say) prints where, on stderr, before
// it dies of the signal: the frames as "library(+offset)", which addr2line resolves against the
// build the binaries came from.
inline void report_crashes() {
  static const auto handler = [](int signal) {
    static const char kHeader[] = "crashed; the stack:\n";
    [[maybe_unused]] auto written = ::write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
    void* frames[64];
    ::backtrace_symbols_fd(frames, ::backtrace(frames, 64), STDERR_FILENO);
    std::signal(signal, SIG_DFL);
    std::raise(signal);
  };
  void* first[1];
  ::backtrace(first, 1);  // loads libgcc's unwinder now: a handler must not have to
  for (const int signal : {SIGSEGV, SIGBUS, SIGILL, SIGFPE}) std::signal(signal, +handler);
}

// The program's body, whose error is printed as "[tenant] error: ..." with exit status 2.
template <typename Body>
int report_errors(const TenantFlags& flags, Body body) {
  report_crashes();
  try {
    return body();
  } catch (const c10::Error& e) {
    std::cerr << "[" << flags.tenant << "] error: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "[" << flags.tenant << "] error: " << e.what() << std::endl;
  }
  return 2;
}

}  // namespace symbiosis::examples
