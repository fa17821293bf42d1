#include "base_executor/executor.h"

#include <c10/util/Exception.h>
#include <google/protobuf/stubs/logging.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "base_executor/front_door.h"
#include "base_executor/metrics.h"
#include "base_executor/overload.h"
#include "base_executor/scheduler.h"
#include "base_executor/statistics.h"
#include "common/checkpoint.h"
#include "common/cuda.h"
#include "common/untrusted.h"
#include "transport/shared_memory.h"
#include "transport/zmq_wire.h"

namespace symbiosis {

namespace {

// Whether an endpoint is reachable from this host only.
bool loopback(const std::string& endpoint) {
  if (endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0) return true;
  for (const char* host : {"tcp://127.", "tcp://localhost:", "tcp://[::1]:", "tcp://lo:"}) {
    if (endpoint.rfind(host, 0) == 0) return true;
  }
  return false;
}

// [Untrusted input]: Protobuf logs a line for each string field of invalid UTF-8 it parses; from
// peers' messages, within a budget.
void log_protobuf(google::protobuf::LogLevel level, const char*, int, const std::string& message) {
  static std::mutex mutex;
  static LogBudget budget(20);
  std::lock_guard<std::mutex> lock(mutex);
  uint64_t held_back = 0;
  const bool write = budget.take(&held_back);
  if (held_back > 0) spdlog::warn("{} more Protobuf lines were held back", held_back);
  if (!write) return;
  if (level >= google::protobuf::LOGLEVEL_ERROR) {
    spdlog::warn("protobuf: {}", bounded(message, 200));
  } else {
    spdlog::debug("protobuf: {}", bounded(message, 200));
  }
}

}  // namespace

size_t ExecutorOptions::message_limit() const {
  return max_message_bytes > 0 ? max_message_bytes : wire::kPayloadFrameBytes + (size_t{64} << 10);
}

void ExecutorOptions::validate() const {
  TORCH_CHECK(!model_dir.empty(), "executor option --model is required (a Hugging Face checkpoint directory)");
  wire::validate_endpoint(listen, "executor option --listen", /*allow_inproc=*/true);
  TORCH_CHECK(!keys_dir.empty() || insecure || loopback(listen), "executor option --listen ", listen,
              " is reachable from other hosts, and without keys anyone there could use this executor and read its "
              "traffic: give --keys DIR (docs/operating.md), listen on tcp://127.0.0.1, or pass --insecure");
  TORCH_CHECK(max_request_bytes > 0, "executor option --max-request-bytes must be positive");
  TORCH_CHECK(max_message_bytes == 0 || max_message_bytes >= wire::kPayloadFrameBytes,
              "executor option --max-message-bytes (", max_message_bytes, ") must be at least a payload frame (",
              wire::kPayloadFrameBytes, " bytes), or 0 for that + 64 KiB");
  TORCH_CHECK(max_message_bytes <= size_t{INT64_MAX}, "executor option --max-message-bytes is too large");
  TORCH_CHECK(max_handshakes >= 1, "executor option --max-handshakes must be >= 1, got ", max_handshakes);
  TORCH_CHECK(max_queued_messages >= 1, "executor option --max-queued-messages must be >= 1, got ",
              max_queued_messages);
  TORCH_CHECK(max_clients >= 1, "executor option --max-clients must be >= 1, got ", max_clients);
  TORCH_CHECK(max_queued_tokens >= 1, "executor option --max-queued-tokens must be >= 1, got ", max_queued_tokens);
  TORCH_CHECK(max_buffer_bytes >= 1, "executor option --max-buffer-bytes must be >= 1, got ", max_buffer_bytes);
  if (!metrics_listen.empty()) {
    const bool metrics_loopback = parse_metrics_listen(metrics_listen).loopback;  // throws naming a bad address
    TORCH_CHECK(metrics_loopback || insecure, "executor option --metrics-listen ", metrics_listen,
                " is reachable from other hosts, and the metrics endpoint has no authentication (anyone there could "
                "read tenants' names and traffic): listen on 127.0.0.1, or pass --insecure");
  }
  TORCH_CHECK(stats_interval_seconds >= 0, "executor option --stats-interval must be >= 0");
  batching.validate();
  parts.validate();
  TORCH_CHECK(threads >= 0, "executor option --threads must be >= 0, got ", threads);
  TORCH_CHECK(spin_us >= -1, "executor option --spin-us must be >= 0 (or -1: by device), got ", spin_us);
  TORCH_CHECK(streams >= 1 && streams <= 32, "executor option --streams must be 1 to 32, got ", streams);
  TORCH_CHECK(concurrent_tokens >= 0, "executor option --concurrent-tokens must be >= 0, got ", concurrent_tokens);
  TORCH_CHECK(finetune_piece_rows >= 0, "executor option --finetune-piece-rows must be 0 or more, got ",
              finetune_piece_rows);
  TORCH_CHECK(finetune_sm_percent >= 1 && finetune_sm_percent <= 100,
              "executor option --finetune-sm-percent must be 1 to 100, got ", finetune_sm_percent);
}

// [Executor threads] Two threads, each owning its state: the front door's (the ROUTER socket, the
// handshake, the client registry) and the scheduler's (the Batcher, the channels, the GEMMs). The
// front door feeds the scheduler through its inbox; statistics are shared counters.
class Executor::Impl {
 public:
  ExecutorOptions options;
  std::unique_ptr<Parts> parts;  // [Parts]; none when not sharded
  std::unique_ptr<BaseModel> model;
  zmq::context_t context{1};
  std::unique_ptr<Statistics> statistics;
  std::unique_ptr<BufferBudget> buffers;  // [Buffer budget]
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<FrontDoor> front_door;
  std::thread front_door_thread;
  std::thread scheduler_thread;
  std::unique_ptr<MetricsServer> metrics;  // [Metrics]; none without --metrics-listen
  std::atomic<bool> stopping{false};

  mutable std::mutex lost_mutex;
  std::optional<Status> lost;  // [Lost part]; guarded by lost_mutex

  std::mutex done_mutex;
  std::condition_variable done_cv;  // signalled when shutdown completes
  bool done = false;                // guarded by done_mutex
};

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Executor> Executor::start(const ExecutorOptions& options) {
  options.validate();
  google::protobuf::SetLogHandler(&log_protobuf);
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  at::Device device(options.device);
  if (device.is_cuda() && !device.has_index()) device = at::Device(at::kCUDA, 0);
  TORCH_CHECK(device.is_cpu() || cuda::cuda_available(), "executor option --device ", options.device,
              ": no CUDA GPU is available here");
  auto checkpoint = Checkpoint::open(options.model_dir);
  Shard shard;
  if (options.parts.sharded()) {
    impl->parts = Parts::join(options.parts, device);
    shard = {options.parts.rank, options.parts.world_size};
  }
  impl->model = BaseModel::load(*checkpoint, options.layers, device, options.dtype, shard);
  proto::Placement placement;
  placement.set_host_id(shm::host_id());
  placement.set_pid(::getpid());
  placement.set_device(options.device);
  if (device.is_cuda()) {
    placement.set_gpu_uuid(cuda::gpu_uuid(device.index()));
    placement.set_mps(cuda::mps_active());
  }
  const auto& model = *impl->model;
  spdlog::info("loaded {} base layers and {} layer groups ({:.1f} MiB{}) of model {} from {} on {}{}",
               model.layers().size(), model.groups().size(), model.weight_bytes() / 1048576.0,
               impl->parts ? ", the share of " + impl->parts->name() : "", model.model_hash(),
               options.model_dir.string(), options.device,
               device.is_cuda() ? (placement.mps() ? " (NVIDIA MPS active)" : " (no NVIDIA MPS)") : "");
  const auto& kept = impl->options;  // the parts refer to the Impl's copy
  impl->statistics = std::make_unique<Statistics>(model, batching_policy_name(options.batching.policy));
  const std::string replies_endpoint = "inproc://replies-" + std::to_string(reinterpret_cast<uintptr_t>(impl.get()));
  impl->buffers = std::make_unique<BufferBudget>(options.max_buffer_bytes);
  Impl* raw = impl.get();
  impl->scheduler = std::make_unique<Scheduler>(kept, model, *impl->statistics, *impl->buffers, impl->context,
                                                replies_endpoint, impl->parts.get(), [raw](const Status& why) {
                                                  std::lock_guard<std::mutex> lock(raw->lost_mutex);
                                                  raw->lost = why;
                                                  raw->front_door->set_goodbye(why.message());
                                                });
  impl->front_door = std::make_unique<FrontDoor>(kept, model, placement, *impl->scheduler, *impl->statistics,
                                                 *impl->buffers, impl->context, replies_endpoint);
  if (!options.metrics_listen.empty()) {
    const Impl* shown = impl.get();
    impl->metrics = std::make_unique<MetricsServer>(options.metrics_listen, [shown, device] {
      MetricsGauges gauges;
      gauges.max_queued_tokens = shown->options.max_queued_tokens;
      gauges.buffer_bytes = shown->buffers->used();
      gauges.max_buffer_bytes = shown->buffers->limit();
      gauges.max_clients = shown->options.max_clients;
      gauges.gpu = device.is_cuda() ? device.index() : -1;
      return prometheus_text(shown->statistics->metrics(), gauges);
    });
    spdlog::info("metrics at {}", impl->metrics->url());
  }
  impl->front_door_thread = std::thread([raw] { raw->front_door->run(); });
  impl->scheduler_thread = std::thread([raw] { raw->scheduler->run(); });
  spdlog::info("serving on {} (batching: {})", impl->front_door->endpoint(),
               batching_policy_name(options.batching.policy));
  return std::unique_ptr<Executor>(new Executor(std::move(impl)));
}

Executor::~Executor() { shutdown(); }

std::string Executor::endpoint() const { return impl_->front_door->endpoint(); }
std::string Executor::metrics_url() const { return impl_->metrics ? impl_->metrics->url() : ""; }
const BaseModel& Executor::model() const { return *impl_->model; }

ExecutorStats Executor::stats() const {
  const auto& s = *impl_->statistics;
  return {s.clients,
          s.same_host_clients,
          s.requests,
          s.errors,
          s.tokens,
          s.compute_nanos * 1e-9,
          s.direct_calls,
          s.concurrent_calls,
          s.replayed_calls,
          s.ahead_calls,
          impl_->buffers->used(),
          impl_->model->weight_bytes()};
}

std::optional<Status> Executor::lost() const {
  std::lock_guard<std::mutex> lock(impl_->lost_mutex);
  return impl_->lost;
}

void Executor::shutdown() {
  if (impl_->stopping.exchange(true)) return;
  impl_->metrics.reset();  // no scrape reads what stops below
  impl_->scheduler->stop();
  impl_->front_door->stop();
  if (impl_->scheduler_thread.joinable()) impl_->scheduler_thread.join();
  if (impl_->front_door_thread.joinable()) impl_->front_door_thread.join();
  impl_->front_door->abort_clients();
  impl_->statistics->log();
  {
    std::lock_guard<std::mutex> lock(impl_->done_mutex);
    impl_->done = true;
  }
  impl_->done_cv.notify_all();
}

void Executor::wait() {
  std::unique_lock<std::mutex> lock(impl_->done_mutex);
  impl_->done_cv.wait(lock, [&] { return impl_->done; });
}

}  // namespace symbiosis
