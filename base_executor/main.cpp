// symbiosis-executor: serves the base layers of one Hugging Face checkpoint to many clients.
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <sys/prctl.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "base_executor/executor.h"
#include "base_executor/launch.h"
#include "common/checkpoint.h"

int main(int argc, char** argv) {
  // [Hardware queues] (client_runtime/training/step_graph.cpp): the runs launched ahead for its
  // tenants wait on the GPU for their flags, each on a stream of its own; with CUDA's default 8
  // hardware queues, streams share them, and a wait would hold back whatever shares its queue. 32
  // is CUDA's most; an operator's setting stays.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  symbiosis::ExecutorOptions options;
  std::string model_dir, keys_dir, dtype, log_level = "info";
  CLI::App app{"symbiosis-executor: serves the frozen base layers of one model to many clients"};
  app.add_option("--model", model_dir, "Hugging Face checkpoint directory (config.json + safetensors)")->required();
  app.add_option("--listen", options.listen, "ZeroMQ endpoint to bind; tcp://HOST:* picks a free port")
      ->capture_default_str();
  app.add_option("--device", options.device,
                 "where the base layers live: cpu or cuda:N (clients on the same GPU should run under NVIDIA MPS)")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "compute dtype: fp32, bf16 or fp16 (default: the checkpoint's)");
  app.add_option("--layer-pattern", options.layers.pattern,
                 "regex over module names choosing the base layers (2-D .weight tensors)")
      ->capture_default_str();
  app.add_option("--mlp-blocks", options.layers.mlp_blocks,
                 "serve each gated MLP whole too, one call for a decoding tenant whose MLP has no adapter "
                 "([MLP blocks] in base_executor/base_model.h; true/false)")
      ->capture_default_str();
  app.add_option("--mlp-bridges", options.layers.mlp_bridges,
                 "with --mlp-blocks, also serve each block but the last as a bridge into the next layer: its norms, "
                 "residual and q, k, v too, one call where a decoding tenant made two ([MLP bridges] in "
                 "base_executor/base_model.h; true/false)")
      ->capture_default_str();
  app.add_flag("--lm-head", options.layers.lm_head,
               "serve lm_head as a base layer too (a head tied to the input embeddings: from them)");
  std::string layer_groups = symbiosis::BaseLayerRule::kDefaultGroups;
  app.add_option("--layer-groups", layer_groups,
                 "layers that read one input, served together as one stacked layer too (see [Layer groups] in "
                 "base_executor/base_model.h): ';'-separated groups of ','-separated last name parts; \"\" for none")
      ->capture_default_str();
  app.add_option("--max-request-bytes", options.max_request_bytes, "refuse request payloads larger than this")
      ->capture_default_str();
  // [Overload] (docs/operating.md)
  app.add_option("--max-message-bytes", options.max_message_bytes,
                 "disconnect a peer that sends a ZeroMQ frame larger than this, handshake included (0: a 1 MiB payload "
                 "frame + 64 KiB)")
      ->capture_default_str();
  app.add_option("--max-handshakes", options.max_handshakes,
                 "connections in handshake at once (accepted, nothing read yet); past it the oldest is cut")
      ->capture_default_str();
  app.add_option("--max-queued-messages", options.max_queued_messages,
                 "ZeroMQ messages queued for one peer each way; replies past it to a peer that does not read are "
                 "dropped")
      ->capture_default_str();
  app.add_option("--max-clients", options.max_clients, "clients connected at once; more are refused")
      ->capture_default_str();
  app.add_option("--max-queued-tokens", options.max_queued_tokens,
                 "tokens of the calls waiting to be batched, shared fairly among the clients with calls waiting; a "
                 "call past its client's share is refused (RESOURCE_EXHAUSTED), and the client runtime sends it again")
      ->capture_default_str();
  app.add_option("--max-buffer-bytes", options.max_buffer_bytes,
                 "shared memory held for clients, all together: same-host clients' control segments and registered "
                 "payload buffers; a handshake or registration past it is refused")
      ->capture_default_str();
  app.add_option("--metrics-listen", options.metrics_listen,
                 "serve Prometheus metrics over HTTP at HOST:PORT/metrics (port 0: a free one, printed); no "
                 "authentication, so a loopback address unless --insecure (default: none)");
  std::string policy = "opportunistic";
  int64_t max_wait_us = options.batching.max_wait.count(),
          lockstep_timeout_ms = options.batching.lockstep_timeout.count();
  int64_t companion_window_us = options.batching.companion_window.count();
  int64_t decode_align_wait_us = options.batching.decode_align_wait.count();
  int64_t judge_window_ms = options.batching.judge_window.count();
  app.add_option("--batching", policy, "batching policy: none, lockstep or opportunistic")->capture_default_str();
  app.add_option("--max-wait", max_wait_us, "opportunistic: longest a request waits for companions (us)")
      ->capture_default_str();
  app.add_option("--companion-window", companion_window_us,
                 "opportunistic: wait only for clients that used the same layer within this window (us)")
      ->capture_default_str();
  app.add_option("--decode-align-wait", decode_align_wait_us,
                 "opportunistic: a decode step's first call waits this long for the other decode tenants (us; 0: not)")
      ->capture_default_str();
  app.add_option("--judge-window", judge_window_ms,
                 "opportunistic: measure decode throughput with and without decode waits over windows this long, "
                 "and keep the better (ms; 0: decode always waits)")
      ->capture_default_str();
  app.add_option("--max-batch-tokens", options.batching.max_batch_tokens, "a batch closes at this many tokens")
      ->capture_default_str();
  app.add_option("--lockstep-timeout", lockstep_timeout_ms,
                 "lockstep: stop waiting for a client missing this long (ms)")
      ->capture_default_str();
  app.add_option("--decode-first-streak", options.batching.decode_first_streak,
                 "decode work overtakes older ready work at most this many batches in a row (0: oldest first)")
      ->capture_default_str();
  app.add_option("--threads", options.threads,
                 "CPU threads per GEMM on a CPU device (0: sized from each batch's work, up to all cores)")
      ->capture_default_str();
  app.add_option("--spin-us", options.spin_us,
                 "same-host clients: how long the scheduler thread spins for new work before sleeping (us; "
                 "-1: 1000 on a GPU, 50 on CPU)")
      ->capture_default_str();
  app.add_option("--streams", options.streams,
                 "a GPU executor computes on this many CUDA streams: a same-GPU request alone on its client's, other "
                 "batches on the first (1: all on one)")
      ->capture_default_str();
  app.add_option("--concurrent-tokens", options.concurrent_tokens,
                 "a GPU executor's request of at least this many tokens whose rows are on its GPU runs alone, at once: "
                 "a same-GPU (CUDA IPC) one on its client's stream (with --streams > 1), an NCCL one on the first "
                 "(0: such requests batch as others)")
      ->capture_default_str();
  app.add_option("--finetune-sm-percent", options.finetune_sm_percent,
                 "while a tenant decodes, a GPU executor sizes the GEMMs of fine-tuning calls for this percent of the "
                 "GPU's multiprocessors, leaving the others to decode calls (1 to 100; 100: all)")
      ->capture_default_str();
  app.add_option("--finetune-piece-rows", options.finetune_piece_rows,
                 "while a tenant decodes, a GPU executor computes a fine-tuning call of more rows as GEMMs of at most "
                 "this many rows, at the decode calls' stream priority (0: whole, at a lower priority)")
      ->capture_default_str();
  app.add_option("--launch-ahead", options.launch_ahead,
                 "run a same-GPU tenant's captured decode steps, once seen, as one launch each, its calls waiting on "
                 "the GPU for their inputs (true/false)")
      ->capture_default_str();
  app.add_option("--launch-together", options.launch_together,
                 "under opportunistic, launch the steps of several same-GPU tenants that --launch-ahead launches, "
                 "ready at once, as one, each call one GEMM for all, while --launch-together-from of them decode "
                 "(true/false: docs/inference.md)")
      ->capture_default_str();
  int64_t launch_together_wait_us = options.launch_together_wait.count();
  app.add_option("--launch-together-wait", launch_together_wait_us,
                 "microseconds a tenant's step launched ahead waits for the other tenants decoding, to go together")
      ->capture_default_str();
  app.add_option("--launch-together-max", options.launch_together_max,
                 "tenants' steps launched together in one launch at most (1 to 16)")
      ->capture_default_str();
  app.add_option("--launch-together-from", options.launch_together_from,
                 "tenants of one model decoding, at least, for their steps to go together; with fewer, each goes "
                 "alone (at least 2)")
      ->capture_default_str();
  app.add_option("--keys", keys_dir,
                 "keys folder (executor.key, tenants/, operators/, revoked/): encrypt, and admit only listed tenants "
                 "(docs/operating.md)");
  app.add_flag("--insecure", options.insecure,
               "without --keys, listen beyond loopback anyway (anyone may connect); and let --metrics-listen be "
               "beyond loopback (anyone may read the metrics)");
  app.add_option("--stats-interval", options.stats_interval_seconds, "log statistics every N seconds (0: never)")
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")->capture_default_str();
  // [Parts] (base_executor/parts.h, docs/operating.md): a sharded executor.
  auto& parts = options.parts;
  int64_t part_timeout_ms = parts.timeout.count();
  int launch_parts = 0;
  std::string launch_gpus;
  app.add_option("--rank", parts.rank, "this part's rank in a sharded executor (0 to --world-size - 1)")
      ->capture_default_str();
  app.add_option("--world-size", parts.world_size, "the parts of a sharded executor, all together")
      ->capture_default_str();
  app.add_option("--rendezvous", parts.rendezvous,
                 "HOST:PORT where the parts of a sharded executor meet (rank 0 listens there); none: not sharded");
  app.add_option("--part-interface", parts.interface,
                 "the network interface the parts' connections use (default: loopback for a loopback rendezvous, "
                 "else the host name's address)");
  app.add_option("--part-timeout", part_timeout_ms,
                 "a part waits this long for the others in a collective before it counts them lost (ms)")
      ->capture_default_str();
  app.add_option("--parts", launch_parts,
                 "start a sharded executor of this many parts on this host, one process each (with --device cpu)");
  app.add_option("--gpus", launch_gpus,
                 "start a sharded executor of one part per GPU listed (e.g. 0,1,2,3), one process each");
  CLI11_PARSE(app, argc, argv);
  parts.timeout = std::chrono::milliseconds(part_timeout_ms);
  // [Ready line]: logs go to stderr; stdout carries one line, "ready ENDPOINT", once the executor
  // takes calls (a sharded launcher: one a part, in rank order). Programs wait for it through
  // bench/process.h's wait_ready and bench/executor_process.py; symbiosis-serve and
  // symbiosis-tinker print theirs the same way.
  spdlog::set_default_logger(spdlog::stderr_color_mt("executor"));
  spdlog::set_level(spdlog::level::from_str(log_level));
  // [Not dumpable] (docs/operating.md, Threats): another process of this user can then neither
  // open this one's segments through /proc/PID/fd nor read its memory nor attach to it; root
  // still can. It also means no core dump.
  if (::prctl(PR_SET_DUMPABLE, 0) != 0)
    spdlog::warn("could not make the executor non-dumpable: {}", std::strerror(errno));
  if (launch_parts > 0 || !launch_gpus.empty()) {
    try {
      return symbiosis::launch_parts(argc, argv, options, launch_parts, launch_gpus);
    } catch (const c10::Error& e) {
      spdlog::error("{}", e.what_without_backtrace());
      return 1;
    }
  }
  options.model_dir = model_dir;
  options.keys_dir = keys_dir;

  // Block the stop signals in every thread; main waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  std::unique_ptr<symbiosis::Executor> executor;
  try {
    if (!dtype.empty()) options.dtype = symbiosis::parse_dtype_name(dtype);
    options.layers.groups = symbiosis::parse_layer_groups(layer_groups);
    options.batching.policy = symbiosis::parse_batching_policy(policy);
    options.batching.max_wait = std::chrono::microseconds(max_wait_us);
    options.batching.companion_window = std::chrono::microseconds(companion_window_us);
    options.batching.decode_align_wait = std::chrono::microseconds(decode_align_wait_us);
    options.launch_together_wait = std::chrono::microseconds(launch_together_wait_us);
    options.batching.judge_window = std::chrono::milliseconds(judge_window_ms);
    options.batching.lockstep_timeout = std::chrono::milliseconds(lockstep_timeout_ms);
    executor = symbiosis::Executor::start(options);
  } catch (const c10::Error& e) {
    spdlog::error("{}", e.what_without_backtrace());
    return 1;
  }
  if (!executor->metrics_url().empty()) std::cout << "metrics " << executor->metrics_url() << std::endl;
  std::cout << "ready " << executor->endpoint() << std::endl;  // scripts wait for this line
  // Until a stop signal, or a [Lost part]: then the executor stops, telling its clients why.
  const timespec tick{0, 100'000'000};
  while (true) {
    if (const int signal = sigtimedwait(&stop_signals, nullptr, &tick); signal > 0) {
      spdlog::info("signal {}: shutting down", signal);
      executor->shutdown();
      return 0;
    }
    if (executor->lost()) {
      executor->shutdown();
      return 3;
    }
  }
}
