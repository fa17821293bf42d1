#include "client_runtime/client.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include "common/checkpoint.h"
#include "transport/client_transport.h"
#include "transport/transport.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

// [Client logs on stderr]
// A tenant's standard output is its own (symbiosis-generate's JSON lines, a script's prints), but
// spdlog's stock default logger writes to it: the client library's warnings (a reconnection, a
// transport's fallback, host decode's spinning threads) would land among the results. Where the
// process has not set a default logger of its own (the stock one has no name), the library's go to
// stderr, once, when the library is loaded.
const bool kLogsOnStderr = [] {
  if (spdlog::default_logger_raw()->name().empty()) spdlog::set_default_logger(spdlog::stderr_color_mt("symbiosis"));
  return true;
}();

}  // namespace

void ClientOptions::validate() const {
  wire::validate_endpoint(endpoint, "client option endpoint");
  TORCH_CHECK(timeout_ms > 0, "client option timeout_ms must be positive, got ", timeout_ms);
  TORCH_CHECK(connect_timeout_ms > 0, "client option connect_timeout_ms must be positive, got ", connect_timeout_ms);
  TORCH_CHECK(reconnect_ms >= 0, "client option reconnect_ms must be >= 0 (0: never reconnect), got ", reconnect_ms);
  TORCH_CHECK(spin_us >= -1, "client option spin_us must be >= 0 (or -1: by device), got ", spin_us);
  TORCH_CHECK(transport == "auto" || parse_transport(transport), "client option transport '", transport,
              "' is not one of auto, ", transport_names());
  TORCH_CHECK(control == "auto" || control == "zmq", "client option control '", control, "' is not one of auto, zmq");
  if (privacy.mask) privacy.validate();
  TORCH_CHECK(executor_key.empty() == key_file.empty(), "client options executor_key and key_file go together: ",
              executor_key.empty() ? "key_file" : "executor_key", " is given without the other");
  try {
    const at::Device d(device);
    TORCH_CHECK(d.is_cpu() || d.is_cuda(), "");
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "client option device '", device, "' should be cpu or cuda:N");
  }
}

// [Executor restart]
// A client outlives its executor's restarts. The connection is lost when the executor says it shuts
// down, when its ZeroMQ connection breaks off, or when it closes a same-host client's local link
// (ExecutorLost, in transport/client_transport.h); the call that finds it so lets the transport go,
// connects again with back-off (100 ms doubling to 2 s) for up to ClientOptions::reconnect_ms,
// handshakes with the same Hello, pinned to the model hash it had, redoes the transport's set-up
// (control segment, payload buffers, shared segments, NCCL communicator) and sends the call again.
// A call is a pure function of its input and the frozen weights, so sending it twice is safe, and
// the caller sees only a slower call. An executor that comes back with another model (another
// hash), with another layer table, or that refuses this client is an error at once, not retried;
// past reconnect_ms the call fails naming the endpoint and the last try's error. Calls ordered on
// the GPU that returned before the loss have void results: the client reconnects and throws
// ResultsLost, for the caller to redo its step. A capture recorded on the old connection is not
// replayed (StepGraph captures again).
namespace {
constexpr auto kFirstPause = std::chrono::milliseconds(100);
constexpr auto kLongestPause = std::chrono::seconds(2);
constexpr int kStepTries = 3;  // redo_if_results_lost

// An op as the executor's trace names it ([Traces] in base_executor/tracing.h).
const char* op_name(proto::Op op) {
  switch (op) {
    case proto::FORWARD: return "forward";
    case proto::BACKWARD_INPUT: return "backward";
    case proto::FORWARD_NO_BIAS: return "forward_no_bias";
    default: return "?";
  }
}

// [Back-pressure]
// An executor whose queue is full refuses a call with RESOURCE_EXHAUSTED when the call's client
// holds at least its fair share of the queue ([Fair shares] in base_executor/overload.h): that is
// back-pressure, not an error, and the client sends the call again after a pause, from
// kFirstBusyPause doubling to kLongestBusyPause, each drawn at random between half and all of it (so
// that clients refused together do not come back together), until the call timeout
// (ClientOptions::timeout_ms) has passed since its first refusal; then the call fails naming the
// overload, how long and how many times it was sent, and the executor's last refusal. A call over
// the executor's --max-request-bytes (the Welcome's max_request_bytes) is refused with the same code
// for good: it fails at once. Each sending is a new request (a new id), so a late answer to an
// earlier one is never taken for it. Covered: calls answered by reply, which the transport can send
// again (ExecutorBusy in transport/client_transport.h): tcp, and shm and cuda-ipc without
// [Stream-ordered hand-off] (shm always; cuda-ipc with control "zmq"). Not covered: a cuda-ipc call
// ordered on the GPU has returned before its refusal comes back; the refusal voids its result and
// is thrown at the client's next call or settle(), as before. Nor nccl: a refused call aborts its
// communicator, and the error is as before. A Client waits for each call's result before it sends
// the next, so under the executor's rule its calls go into an empty share and are not refused for
// the queue at all: the retries are for an executor that refuses them anyway (one older than the
// rule, whose queue was one pool for everyone).
constexpr auto kFirstBusyPause = std::chrono::microseconds(250);
constexpr auto kLongestBusyPause = std::chrono::milliseconds(32);

// A layer table as bytes, to tell an executor that came back serving other layers.
std::string table_of(const proto::Welcome& welcome) {
  std::string table;
  for (const auto& layer : welcome.layers()) table += layer.SerializeAsString();
  for (const auto& group : welcome.groups()) table += group.SerializeAsString();
  return table;
}
}  // namespace

class Client::Impl {
 public:
  explicit Impl(const ClientOptions& o) : options(o), keys(keys_of(o)) {}

  static ClientKeys keys_of(const ClientOptions& o) {
    if (o.executor_key.empty()) return {};
    return {keys::public_key(o.executor_key), keys::read(o.key_file, /*need_secret=*/true)};
  }

  ClientOptions options;
  ClientKeys keys;
  proto::Envelope hello;  // every connection's; pinned to the first one's model hash
  std::unique_ptr<ControlSocket> socket;
  std::unique_ptr<ClientTransport> transport;  // uses *socket: goes first
  uint64_t connection = 0;                     // [Executor restart]: connections made
  std::string layer_table;                     // the first Welcome's, as table_of() writes it
  std::string transport_name;
  uint64_t client_id = 0;
  std::string model_hash;
  uint64_t max_request_bytes = 0;  // the Welcome's: a call past it is refused for good ([Back-pressure])
  std::vector<LayerInfo> layers;
  std::unordered_map<std::string, size_t> by_name;
  std::vector<LayerInfo> groups;

  std::mutex call_mutex;         // serializes calls: one transport, one buffer
  uint64_t next_request_id = 1;  // guarded by call_mutex
  std::atomic<proto::LatencyClass> latency{proto::FINE_TUNING};
  std::atomic<uint64_t> calls{0};                   // sent: a capture's recordings count when a replay sends them
  bool capturing = false;                           // guarded by call_mutex
  std::unique_ptr<NoiseMask> mask;                  // [Noise masking], when the client asked for it
  std::minstd_rand jitter{std::random_device{}()};  // [Back-pressure]'s pauses; guarded by call_mutex

  // [Noise masking] with effects computed here: the base weights of a layer or group from the
  // checkpoint the options name, which must be the executor's model, rounded as the executor
  // holds them. Empty without effects_checkpoint.
  NoiseMask::LoadWeights effect_weights() {
    const auto& dir = options.privacy.effects_checkpoint;
    if (dir.empty()) return {};
    std::shared_ptr<Checkpoint> checkpoint = Checkpoint::open(dir);
    TORCH_CHECK(checkpoint->model_hash() == model_hash, "privacy option effects_checkpoint: ", dir,
                " holds another model than the executor's (model hash ", checkpoint->model_hash(), ", the executor's ",
                model_hash, ")");
    return [this, checkpoint](const LayerInfo& layer) {
      auto one = [&](const LayerInfo& l) {
        auto weight = checkpoint->tensor(l.name + ".weight");
        if (l.kind == LayerKind::kConv1D) weight = weight.t();  // [in, out] -> [out, in]
        NoiseMask::Weights w{weight.to(l.dtype).to(at::kFloat), {}};
        if (l.bias) w.bias = checkpoint->tensor(l.name + ".bias").to(l.dtype).to(at::kFloat);
        return w;
      };
      if (layer.members.empty()) return one(layer);
      std::vector<at::Tensor> weights, biases;
      for (const uint32_t id : layer.members) {
        const auto member = std::find_if(layers.begin(), layers.end(), [id](const LayerInfo& l) { return l.id == id; });
        TORCH_CHECK(member != layers.end(), "internal: group '", layer.name, "' names layer ", id,
                    ", which is not served");
        auto w = one(*member);
        weights.push_back(w.weight);
        if (w.bias.defined()) biases.push_back(w.bias);
      }
      return NoiseMask::Weights{at::cat(weights, 0), biases.empty() ? at::Tensor() : at::cat(biases, 0)};
    };
  }

  // The masked calls' way to the executor: `layer`'s calls, as the mask names them.
  NoiseMask::Send sender(const LayerInfo& layer) {
    return [this, &layer](NoiseMask::Op op, const at::Tensor& x) {
      return call(layer,
                  op == NoiseMask::Op::kForward         ? proto::FORWARD
                  : op == NoiseMask::Op::kForwardNoBias ? proto::FORWARD_NO_BIAS
                                                        : proto::BACKWARD_INPUT,
                  x);
    };
  }

  // Connects (a new socket) and handshakes; returns the Welcome. Throws as ControlSocket does.
  proto::Welcome handshake(int connect_timeout_ms) {
    transport.reset();
    socket = std::make_unique<ControlSocket>(options.endpoint, options.timeout_ms, keys, connect_timeout_ms);
    return socket->handshake(hello);
  }

  // Takes the Welcome of connection number `connection`: the layer table (the first time; later,
  // checks it is the same), the client id and the transport it names.
  void adopt(const proto::Welcome& welcome) {
    if (connection == 0) {
      model_hash = welcome.model_hash();
      hello.mutable_hello()->set_expected_model_hash(model_hash);
      layer_table = table_of(welcome);
      for (const auto& layer : welcome.layers()) {
        by_name[layer.name()] = layers.size();
        layers.push_back(wire::from_proto(layer));
      }
      for (const auto& group : welcome.groups()) groups.push_back(wire::from_proto(group));
    } else {
      TORCH_CHECK(table_of(welcome) == layer_table, "the executor at ", options.endpoint,
                  " came back serving another layer table than this client's (same model hash ", model_hash,
                  ", other --layer-pattern, --layer-groups or --dtype?); connect a new Client");
    }
    client_id = welcome.client_id();
    max_request_bytes = welcome.max_request_bytes();
    const auto kind = parse_transport(welcome.transport().empty() ? "tcp" : welcome.transport());
    TORCH_CHECK(kind, "executor chose transport '", welcome.transport(),
                "', which this client does not know (it knows ", transport_names(), ")");
    transport_name = symbiosis::transport_name(*kind);
    const ClientEndOptions end_options{at::Device(options.device), options.spin_us, options.direct_operands};
    transport = plugin(*kind).make_client(*socket, welcome, end_options);
    connection++;
  }

  // [Executor restart]: after `lost`, connects again until reconnect_ms has passed. Holds call_mutex.
  void reconnect(const ExecutorLost& lost) {
    const std::string why = lost.msg();
    if (options.reconnect_ms == 0) {
      throw ExecutorLost({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                         why +
                             "; this client does not reconnect (reconnect_ms is 0): connect a new Client once the "
                             "executor is back");
    }
    using Clock = std::chrono::steady_clock;
    spdlog::warn("client {} (tenant '{}'): {}; connecting again (for up to {} ms)", client_id, options.tenant, why,
                 options.reconnect_ms);
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(options.reconnect_ms);
    auto pause = std::chrono::duration_cast<Clock::duration>(kFirstPause);
    std::string last_try;
    for (int attempt = 1;; ++attempt) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      try {
        adopt(handshake(static_cast<int>(std::clamp<int64_t>(left, 1, options.connect_timeout_ms))));
        const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        spdlog::info("reconnected to the executor at {} after {} ms (try {}): client {}, transport {}",
                     options.endpoint, took, attempt, client_id, transport_name);
        return;
      } catch (const c10::Error& e) {
        // An executor that answered and refused (another model, a key no longer admitted, a
        // layer table that changed) will refuse again.
        const bool refused = socket && socket->heard() && dynamic_cast<const ExecutorLost*>(&e) == nullptr;
        TORCH_CHECK(!refused, why, "; the executor there now refuses this client: ", e.msg());
        last_try = e.msg();
      }
      TORCH_CHECK(Clock::now() + pause < deadline, why, "; no executor took this client back at ", options.endpoint,
                  " within ", options.reconnect_ms, " ms (client option reconnect_ms; tries: ", attempt,
                  ", the last: ", last_try, ")");
      spdlog::info("the executor at {} is not back yet ({}); trying again in {} ms", options.endpoint, last_try,
                   std::chrono::duration_cast<std::chrono::milliseconds>(pause).count());
      std::this_thread::sleep_for(pause);
      pause = std::min<Clock::duration>(pause * 2, kLongestPause);
    }
  }

  // The transport. A client whose reconnection failed has none: it tries again first (and throws
  // why, as reconnect() does, when it cannot).
  ClientTransport& live_transport() {
    if (!transport) {
      reconnect(ExecutorLost(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
          "the connection to the executor at " + options.endpoint + " was lost, and connecting again failed before"));
    }
    return *transport;
  }

  // Runs `work` (a use of the transport) and, when the executor is lost, reconnects and runs it
  // again; throws ResultsLost instead where calls made before it lost their results, where a
  // capture was under way, or where `work` cannot be run again (`retry` false: a replay, whose
  // graph ran already). Holds call_mutex.
  template <typename Work>
  auto survive_restarts(Work&& work, bool retry = true) {
    while (true) {
      try {
        return work();
      } catch (const ExecutorLost& lost) {
        const bool results_lost = !retry || capturing || (transport && transport->results_lost());
        reconnect(lost);
        // A capture under way is void: it ends on the new transport, and its step is captured again.
        if (capturing) transport->begin_capture();
        if (results_lost) {
          throw ResultsLost({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                            lost.msg() +
                                ", while calls ordered on the GPU waited for their results, which are void; "
                                "the client has connected again: redo the work since the last settle()");
        }
      }
    }
  }

  at::Tensor call(const LayerInfo& layer, proto::Op op, const at::Tensor& x) {
    // Checked here as the executor would, for every transport: the refusal of a call ordered on
    // the GPU ([Stream-ordered hand-off]) would reach the caller only at its next call.
    const bool backward = op == proto::BACKWARD_INPUT;
    const int64_t features = backward ? layer.out_features : layer.in_features;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == features && x.scalar_type() == layer.dtype, "layer '", layer.name, "' (",
                backward ? "backward" : "forward", ") takes [tokens, ", features, "] in ", layer.dtype, ", got ",
                x.sizes(), " in ", x.scalar_type());
    std::lock_guard<std::mutex> lock(call_mutex);
    // One scope per call for profilers, naming it as the executor's batch does ([Traces] in
    // base_executor/tracing.h); built only while one listens.
    std::string scope;
    at::RecordFunction guard(at::RecordScope::USER_SCOPE);
    if (guard.isActive()) {
      scope = "symbiosis::call c" + std::to_string(client_id) + ":r" + std::to_string(next_request_id) + " " +
              layer.name + " " + op_name(op);
      guard.before(scope);
    }
    if (!capturing) calls++;
    // Every payload reads the input's rows as they lie in memory.
    const at::Tensor input = x.contiguous();
    return survive_restarts([&] {
      return send_until_taken(layer, input, [&] {
        CallSpec spec{&layer, op, next_request_id++, latency.load(), backward ? layer.in_features : layer.out_features};
        return live_transport().call(spec, input);
      });
    });
  }

  // [Back-pressure]: runs `send` (one sending of a call of `input` to `layer`) again after a pause
  // while the executor refuses it for overload, until the call timeout. Holds call_mutex.
  template <typename Send>
  at::Tensor send_until_taken(const LayerInfo& layer, const at::Tensor& input, Send&& send) {
    using Clock = std::chrono::steady_clock;
    // Every call comes here, hundreds an iteration: nothing is computed until a refusal.
    Clock::time_point start, deadline;
    auto pause = std::chrono::duration_cast<Clock::duration>(kFirstBusyPause);
    for (int sendings = 1;; ++sendings) {
      try {
        return send();
      } catch (const ExecutorBusy& busy) {
        if (sendings == 1) {
          // As the executor compares (base_executor/call_check.cpp): by rows, so nothing overflows.
          const uint64_t row_bytes = static_cast<uint64_t>(input.size(1)) * input.element_size();
          if (max_request_bytes > 0 && row_bytes > 0 &&
              static_cast<uint64_t>(input.size(0)) > max_request_bytes / row_bytes) {
            throw;  // over --max-request-bytes: refused for good
          }
          start = Clock::now();
          deadline = start + std::chrono::milliseconds(options.timeout_ms);
        }
        const auto drawn = std::uniform_int_distribution<Clock::rep>(pause.count() / 2, pause.count())(jitter);
        const auto nap = Clock::duration(drawn);
        const auto now = Clock::now();
        if (now + nap >= deadline) {
          const auto retried = std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count();
          TORCH_CHECK(false, "the executor at ", options.endpoint, " is overloaded: it refused the call on layer '",
                      layer.name, "' (", input.size(0), " tokens) ", sendings, " times over ", retried,
                      " ms of retries, until the call timeout of ", options.timeout_ms,
                      " ms (client option timeout_ms) passed; its last refusal: ", busy.msg());
        }
        std::this_thread::sleep_for(nap);
        pause = std::min<Clock::duration>(pause * 2, kLongestBusyPause);
      }
    }
  }
};

void redo_if_results_lost(const std::string& what, const std::function<void()>& step) {
  for (int tries = 1;; ++tries) {
    try {
      return step();
    } catch (const ResultsLost& lost) {
      TORCH_CHECK(tries < kStepTries, lost.msg(), " (", what, " was tried ", tries, " times)");
      spdlog::warn("{}: {}; running it again", what, lost.msg());
    }
  }
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::shared_ptr<Client> Client::connect(const ClientOptions& options) {
  options.validate();
  auto impl = std::make_unique<Impl>(options);
  auto& hello = *impl->hello.mutable_hello();
  hello.set_protocol_version(wire::kProtocolVersion);
  hello.set_tenant(options.tenant);
  hello.set_expected_model_hash(options.expected_model_hash);
  hello.set_transport(options.transport);
  hello.set_control(options.control);
  hello.set_lane(options.lane);
  *hello.mutable_placement() = local_placement(options.device);
  impl->adopt(impl->handshake(options.connect_timeout_ms));
  impl->latency = wire::to_proto(options.latency_class);
  if (options.privacy.mask) impl->mask = std::make_unique<NoiseMask>(options.privacy, impl->effect_weights());
  return std::shared_ptr<Client>(new Client(std::move(impl)));
}

Client::~Client() {
  try {
    impl_->transport.reset();
    proto::Envelope bye;
    bye.mutable_goodbye();
    impl_->socket->send(bye);
  } catch (...) {
    // Leaving quietly is fine: the executor forgets clients that are gone.
  }
}

uint64_t Client::client_id() const { return impl_->client_id; }
const std::string& Client::model_hash() const { return impl_->model_hash; }
const std::vector<LayerInfo>& Client::layers() const { return impl_->layers; }
uint64_t Client::calls() const { return impl_->calls; }
uint64_t Client::connection() const { return impl_->connection; }
const std::string& Client::transport() const { return impl_->transport_name; }

const std::vector<LayerInfo>& Client::groups() const { return impl_->groups; }

const LayerInfo* Client::group(const std::vector<uint32_t>& members, const std::string& activation) const {
  // [MLP blocks]: a masked input cannot pass a block's activation (the noise would not come off).
  if (!activation.empty() && impl_->mask) return nullptr;
  const auto& groups = impl_->groups;
  for (const auto& group : groups) {
    if (group.members != members || group.activation != activation) continue;
    // [MLP bridges] (a block's entry first) go over TCP alone: there a hand-off costs more than
    // the work a bridge adds; over shared memory and CUDA IPC they measured level (docs/inference.md).
    const bool bridge = std::any_of(groups.begin(), groups.end(), [&](const LayerInfo& entry) {
      return entry.id == members.at(0) && !entry.activation.empty();
    });
    return bridge && impl_->transport_name != "tcp" ? nullptr : &group;
  }
  return nullptr;
}

const LayerInfo* Client::find_layer(const std::string& name) const {
  auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : &impl_->layers[it->second];
}

void Client::set_latency_class(LatencyClass c) { impl_->latency = wire::to_proto(c); }
LatencyClass Client::latency_class() const { return wire::latency_from_proto(impl_->latency.load()); }

void Client::begin_capture() {
  {
    std::lock_guard<std::mutex> lock(impl_->call_mutex);
    impl_->live_transport().begin_capture();
    impl_->capturing = true;
  }
  if (impl_->mask) impl_->mask->begin_capture();
}

std::shared_ptr<const CapturedCalls> Client::end_capture() {
  std::shared_ptr<const CapturedCalls> calls;
  {
    std::lock_guard<std::mutex> lock(impl_->call_mutex);
    impl_->capturing = false;
    auto recorded = impl_->live_transport().end_capture();
    if (recorded) {
      auto stamped = std::make_shared<CapturedCalls>(*recorded);
      stamped->connection = impl_->connection;
      calls = std::move(stamped);
    }
  }
  if (!impl_->mask) return calls;
  // [Masked captures]: each replay counts the banks' calls (and redraws those then due).
  auto masked = std::make_shared<CapturedCalls>(calls ? *calls : CapturedCalls{.connection = impl_->connection});
  masked->after_replay = [impl = impl_.get(), use = impl_->mask->end_capture()] {
    impl->mask->replayed(use, [impl](const LayerInfo& layer) { return impl->sender(layer); });
  };
  return masked;
}

bool Client::can_capture() const {
  std::lock_guard<std::mutex> lock(impl_->call_mutex);
  return impl_->transport && impl_->transport->can_capture();
}

bool Client::replayable(const CapturedCalls& calls) const { return calls.connection == impl_->connection; }

void Client::replay(const CapturedCalls& calls) {
  {
    std::lock_guard<std::mutex> lock(impl_->call_mutex);
    TORCH_CHECK(calls.connection == impl_->connection, "replay: these calls were captured on connection ",
                calls.connection, " to the executor, and the client is on connection ", impl_->connection,
                " since the executor restarted; capture the step again");
    const uint64_t first = impl_->next_request_id;
    impl_->next_request_id += calls.records.size();
    impl_->calls += calls.records.size();
    // [Traces] (base_executor/tracing.h): the replayed calls' request ids, for a profiler.
    std::string scope;
    at::RecordFunction guard(at::RecordScope::USER_SCOPE);
    if (guard.isActive() && !calls.records.empty()) {
      scope = "symbiosis::replay c" + std::to_string(impl_->client_id) + ":r" + std::to_string(first) + "-r" +
              std::to_string(first + calls.records.size() - 1);
      guard.before(scope);
    }
    // A loss here leaves the replay's calls without results: ResultsLost, after reconnecting.
    impl_->survive_restarts([&] { impl_->live_transport().replay(calls, first); }, /*retry=*/false);
  }
  // Outside the call lock: a bank redrawn there asks the executor for its effects.
  if (calls.after_replay) calls.after_replay();
}

void Client::settle() {
  std::lock_guard<std::mutex> lock(impl_->call_mutex);
  impl_->survive_restarts([&] { impl_->live_transport().settle(); });
}

at::Tensor Client::forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias) {
  if (impl_->mask) return impl_->mask->forward(layer, x, with_bias, impl_->sender(layer));
  return impl_->call(layer, with_bias ? proto::FORWARD : proto::FORWARD_NO_BIAS, x);
}

at::Tensor Client::backward_input(const LayerInfo& layer, const at::Tensor& grad_out) {
  if (impl_->mask) return impl_->mask->backward_input(layer, grad_out, impl_->sender(layer));
  return impl_->call(layer, proto::BACKWARD_INPUT, grad_out);
}

const ClientOptions& Client::options() const { return impl_->options; }
bool Client::same_layer_table(const Client& other) const { return impl_->layer_table == other.impl_->layer_table; }

const NoiseMask* Client::noise_mask() const { return impl_->mask.get(); }
NoiseMask* Client::noise_mask() { return impl_->mask.get(); }

}  // namespace symbiosis
