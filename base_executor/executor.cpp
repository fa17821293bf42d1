#include "base_executor/executor.h"

#include <c10/util/Exception.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "base_executor/batching.h"
#include "base_executor/same_host_channel.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl_comm.h"
#include "transport/zmq_wire.h"
#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/batched_copy.h"
#endif

namespace symbiosis {
namespace {

using Clock = std::chrono::steady_clock;

// What a queued request carries besides what the Batcher decides on.
struct Work {
  shm::CallHeader header;
  std::shared_ptr<SameHostChannel> channel;  // clients of a payload channel; null for tcp clients
  zmq::message_t identity;                   // tcp clients: where the reply goes
  at::Tensor input;                          // tcp clients: the payload, in host memory
  at::Tensor destination;                    // channel clients: where the result goes, if in place
};
using WorkBatcher = Batcher<Work>;

LatencyClass to_latency_class(int32_t c) {
  switch (c) {
    case proto::INFERENCE_DECODE: return LatencyClass::kInferenceDecode;
    case proto::INFERENCE_PREFILL: return LatencyClass::kInferencePrefill;
    default: return LatencyClass::kFineTuning;
  }
}

LayerOp to_layer_op(int32_t op) {
  switch (op) {
    case proto::BACKWARD_INPUT: return LayerOp::kBackwardInput;
    case proto::FORWARD_NO_BIAS: return LayerOp::kForwardNoBias;
    default: return LayerOp::kForward;
  }
}

// Per-layer counters, written by the compute thread and read for statistics.
struct LayerCounters {
  uint64_t requests = 0, tokens = 0, batches = 0, forward_batches = 0, backward_batches = 0;
  double compute_seconds = 0, wait_seconds = 0;
};

struct ClientRecord {
  uint64_t id;
  std::string tenant;
  Clock::time_point last_seen;
  std::string transport;
  int pid = 0;                               // clients with a control segment: checked for liveness
  std::shared_ptr<SameHostChannel> channel;  // shm, cuda-ipc and nccl clients
};

// ZeroMQ clients idle this long without a Goodbye are forgotten (they died or left). Same-host
// clients are forgotten as soon as their process is gone.
constexpr auto kClientIdleLimit = std::chrono::minutes(10);
constexpr auto kLivenessInterval = std::chrono::milliseconds(200);
// From this many tokens a request's GEMM keeps an H100 busy alone: see [Batch data path].
constexpr int64_t kInPlaceTokens = 512;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

bool process_alive(int pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

// targets[i] = sources[i] (equal sizes): one kernel for all of them on a GPU, copies on a CPU.
void copy_rows(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& targets) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (sources[0].is_cuda()) return kernels::copy_tensors(sources, targets);
#endif
  for (size_t i = 0; i < sources.size(); ++i) targets[i].copy_(sources[i]);
}

}  // namespace

void ExecutorOptions::validate() const {
  TORCH_CHECK(!model_dir.empty(), "executor option --model is required (a Hugging Face checkpoint directory)");
  TORCH_CHECK(listen.rfind("tcp://", 0) == 0 || listen.rfind("ipc://", 0) == 0 || listen.rfind("inproc://", 0) == 0,
              "executor option --listen '", listen, "' should be a ZeroMQ endpoint like tcp://127.0.0.1:5555");
  TORCH_CHECK(max_request_bytes > 0, "executor option --max-request-bytes must be positive");
  TORCH_CHECK(stats_interval_seconds >= 0, "executor option --stats-interval must be >= 0");
  batching.validate();
  TORCH_CHECK(threads >= 0, "executor option --threads must be >= 0, got ", threads);
  TORCH_CHECK(spin_us >= -1, "executor option --spin-us must be >= 0 (or -1: by device), got ", spin_us);
  TORCH_CHECK(streams >= 1 && streams <= 32, "executor option --streams must be 1 to 32, got ", streams);
  TORCH_CHECK(concurrent_tokens >= 0, "executor option --concurrent-tokens must be >= 0, got ", concurrent_tokens);
}

class Executor::Impl {
 public:
  ExecutorOptions options;
  std::unique_ptr<BaseModel> model;
  proto::Placement placement;  // where this executor runs
  zmq::context_t context{1};
  zmq::socket_t router{context, zmq::socket_type::router};
  zmq::socket_t replies_in{context, zmq::socket_type::pull};
  std::string endpoint;
  std::string replies_endpoint;
  std::atomic<bool> stopping{false};
  std::thread io_thread;
  std::thread compute_thread;
  // The compute thread sleeps on it; the IO thread and same-host clients notify it when they
  // queue work. See [Shared-memory control channel].
  Doorbell doorbell;

  // Requests validated by the IO thread or the compute thread, waiting for a batch.
  // See [Opportunistic batching].
  std::mutex queue_mutex;
  std::unique_ptr<WorkBatcher> batcher;  // guarded by queue_mutex
  // Set-up work for the compute thread, which owns the same-host channels (registering buffers,
  // NCCL set-up, adding and dropping channels). Each task may answer through replies_out.
  std::vector<std::function<void(zmq::socket_t& replies_out)>> control_tasks;  // guarded by queue_mutex

  std::mutex counters_mutex;
  std::vector<LayerCounters> counters;  // per layer id; guarded by counters_mutex
  uint64_t max_batch_requests = 0;      // guarded by counters_mutex
  const Clock::time_point started = Clock::now();

  // Owned by the IO thread.
  std::map<std::string, ClientRecord> clients;
  uint64_t next_client_id = 1;
  std::map<std::string, GpuClientCount> nccl_clients_by_gpu;  // by GPU UUID ([NCCL readiness])

  // Owned by the compute thread.
  std::map<uint64_t, std::shared_ptr<SameHostChannel>> channels;  // polled for requests
  struct PendingSetup {
    std::shared_ptr<SameHostChannel> channel;
    std::string identity;  // the client's ZeroMQ routing id
  };
  std::vector<PendingSetup> pending_setups;  // NCCL communicators still joining

  std::atomic<uint64_t> clients_now{0}, same_host_clients_now{0}, requests{0}, errors{0}, tokens{0}, direct_calls{0},
      concurrent_calls{0}, replayed_calls{0};
  std::atomic<uint64_t> compute_nanos{0};
  std::atomic<uint64_t> deliver_nanos{0};  // the part of compute_nanos spent in deliver()

  std::mutex done_mutex;
  std::condition_variable done_cv;  // signalled when shutdown completes
  bool done = false;                // guarded by done_mutex

  void io_loop();
  void compute_loop();
#ifdef SYMBIOSIS_WITH_CUDA
  void warm_up(cuda::ComputeStreams& streams);
#endif
  void handle(std::vector<zmq::message_t>& frames);
  void handle_hello(const proto::Hello& hello, zmq::message_t& identity, const std::string& key);
  void send_error(zmq::message_t& identity, uint64_t request_id, proto::ErrorCode code, const std::string& message,
                  bool as_reply);
  std::string choose_transport(const proto::Hello& hello) const;
  // Whether the client runs on this executor's host (its Hello names this host's id).
  bool same_host(const proto::Placement& client) const {
    return !client.host_id().empty() && client.host_id() == placement.host_id();
  }
  std::string validate_call(shm::CallHeader& h, const std::vector<int64_t>& shape, proto::ErrorCode* code) const;
  void queue(WorkBatcher::Request request);
  void post(std::function<void(zmq::socket_t&)> task);
  // Takes the channels' new calls and pushes the replies they held; true while a reply is still
  // held or a call waits for its client's GPU to write its input: the loop then looks again at once.
  bool poll_channels();
  // Checks a call a channel client sent (through its ring, or over ZeroMQ) and queues it or refuses it.
  void accept_channel_call(const std::shared_ptr<SameHostChannel>& channel, const shm::CallHeader& h,
                           const std::vector<int64_t>& shape);
  void finish_setups(zmq::socket_t& replies_out);
  void log_stats();
  void run_batch(WorkBatcher::Batch& batch, zmq::socket_t& replies_out);
  std::vector<at::Tensor> compute_batch(WorkBatcher::Batch& batch);
  void deliver(WorkBatcher::Batch& batch, std::vector<at::Tensor>& results, const std::string& failure,
               zmq::socket_t& replies_out);
  proto::Stats collect_stats();
  void forget_client(const std::string& key);
  void check_liveness();
};

void Executor::Impl::send_error(zmq::message_t& identity, uint64_t request_id, proto::ErrorCode code,
                                const std::string& message, bool as_reply) {
  errors++;
  const auto env = wire::error_envelope(request_id, code, message, as_reply);
  spdlog::debug("error to client: {}", message);
  wire::send_to(router, identity.to_string_view(), env);
}

// Fills h.tokens and h.features from `shape`; returns "" or the problem (and its code).
std::string Executor::Impl::validate_call(shm::CallHeader& h, const std::vector<int64_t>& shape,
                                          proto::ErrorCode* code) const {
  if (h.layer_id >= model->layer_count()) {
    *code = proto::NOT_FOUND;
    return "unknown layer id " + std::to_string(h.layer_id) + " (this executor serves " +
           std::to_string(model->layers().size()) + " layers and " + std::to_string(model->groups().size()) +
           " groups, ids 0.." + std::to_string(model->layer_count() - 1) + ")";
  }
  const auto& layer = model->layer(h.layer_id);
  // Built only for an error: this runs for every call.
  auto where = [&] {
    return "request " + std::to_string(h.request_id) + " for layer " + std::to_string(layer.id) + " (" + layer.name +
           ")";
  };
  *code = proto::INVALID_ARGUMENT;
  if (h.op != proto::FORWARD && h.op != proto::BACKWARD_INPUT && h.op != proto::FORWARD_NO_BIAS) {
    return where() + ": op " + std::to_string(h.op) + " is not FORWARD, BACKWARD_INPUT or FORWARD_NO_BIAS";
  }
  const auto expected_dtype = wire::to_proto(layer.dtype);
  if (h.dtype != expected_dtype) {
    const std::string got = proto::DType_IsValid(h.dtype) ? proto::DType_Name(static_cast<proto::DType>(h.dtype))
                                                          : std::to_string(h.dtype);
    return where() + ": dtype " + got + " does not match the layer's " + proto::DType_Name(expected_dtype);
  }
  const int64_t features = h.op == proto::BACKWARD_INPUT ? layer.out_features : layer.in_features;
  if (shape.size() != 2 || shape[0] < 1 || shape[1] != features) {
    return where() + " (" + wire::op_name(static_cast<proto::Op>(h.op)) + "): shape " + shape_text(shape) +
           " should be [tokens >= 1, " + std::to_string(features) + "]";
  }
  h.tokens = shape[0];
  h.features = shape[1];
  // Compared by rows, so that no product of a client's numbers can overflow.
  const uint64_t row_bytes = static_cast<uint64_t>(h.features) * at::elementSize(layer.dtype);
  if (static_cast<uint64_t>(h.tokens) > options.max_request_bytes / row_bytes) {
    *code = proto::RESOURCE_EXHAUSTED;
    return where() + ": " + std::to_string(h.tokens) + " tokens of " + std::to_string(row_bytes) +
           " bytes exceed the executor's limit of " + std::to_string(options.max_request_bytes) +
           " bytes (--max-request-bytes)";
  }
  return "";
}

// [Transport choice]
// A client names a transport or asks for "auto". Auto picks by where the client runs (its Hello's
// Placement) against where the executor runs: another host, tcp; the same host, a CPU client,
// shm; the executor's own GPU (same GPU UUID), cuda-ipc; another GPU of this host, nccl. A named
// transport that the placement cannot support is refused with the reason. nccl also reaches a GPU
// client on another host (NCCL's network transport), which asks for it by name: its headers then
// go over ZeroMQ, as every client's do that asks for control "zmq".
std::string Executor::Impl::choose_transport(const proto::Hello& hello) const {
  const auto& p = hello.placement();
  const std::string asked = hello.transport().empty() ? "auto" : hello.transport();
  const bool same_host = this->same_host(p);
  const bool client_gpu = !p.gpu_uuid().empty();
  const bool executor_gpu = !placement.gpu_uuid().empty();
  const bool same_gpu = same_host && client_gpu && p.gpu_uuid() == placement.gpu_uuid();
  if (asked == "auto") {
    if (!same_host) return "tcp";
    if (same_gpu) return "cuda-ipc";
    if (client_gpu && executor_gpu && nccl::nccl_available()) return "nccl";
    return "shm";
  }
  const std::string refusal = "transport " + asked + " is not possible here: ";
  if (asked == "tcp") return asked;
  TORCH_CHECK(asked == "shm" || asked == "cuda-ipc" || asked == "nccl", "unknown transport '", asked,
              "' (expected auto, tcp, shm, cuda-ipc or nccl)");
  TORCH_CHECK(same_host || asked == "nccl", refusal, "the client is on another host (", p.host_id(),
              ", the executor on ", placement.host_id(), "); use tcp, or nccl from a GPU");
  if (asked == "cuda-ipc") {
    TORCH_CHECK(same_gpu, refusal, "it needs the client on the executor's GPU (", placement.device(), " ",
                placement.gpu_uuid(), "), but the client is on ", p.device(), " ", p.gpu_uuid());
  }
  if (asked == "nccl") {
    TORCH_CHECK(executor_gpu && client_gpu && !same_gpu, refusal,
                "it needs the client and the executor on two different GPUs (client ", p.device(), ", executor ",
                placement.device(), ")");
    TORCH_CHECK(nccl::nccl_available(), refusal, "this executor was built without NCCL");
  }
  return asked;
}

void Executor::Impl::post(std::function<void(zmq::socket_t&)> task) {
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    control_tasks.push_back(std::move(task));
  }
  doorbell.word().notify();
}

void Executor::Impl::queue(WorkBatcher::Request request) {
  std::lock_guard<std::mutex> lock(queue_mutex);
  batcher->push(std::move(request));
}

void send_error_via(zmq::socket_t& replies_out, const std::string& identity, const std::string& message) {
  wire::send_to(replies_out, identity, wire::error_envelope(0, proto::FAILED_PRECONDITION, message, false));
}

void Executor::Impl::handle_hello(const proto::Hello& hello, zmq::message_t& identity, const std::string& key) {
  if (hello.protocol_version() != wire::kProtocolVersion) {
    send_error(identity, 0, proto::FAILED_PRECONDITION,
               "client speaks protocol " + std::to_string(hello.protocol_version()) + ", executor speaks " +
                   std::to_string(wire::kProtocolVersion), false);
    return;
  }
  if (!hello.expected_model_hash().empty() && hello.expected_model_hash() != model->model_hash()) {
    send_error(identity, 0, proto::FAILED_PRECONDITION,
               "model mismatch: the client was built for model " + hello.expected_model_hash() +
                   ", but this executor serves model " + model->model_hash() + " (" + options.model_dir.string() + ")",
               false);
    return;
  }
  std::string transport;
  try {
    transport = choose_transport(hello);
  } catch (const c10::Error& e) {
    send_error(identity, 0, proto::FAILED_PRECONDITION, e.what_without_backtrace(), false);
    return;
  }
  if (clients.count(key)) forget_client(key);  // a second Hello starts the client afresh
  ClientRecord record{next_client_id++, hello.tenant(), Clock::now(), transport};
  if (transport != "tcp") {
    try {
      TORCH_CHECK(hello.control().empty() || hello.control() == "auto" || hello.control() == "zmq",
                  "unknown control '", hello.control(), "' (expected auto or zmq)");
      GpuClientCount gpu_clients;
      if (transport == "nccl") {
        auto& count = nccl_clients_by_gpu[hello.placement().gpu_uuid()];
        if (!count) count = std::make_shared<std::atomic<int>>(0);
        gpu_clients = count;
      }
      record.channel = SameHostChannel::create(transport, record.id, model->device(), gpu_clients);
    } catch (const c10::Error& e) {
      send_error(identity, 0, proto::FAILED_PRECONDITION, e.what_without_backtrace(), false);
      return;
    }
    if (!same_host(hello.placement()) || hello.control() == "zmq") {
      record.channel->control_over_zmq(context, replies_endpoint, key);
    } else {
      record.pid = hello.placement().pid();  // a process of this host: watched for its end
    }
    post([this, channel = record.channel](zmq::socket_t&) { channels[channel->client_id()] = channel; });
  }
  if (transport == "cuda-ipc" && !(hello.placement().mps() && placement.mps())) {
    spdlog::warn(
        "client {} (tenant '{}') shares {} with the executor without NVIDIA MPS ({} lacks it): every hand-off of GPU "
        "work between the two processes then costs a context switch (~300 us instead of ~14 us). To use MPS, {}",
        record.id, hello.tenant(), placement.device(), placement.mps() ? "the client" : "the executor",
        cuda::mps_hint());
  }
  auto& client = clients.emplace(key, std::move(record)).first->second;
  clients_now = clients.size();
  if (client.channel) same_host_clients_now++;
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    batcher->add_client(client.id);
  }
  doorbell.word().notify();
  spdlog::info("client {} (tenant '{}', {} on {}) connected", client.id, hello.tenant(), transport,
               hello.placement().device().empty() ? "?" : hello.placement().device());
  proto::Envelope reply;
  auto* welcome = reply.mutable_welcome();
  welcome->set_client_id(client.id);
  welcome->set_model_hash(model->model_hash());
  welcome->set_max_request_bytes(options.max_request_bytes);
  welcome->set_executor_version("symbiosis 0.2.0");
  welcome->set_transport(transport);
  *welcome->mutable_placement() = placement;
  if (client.channel && !client.channel->zmq_control()) {
    welcome->set_control_segment(client.channel->control_segment());
    welcome->set_doorbell_segment(doorbell.segment());
  }
  for (const auto& layer : model->layers()) *welcome->add_layers() = wire::to_proto(layer);
  for (const auto& group : model->groups()) *welcome->add_groups() = wire::to_proto(group);
  wire::send_to(router, identity.to_string_view(), reply);
}

void Executor::Impl::handle(std::vector<zmq::message_t>& frames) {
  zmq::message_t& identity = frames[0];
  if (frames.size() < 2) {
    send_error(identity, 0, proto::MALFORMED, "message has no header frame", false);
    return;
  }
  proto::Envelope env;
  if (!wire::parse(frames[1], &env)) {
    send_error(identity, 0, proto::MALFORMED,
               "header frame of " + std::to_string(frames[1].size()) + " bytes is not a symbiosis Envelope", false);
    return;
  }
  const std::string key(static_cast<const char*>(identity.data()), identity.size());
  auto client = clients.find(key);
  if (client != clients.end()) client->second.last_seen = Clock::now();

  switch (env.body_case()) {
    case proto::Envelope::kHello:
      handle_hello(env.hello(), identity, key);
      return;
    case proto::Envelope::kRequest: {
      const auto& r = env.request();
      if (client == clients.end()) {
        send_error(identity, r.request_id(), proto::FAILED_PRECONDITION,
                   "request " + std::to_string(r.request_id()) + " before the handshake: send Hello first", true);
        return;
      }
      shm::CallHeader h;
      h.request_id = r.request_id();
      h.layer_id = r.layer_id();
      h.op = r.op();
      h.dtype = r.dtype();
      h.latency_class = r.latency_class();
      if (const auto& channel = client->second.channel) {
        // Its payload travels through the channel: the compute thread checks and queues the call.
        if (!channel->zmq_control() || frames.size() != 2) {
          send_error(identity, r.request_id(), proto::MALFORMED,
                     !channel->zmq_control()
                         ? "this client's calls go through its shared-memory control channel, not ZeroMQ"
                         : "a " + channel->kind() + " client's request carries no payload frame",
                     true);
          return;
        }
        h.in_offset = r.in_offset();
        h.out_offset = r.out_offset();
        h.buffer_generation = r.buffer_generation();
        const std::vector<int64_t> shape(r.shape().begin(), r.shape().end());
        post([this, channel, h, shape](zmq::socket_t&) { accept_channel_call(channel, h, shape); });
        return;
      }
      proto::ErrorCode code;
      std::string problem = validate_call(h, {r.shape().begin(), r.shape().end()}, &code);
      if (problem.empty()) {
        const uint64_t bytes = static_cast<uint64_t>(h.tokens) * h.features *
                               at::elementSize(model->layer(h.layer_id).dtype);
        const std::string where = "request " + std::to_string(h.request_id) + " for layer " +
                                  std::to_string(h.layer_id) + " (" + model->layer(h.layer_id).name + ")";
        code = proto::MALFORMED;
        if (frames.size() != 3) {
          problem = where + ": expected exactly one payload frame after the header, got " +
                    std::to_string(frames.size() - 2);
        } else if (frames[2].size() != bytes) {
          problem = where + ": payload has " + std::to_string(frames[2].size()) + " bytes, expected " +
                    std::to_string(bytes) + " for its shape and dtype";
        }
      }
      if (!problem.empty()) {
        send_error(identity, r.request_id(), code, problem, true);
        return;
      }
      WorkBatcher::Request queued;
      queued.client_id = client->second.id;
      queued.layer_id = h.layer_id;
      queued.op = to_layer_op(h.op);
      queued.tokens = h.tokens;
      queued.latency = to_latency_class(h.latency_class);
      queued.arrival = Clock::now();
      queued.payload.input = wire::frame_to_tensor(std::move(frames[2]), model->layer(h.layer_id).dtype,
                                                   {h.tokens, h.features});
      queued.payload.identity = std::move(identity);
      queued.payload.header = h;
      queue(std::move(queued));
      doorbell.word().notify();
      return;
    }
    case proto::Envelope::kRegisterBuffer:
    case proto::Envelope::kShareSegments:
    case proto::Envelope::kNcclSetup: {
      if (client == clients.end() || !client->second.channel) {
        send_error(identity, 0, proto::FAILED_PRECONDITION,
                   "payload set-up from a client without a same-host transport (shm, cuda-ipc or nccl)", false);
        return;
      }
      auto channel = client->second.channel;
      channel->attached();  // it has mapped its control segment
      post([this, channel, env, id = key](zmq::socket_t& out) {
        try {
          if (env.has_register_buffer()) {
            proto::Envelope answer;
            *answer.mutable_buffer_registered() = channel->register_buffer(env.register_buffer());
            wire::send_to(out, id, answer);
          } else if (env.has_share_segments()) {
            channel->share_segments(env.share_segments());
            proto::Envelope answer;
            answer.mutable_segments_shared();
            wire::send_to(out, id, answer);
          } else {
            channel->setup_nccl(env.nccl_setup());
            pending_setups.push_back({channel, id});
          }
        } catch (const c10::Error& e) {
          errors++;
          send_error_via(out, id, e.what_without_backtrace());
        }
      });
      return;
    }
    case proto::Envelope::kGoodbye:
      if (client != clients.end()) {
        spdlog::info("client {} (tenant '{}') left", client->second.id, client->second.tenant);
        forget_client(key);
      }
      return;
    case proto::Envelope::kStatsRequest: {
      proto::Envelope reply;
      *reply.mutable_stats() = collect_stats();
      wire::send_to(router, identity.to_string_view(), reply);
      return;
    }
    default:
      send_error(identity, 0, proto::MALFORMED,
                 "unexpected message: the executor takes Hello, Request, RegisterBuffer, ShareSegments, NcclSetup, "
                 "Goodbye and StatsRequest",
                 false);
  }
}

void Executor::Impl::forget_client(const std::string& key) {
  auto it = clients.find(key);
  if (it == clients.end()) return;
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    batcher->remove_client(it->second.id);
  }
  if (auto channel = it->second.channel) {
    channel->abort();  // nothing may wait on a client that is gone (NCCL kernels)
    post([this, id = it->second.id](zmq::socket_t&) {
      channels.erase(id);
      std::erase_if(pending_setups, [id](const PendingSetup& p) { return p.channel->client_id() == id; });
    });
    same_host_clients_now--;
  }
  doorbell.word().notify();  // lockstep queues may be ready now
  clients.erase(it);
  clients_now = clients.size();
}

void Executor::Impl::check_liveness() {
  std::vector<std::string> gone;
  const auto now = Clock::now();
  for (const auto& [key, record] : clients) {
    // Clients of this host are watched by process; others (ZeroMQ control) by silence.
    const bool gone_now = (record.channel && (record.channel->broken() || record.channel->failed())) ||
                          (record.pid > 0 ? !process_alive(record.pid) : now - record.last_seen > kClientIdleLimit);
    if (gone_now) gone.push_back(key);
  }
  for (const auto& key : gone) {
    spdlog::info("client {} (tenant '{}') is gone; releasing what it held", clients.at(key).id,
                 clients.at(key).tenant);
    forget_client(key);
  }
}

proto::Stats Executor::Impl::collect_stats() {
  proto::Stats s;
  s.set_clients(clients_now);
  s.set_requests(requests);
  s.set_errors(errors);
  s.set_tokens(tokens);
  s.set_compute_seconds(compute_nanos * 1e-9);
  s.set_deliver_seconds(deliver_nanos * 1e-9);
  s.set_direct_calls(direct_calls);
  s.set_concurrent_calls(concurrent_calls);
  s.set_replayed_calls(replayed_calls);
  s.set_policy(batching_policy_name(options.batching.policy));
  s.set_uptime_seconds(std::chrono::duration<double>(Clock::now() - started).count());
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    s.set_queue_depth(batcher->pending());
  }
  std::lock_guard<std::mutex> lock(counters_mutex);
  uint64_t batches = 0;
  double wait = 0;
  for (size_t id = 0; id < counters.size(); ++id) {
    const auto& c = counters[id];
    batches += c.batches;
    wait += c.wait_seconds;
    if (c.requests == 0) continue;
    auto* layer = s.add_layers();
    layer->set_layer_id(static_cast<uint32_t>(id));
    layer->set_name(model->layer(static_cast<uint32_t>(id)).name);
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
  s.set_max_batch_requests(max_batch_requests);
  return s;
}

void Executor::Impl::log_stats() {
  const auto s = collect_stats();
  const double uptime = std::max(s.uptime_seconds(), 1e-9);
  spdlog::info(
      "stats ({}): {} clients, {} requests in {} batches ({:.2f} requests/batch, max {}), {} errors, {} tokens "
      "({:.0f} tokens/s), {:.3f} s computing, mean wait {:.1f} us, queue depth {}",
      s.policy(), s.clients(), s.requests(), s.batches(),
      s.batches() ? double(s.requests()) / s.batches() : 0.0, s.max_batch_requests(), s.errors(), s.tokens(),
      s.tokens() / uptime, s.compute_seconds(), s.requests() ? 1e6 * s.wait_seconds() / s.requests() : 0.0,
      s.queue_depth());
}

void Executor::Impl::io_loop() {
  zmq::pollitem_t items[] = {{router.handle(), 0, ZMQ_POLLIN, 0}, {replies_in.handle(), 0, ZMQ_POLLIN, 0}};
  auto last_stats = Clock::now();
  auto last_liveness = Clock::now();
  while (!stopping) {
    zmq::poll(items, 2, kLivenessInterval);
    if (items[0].revents & ZMQ_POLLIN) {
      auto frames = wire::recv_all(router);
      try {
        handle(frames);
      } catch (const std::exception& e) {
        // A request that slipped past validation must not take the executor down.
        spdlog::error("failed handling a message: {}", e.what());
        if (!frames.empty()) send_error(frames[0], 0, proto::INTERNAL, e.what(), false);
      }
    }
    if (items[1].revents & ZMQ_POLLIN) {
      auto frames = wire::recv_all(replies_in);
      for (size_t i = 0; i < frames.size(); ++i) {
        router.send(frames[i], i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
    }
    const auto now = Clock::now();
    if (options.stats_interval_seconds > 0 && now - last_stats > std::chrono::seconds(options.stats_interval_seconds)) {
      log_stats();
      last_stats = now;
    }
    if (now - last_liveness > kLivenessInterval) {
      check_liveness();
      last_liveness = now;
    }
  }
}

void Executor::Impl::accept_channel_call(const std::shared_ptr<SameHostChannel>& channel, const shm::CallHeader& header,
                                         const std::vector<int64_t>& shape) {
  shm::CallHeader h = header;
  proto::ErrorCode code;
  std::string problem = validate_call(h, shape, &code);
  if (problem.empty() && h.sequence != 0 && !channel->orders_by_flags()) {
    problem = "request " + std::to_string(h.request_id) + " is numbered (sequence " + std::to_string(h.sequence) +
              "), but a " + channel->kind() + " call is answered by reply: send it with sequence 0";
    h.sequence = 0;  // so that the refusal goes back as a reply
  }
  if (problem.empty() && h.slot != 0 && (h.slot > shm::kCallSlots || h.sequence == 0)) {
    code = proto::INVALID_ARGUMENT;
    problem = "request " + std::to_string(h.request_id) + " names slot " + std::to_string(h.slot) +
              (h.sequence == 0 ? " without a sequence" : "") + "; a captured call has a sequence and a slot from 1 to " +
              std::to_string(shm::kCallSlots);
    h.slot = 0;  // its result flag cannot be set: the sequence answers it
  }
  if (problem.empty()) {
    const auto& layer = model->layer(h.layer_id);
    const int64_t out_features = h.op == proto::BACKWARD_INPUT ? layer.in_features : layer.out_features;
    const uint64_t element = at::elementSize(layer.dtype);
    const uint64_t in_bytes = h.tokens * h.features * element, out_bytes = h.tokens * out_features * element;
    if (auto payload = channel->check_payload(h, in_bytes, out_bytes); !payload.empty()) {
      code = proto::INVALID_ARGUMENT;
      problem = "request " + std::to_string(h.request_id) + " for layer " + std::to_string(h.layer_id) + " (" +
                layer.name + "): " + payload;
    }
  }
  if (!problem.empty()) {
    errors++;
    channel->refuse(h, code, problem);
    return;
  }
  if (h.in_segment != 0 || h.out_segment != 0) direct_calls++;
  WorkBatcher::Request queued;
  queued.client_id = channel->client_id();
  queued.layer_id = h.layer_id;
  queued.op = to_layer_op(h.op);
  queued.tokens = h.tokens;
  queued.latency = to_latency_class(h.latency_class);
  queued.arrival = Clock::now();
  queued.alone = options.streams > 1 && options.concurrent_tokens > 0 && h.tokens >= options.concurrent_tokens &&
                 channel->orders_by_flags() && model->device().is_cuda();
  if (batcher->runs_alone(queued)) concurrent_calls++;  // its options are fixed: no lock needed
  queued.payload.header = h;
  queued.payload.channel = channel;
  queue(std::move(queued));
}

bool Executor::Impl::poll_channels() {
  bool holding = false;
  for (auto it = channels.begin(); it != channels.end();) {
    const auto& channel = it->second;
    holding = channel->release_replies() || holding;
    // A call is checked once its input is ready, so that a refusal, which releases the client's
    // stream ([Stream-ordered hand-off]), never overtakes the result of the call before it.
    while (auto header = channel->next_request()) {
      accept_channel_call(channel, *header, {header->tokens, header->features});
    }
    holding = channel->waiting() || holding;
    it = channel->broken() ? channels.erase(it) : std::next(it);
  }
  return holding;
}

void Executor::Impl::finish_setups(zmq::socket_t& replies_out) {
  for (auto it = pending_setups.begin(); it != pending_setups.end();) {
    try {
      if (!it->channel->setup_done()) {
        ++it;
        continue;
      }
      proto::Envelope ready;
      ready.mutable_nccl_ready();
      wire::send_to(replies_out, it->identity, ready);
    } catch (const c10::Error& e) {
      errors++;
      send_error_via(replies_out, it->identity, e.what_without_backtrace());
    }
    it = pending_setups.erase(it);
  }
}

// [Batch data path]
// Inputs: ZeroMQ payloads and shm buffers are host memory; cuda-ipc buffers and NCCL receives are
// on the executor's GPU. On a GPU, host inputs are concatenated into one pinned buffer and copied
// up once, NCCL receives land straight in their rows of the batch, and one kernel packs every
// other part into it; the results go back the same way (one
// kernel writes each cuda-ipc client's rows into its buffer; host destinations are filled from the
// GPU by DMA). A batch of one request whose input and destination are both on the executor's
// device is computed straight from the client's buffer into the client's buffer, with no copy; so
// is a batch of such requests that are each large (kInPlaceTokens), one GEMM after another.
// Returns each request's result rows (views into the batch result, or its destination).
std::vector<at::Tensor> Executor::Impl::compute_batch(WorkBatcher::Batch& batch) {
  const at::Device device = model->device();
  auto& requests = batch.requests;
  const auto& layer = model->layer(batch.layer_id);
  const int64_t out_features = batch.op == LayerOp::kBackwardInput ? layer.in_features : layer.out_features;
  const int64_t features = requests[0].payload.header.features;
  // Undefined where the channel receives the input straight into the batch (NCCL): only its rows
  // are known until the batch is allocated.
  std::vector<at::Tensor> inputs;
  for (auto& r : requests) {
    auto& w = r.payload;
    if (!w.channel) {
      inputs.push_back(w.input);
      continue;
    }
    inputs.push_back(w.channel->input(w.header, layer.dtype, {w.header.tokens, w.header.features}));
    w.destination = w.channel->destination(w.header, layer.dtype, {w.header.tokens, out_features});
  }
  auto on_device = [&](size_t i) { return !inputs[i].defined() || inputs[i].device() == device; };
  // Requests that are read and written in place (CUDA IPC buffers) and each large enough to keep
  // the GPU busy alone run one GEMM each, straight from and into the clients' buffers: packing
  // them would add two copies of every row and gain nothing.
  bool in_place = true;
  for (size_t i = 0; i < requests.size() && in_place; ++i) {
    const auto& w = requests[i].payload;
    in_place = w.destination.defined() && w.destination.device() == device && inputs[i].defined() &&
               inputs[i].device() == device && (requests.size() == 1 || w.header.tokens >= kInPlaceTokens);
  }
  if (in_place) {
    std::vector<at::Tensor> rows;
    for (size_t i = 0; i < requests.size(); ++i) {
      auto& w = requests[i].payload;
      const auto compute = [&] { model->compute_into(batch.layer_id, batch.op, inputs[i], w.destination); };
      if (w.channel->compute_replayed(w.header, inputs[i], w.destination, compute)) {
        replayed_calls++;
      } else {
        compute();
      }
      rows.push_back(w.destination);
    }
    return rows;
  }
  // Each request's first row in the batch: on a GPU, host inputs come first (one upload), device
  // inputs after them; the order of rows inside a batch is free.
  std::vector<int64_t> first_row(inputs.size());
  std::vector<at::Tensor> host_inputs;
  int64_t host_tokens = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (on_device(i)) continue;
    host_inputs.push_back(inputs[i]);
    host_tokens += inputs[i].size(0);
  }
  int64_t host_row = 0, device_row = host_tokens;
  for (size_t i = 0; i < inputs.size(); ++i) {
    int64_t& next = on_device(i) ? device_row : host_row;
    first_row[i] = next;
    next += requests[i].payload.header.tokens;
  }
  const auto options = at::TensorOptions().dtype(layer.dtype).device(device);
  at::Tensor x;
  if (host_inputs.size() == 1 && host_inputs[0].is_pinned()) {
    x = host_inputs[0].to(device, /*non_blocking=*/true);  // a pinned shm buffer: DMA straight from it
  } else if (!host_inputs.empty()) {
    // ZeroMQ payloads sit in pageable frames: staged through one pinned buffer.
    auto pinned = at::empty({host_tokens, features}, options.device(at::kCPU).pinned_memory(true));
    at::cat_out(pinned, host_inputs, 0);
    x = pinned.to(device, /*non_blocking=*/true);
  }
  if (inputs.size() == 1 && inputs[0].defined() && on_device(0)) {
    x = inputs[0];  // a single device input is used as it is
  } else if (host_inputs.size() < inputs.size()) {
    // Device inputs: received straight into the batch, or packed into it by one kernel (with the
    // uploaded host block).
    auto packed = at::empty({batch.tokens, features}, options);
    std::vector<at::Tensor> sources, targets;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!on_device(i)) continue;
      auto rows = packed.narrow(0, first_row[i], requests[i].payload.header.tokens);
      if (inputs[i].defined()) {
        sources.push_back(inputs[i]);
        targets.push_back(rows);
      } else {
        requests[i].payload.channel->receive_into(requests[i].payload.header, rows);
      }
    }
    if (!host_inputs.empty()) {
      sources.push_back(x);
      targets.push_back(packed.narrow(0, 0, host_tokens));
    }
    if (!sources.empty()) copy_rows(sources, targets);
    x = packed;
  }
  auto y = model->compute(batch.layer_id, batch.op, x);
  std::vector<at::Tensor> rows;
  for (size_t i = 0; i < inputs.size(); ++i) rows.push_back(y.narrow(0, first_row[i], requests[i].payload.header.tokens));
  return rows;
}

void Executor::Impl::deliver(WorkBatcher::Batch& batch, std::vector<at::Tensor>& results, const std::string& failure,
                             zmq::socket_t& replies_out) {
  auto& requests = batch.requests;
  if (!failure.empty()) {
    for (auto& r : requests) {
      errors++;
      auto& w = r.payload;
      if (w.channel) {
        w.channel->refuse(w.header, proto::INTERNAL, failure);
        continue;
      }
      wire::send_to(replies_out, w.identity.to_string_view(),
                    wire::error_envelope(w.header.request_id, proto::INTERNAL, failure, true));
    }
    return;
  }
  const bool gpu = model->device().is_cuda();
  // 1. Results that go to a destination: one kernel for those on the GPU, copies for host ones.
  std::vector<at::Tensor> sources, targets;
  bool host_copies = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto& w = requests[i].payload;
    if (!w.channel) continue;
    const auto& destination = w.destination;
    if (!destination.defined()) {
      w.channel->deliver(w.header, results[i]);  // NCCL
    } else if (destination.data_ptr() != results[i].data_ptr()) {
      if (destination.is_cuda()) {
        sources.push_back(results[i]);
        targets.push_back(destination);
      } else {
        destination.copy_(results[i], /*non_blocking=*/true);
        host_copies = host_copies || gpu;
      }
    }
  }
  if (!sources.empty()) copy_rows(sources, targets);
  // 2. ZeroMQ replies need the rows in host memory: one pinned copy of theirs.
  std::vector<at::Tensor> host_rows(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].payload.channel) continue;
    host_rows[i] = gpu ? results[i].to(at::TensorOptions().device(at::kCPU).pinned_memory(true), true)
                       : results[i].contiguous();
    host_copies = host_copies || gpu;
  }
  // 3. Make the writes visible: GPU clients order on events or flags; host memory needs the GPU done.
  for (auto& r : requests) {
    if (r.payload.channel) r.payload.channel->finish_writes(r.payload.header);
  }
#ifdef SYMBIOSIS_WITH_CUDA
  if (host_copies) cuda::synchronize_stream(cuda::current_stream(model->device().index()));
#endif
  // 4. Replies.
  for (size_t i = 0; i < requests.size(); ++i) {
    auto& r = requests[i];
    auto& w = r.payload;
    this->requests++;
    this->tokens += r.tokens;
    if (w.channel) {
      w.channel->reply(w.header);
      continue;
    }
    proto::Envelope env;
    auto* reply = env.mutable_reply();
    reply->set_request_id(w.header.request_id);
    reply->set_dtype(wire::to_proto(host_rows[i].scalar_type()));
    reply->add_shape(host_rows[i].size(0));
    reply->add_shape(host_rows[i].size(1));
    replies_out.send(w.identity, zmq::send_flags::sndmore);
    replies_out.send(wire::serialize(env), zmq::send_flags::sndmore);
    replies_out.send(wire::tensor_frame(host_rows[i]), zmq::send_flags::none);
  }
}

void Executor::Impl::run_batch(WorkBatcher::Batch& batch, zmq::socket_t& replies_out) {
  const auto started_at = Clock::now();
  std::vector<at::Tensor> results;
  std::string failure;
  try {
    results = compute_batch(batch);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  const auto computed_at = Clock::now();
  try {
    deliver(batch, results, failure, replies_out);
  } catch (const std::exception& e) {
    spdlog::error("failed delivering a batch of layer {}: {}", batch.layer_id, e.what());
  }
  const auto finished_at = Clock::now();
  const double compute_seconds = std::chrono::duration<double>(finished_at - started_at).count();
  compute_nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(finished_at - started_at).count();
  deliver_nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(finished_at - computed_at).count();
  std::lock_guard<std::mutex> lock(counters_mutex);
  auto& c = counters[batch.layer_id];
  c.batches++;
  (batch.op == LayerOp::kBackwardInput ? c.backward_batches : c.forward_batches)++;
  c.requests += batch.requests.size();
  c.tokens += batch.tokens;
  c.compute_seconds += compute_seconds;
  for (const auto& r : batch.requests) c.wait_seconds += std::chrono::duration<double>(started_at - r.arrival).count();
  max_batch_requests = std::max<uint64_t>(max_batch_requests, batch.requests.size());
}

#ifdef SYMBIOSIS_WITH_CUDA
// One GEMM of the first layer on each compute stream, before any client's: the GEMM library's
// handle and workspace of each stream, and its first allocations, are made now, so the executor's
// memory does not grow with the number of clients whose batches use the streams.
void Executor::Impl::warm_up(cuda::ComputeStreams& streams) {
  if (model->layer_count() == 0) return;
  const auto& layer = model->layer(0);
  // More rows than the few-row kernel takes (kernels/few_rows_gemm.h), so the GEMM library runs.
  const auto x = at::zeros({16, layer.in_features}, at::TensorOptions().dtype(layer.dtype).device(model->device()));
  for (int i = 0; i < options.streams; ++i) {
    streams.use(i);
    model->compute(0, LayerOp::kForward, x);
    cuda::synchronize_stream(cuda::current_stream(model->device().index()));
  }
  streams.use(0);
}
#endif

void Executor::Impl::compute_loop() {
  // OpenMP's thread count and the current CUDA device are per thread: set them where we compute.
  if (options.threads > 0) at::set_num_threads(options.threads);
#ifdef SYMBIOSIS_WITH_CUDA
  std::optional<cuda::ComputeStreams> streams;
  if (model->device().is_cuda()) {
    streams.emplace(model->device().index(), options.streams);
    warm_up(*streams);
  }
#endif
  // Nothing here is differentiated: skip autograd's bookkeeping on every operation.
  c10::InferenceMode inference_mode;
  zmq::socket_t replies_out(context, zmq::socket_type::push);
  replies_out.set(zmq::sockopt::linger, 0);
  replies_out.connect(replies_endpoint);
  const auto spin = std::chrono::microseconds(
      options.spin_us >= 0 ? options.spin_us : shm::default_spin_us(model->device().is_cuda()));
  auto& bell = doorbell.word();
  while (!stopping) {
    // Anything that happens after this read rings the doorbell, so the wait below cannot miss it.
    const uint32_t seen = bell.current();
    std::vector<std::function<void(zmq::socket_t&)>> tasks;
    {
      std::lock_guard<std::mutex> lock(queue_mutex);
      tasks.swap(control_tasks);
    }
    for (auto& task : tasks) task(replies_out);
    finish_setups(replies_out);
    const bool watching = poll_channels();
    const auto now = Clock::now();
    std::optional<WorkBatcher::Batch> batch;
    auto deadline = Clock::time_point::max();
    {
      std::lock_guard<std::mutex> lock(queue_mutex);
      batch = batcher->pop(now);
      if (!batch) deadline = batcher->next_deadline(now);
    }
    if (batch) {
#ifdef SYMBIOSIS_WITH_CUDA
      if (streams) {  // [Compute streams]: in place on the client's stream, or on the first
        const auto& first = batch->requests[0];
        const bool in_place =
            batch->requests.size() == 1 && first.payload.channel && first.payload.channel->orders_by_flags();
        streams->use(in_place ? first.client_id : 0);
      }
#endif
      run_batch(*batch, replies_out);
      continue;
    }
    if (!pending_setups.empty()) deadline = std::min(deadline, now + std::chrono::milliseconds(1));
    if (watching) continue;  // a result or an input about to be ready: look again at once
    shm::wait_until(bell, [&] { return bell.current() != seen; }, spin, deadline);
  }
}

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Executor> Executor::start(const ExecutorOptions& options) {
  options.validate();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  at::Device device(options.device);
  if (device.is_cuda() && !device.has_index()) device = at::Device(at::kCUDA, 0);
  TORCH_CHECK(device.is_cpu() || cuda::cuda_available(), "executor option --device ", options.device,
              ": no CUDA GPU is available here");
  auto checkpoint = Checkpoint::open(options.model_dir);
  impl->model = BaseModel::load(*checkpoint, options.layers, device, options.dtype);
  impl->placement.set_host_id(shm::host_id());
  impl->placement.set_pid(::getpid());
  impl->placement.set_device(options.device);
  if (device.is_cuda()) {
    impl->placement.set_gpu_uuid(cuda::gpu_uuid(device.index()));
    impl->placement.set_mps(cuda::mps_active());
  }
  spdlog::info("loaded {} base layers and {} layer groups ({:.1f} MiB) of model {} from {} on {}{}", impl->model->layers().size(),
               impl->model->groups().size(), impl->model->weight_bytes() / 1048576.0, impl->model->model_hash(), options.model_dir.string(),
               options.device, device.is_cuda() ? (impl->placement.mps() ? " (NVIDIA MPS active)" : " (no NVIDIA MPS)") : "");
  impl->batcher = std::make_unique<WorkBatcher>(options.batching);
  impl->counters.resize(impl->model->layer_count());
  impl->router.set(zmq::sockopt::linger, 0);
  impl->router.set(zmq::sockopt::sndhwm, 0);
  try {
    impl->router.bind(options.listen);
  } catch (const zmq::error_t& e) {
    TORCH_CHECK(false, "cannot listen on ", options.listen, ": ", e.what());
  }
  impl->endpoint = impl->router.get(zmq::sockopt::last_endpoint);
  impl->replies_endpoint = "inproc://replies-" + std::to_string(reinterpret_cast<uintptr_t>(impl.get()));
  impl->replies_in.bind(impl->replies_endpoint);
  Impl* raw = impl.get();
  impl->io_thread = std::thread([raw] { raw->io_loop(); });
  impl->compute_thread = std::thread([raw] { raw->compute_loop(); });
  spdlog::info("serving on {} (batching: {})", impl->endpoint, batching_policy_name(options.batching.policy));
  return std::unique_ptr<Executor>(new Executor(std::move(impl)));
}

Executor::~Executor() { shutdown(); }

std::string Executor::endpoint() const { return impl_->endpoint; }
const BaseModel& Executor::model() const { return *impl_->model; }

ExecutorStats Executor::stats() const {
  return {impl_->clients_now, impl_->same_host_clients_now, impl_->requests,     impl_->errors,
          impl_->tokens,      impl_->compute_nanos * 1e-9,     impl_->direct_calls,
          impl_->concurrent_calls, impl_->replayed_calls};
}

void Executor::shutdown() {
  if (impl_->stopping.exchange(true)) return;
  impl_->doorbell.word().notify();
  if (impl_->compute_thread.joinable()) impl_->compute_thread.join();
  if (impl_->io_thread.joinable()) impl_->io_thread.join();
  for (auto& [key, record] : impl_->clients) {
    if (record.channel) record.channel->abort();
  }
  impl_->log_stats();
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
