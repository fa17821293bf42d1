#include "base_executor/executor.h"

#include <c10/util/Exception.h>
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "base_executor/batching.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

using Clock = std::chrono::steady_clock;

// What a queued request carries besides what the Batcher decides on.
struct Work {
  zmq::message_t identity;
  proto::Request request;
  at::Tensor input;
};
using WorkBatcher = Batcher<Work>;

LatencyClass to_latency_class(proto::LatencyClass c) {
  switch (c) {
    case proto::INFERENCE_DECODE: return LatencyClass::kInferenceDecode;
    case proto::INFERENCE_PREFILL: return LatencyClass::kInferencePrefill;
    default: return LatencyClass::kFineTuning;
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
};

LayerOp to_layer_op(proto::Op op) {
  switch (op) {
    case proto::BACKWARD_INPUT: return LayerOp::kBackwardInput;
    case proto::FORWARD_NO_BIAS: return LayerOp::kForwardNoBias;
    default: return LayerOp::kForward;
  }
}

// Clients idle this long without a Goodbye are forgotten (they died or left).
constexpr auto kClientIdleLimit = std::chrono::minutes(10);

}  // namespace

void ExecutorOptions::validate() const {
  TORCH_CHECK(!model_dir.empty(), "executor option --model is required (a Hugging Face checkpoint directory)");
  TORCH_CHECK(listen.rfind("tcp://", 0) == 0 || listen.rfind("ipc://", 0) == 0 || listen.rfind("inproc://", 0) == 0,
              "executor option --listen '", listen, "' should be a ZeroMQ endpoint like tcp://127.0.0.1:5555");
  TORCH_CHECK(max_request_bytes > 0, "executor option --max-request-bytes must be positive");
  TORCH_CHECK(stats_interval_seconds >= 0, "executor option --stats-interval must be >= 0");
  batching.validate();
  TORCH_CHECK(threads >= 0, "executor option --threads must be >= 0, got ", threads);
}

class Executor::Impl {
 public:
  ExecutorOptions options;
  std::unique_ptr<BaseModel> model;
  zmq::context_t context{1};
  zmq::socket_t router{context, zmq::socket_type::router};
  zmq::socket_t replies_in{context, zmq::socket_type::pull};
  std::string endpoint;
  std::string replies_endpoint;
  std::atomic<bool> stopping{false};
  std::thread io_thread;
  std::thread compute_thread;

  // Requests validated by the IO thread, waiting for the compute thread. See [Opportunistic batching].
  std::mutex queue_mutex;
  std::condition_variable queue_cv;     // signalled on push, on client changes and on stop
  std::unique_ptr<WorkBatcher> batcher;  // guarded by queue_mutex

  std::mutex counters_mutex;
  std::vector<LayerCounters> counters;  // per layer id; guarded by counters_mutex
  uint64_t max_batch_requests = 0;      // guarded by counters_mutex
  const Clock::time_point started = Clock::now();

  // Owned by the IO thread.
  std::map<std::string, ClientRecord> clients;
  uint64_t next_client_id = 1;

  std::atomic<uint64_t> clients_now{0}, requests{0}, errors{0}, tokens{0};
  std::atomic<uint64_t> compute_nanos{0};

  std::mutex done_mutex;
  std::condition_variable done_cv;  // signalled when shutdown completes
  bool done = false;                // guarded by done_mutex

  void io_loop();
  void compute_loop();
  void handle(std::vector<zmq::message_t>& frames);
  void send_error(zmq::message_t& identity, uint64_t request_id, proto::ErrorCode code, const std::string& message,
                  bool as_reply);
  std::string validate(const proto::Request& r, const std::vector<zmq::message_t>& frames, proto::ErrorCode* code) const;
  void log_stats();
  void run_batch(WorkBatcher::Batch& batch, zmq::socket_t& replies_out);
  proto::Stats collect_stats();
  void forget_client(const std::string& key);
};

void Executor::Impl::send_error(zmq::message_t& identity, uint64_t request_id, proto::ErrorCode code,
                                const std::string& message, bool as_reply) {
  errors++;
  proto::Envelope env;
  proto::Error* err = as_reply ? env.mutable_reply()->mutable_error() : env.mutable_error();
  if (as_reply) env.mutable_reply()->set_request_id(request_id);
  err->set_code(code);
  err->set_message(message);
  spdlog::debug("error to client: {}", message);
  router.send(zmq::message_t(identity.data(), identity.size()), zmq::send_flags::sndmore);
  router.send(wire::serialize(env), zmq::send_flags::none);
}

std::string Executor::Impl::validate(const proto::Request& r, const std::vector<zmq::message_t>& frames,
                                     proto::ErrorCode* code) const {
  const auto& layers = model->layers();
  if (r.layer_id() >= layers.size()) {
    *code = proto::NOT_FOUND;
    return "unknown layer id " + std::to_string(r.layer_id()) + " (this executor serves " +
           std::to_string(layers.size()) + " layers, ids 0.." + std::to_string(layers.size() - 1) + ")";
  }
  const auto& layer = layers[r.layer_id()];
  const std::string where = "request " + std::to_string(r.request_id()) + " for layer " +
                            std::to_string(layer.id) + " (" + layer.name + ")";
  *code = proto::INVALID_ARGUMENT;
  if (r.op() != proto::FORWARD && r.op() != proto::BACKWARD_INPUT && r.op() != proto::FORWARD_NO_BIAS) {
    return where + ": op " + std::to_string(r.op()) + " is not FORWARD, BACKWARD_INPUT or FORWARD_NO_BIAS";
  }
  const auto expected_dtype = wire::to_proto(layer.dtype);
  if (r.dtype() != expected_dtype) {
    return where + ": dtype " + proto::DType_Name(r.dtype()) + " does not match the layer's " +
           proto::DType_Name(expected_dtype);
  }
  const int64_t features = r.op() == proto::BACKWARD_INPUT ? layer.out_features : layer.in_features;
  if (r.shape_size() != 2 || r.shape(0) < 1 || r.shape(1) != features) {
    std::string shape = "[";
    for (int i = 0; i < r.shape_size(); ++i) shape += (i ? ", " : "") + std::to_string(r.shape(i));
    return where + " (" + wire::op_name(r.op()) + "): shape " + shape + "] should be [tokens >= 1, " +
           std::to_string(features) + "]";
  }
  const uint64_t bytes = static_cast<uint64_t>(r.shape(0)) * r.shape(1) * at::elementSize(layer.dtype);
  if (bytes > options.max_request_bytes) {
    *code = proto::RESOURCE_EXHAUSTED;
    return where + ": " + std::to_string(bytes) + " bytes exceed the executor's limit of " +
           std::to_string(options.max_request_bytes) + " bytes (--max-request-bytes)";
  }
  *code = proto::MALFORMED;
  if (frames.size() != 3) {
    return where + ": expected exactly one payload frame after the header, got " + std::to_string(frames.size() - 2);
  }
  if (frames[2].size() != bytes) {
    return where + ": payload has " + std::to_string(frames[2].size()) + " bytes, expected " + std::to_string(bytes) +
           " for its shape and dtype";
  }
  return "";
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
    case proto::Envelope::kHello: {
      const auto& hello = env.hello();
      if (hello.protocol_version() != wire::kProtocolVersion) {
        send_error(identity, 0, proto::FAILED_PRECONDITION,
                   "client speaks protocol " + std::to_string(hello.protocol_version()) + ", executor speaks " +
                       std::to_string(wire::kProtocolVersion), false);
        return;
      }
      if (!hello.expected_model_hash().empty() && hello.expected_model_hash() != model->model_hash()) {
        send_error(identity, 0, proto::FAILED_PRECONDITION,
                   "model mismatch: the client was built for model " + hello.expected_model_hash() +
                       ", but this executor serves model " + model->model_hash() + " (" + options.model_dir.string() +
                       ")", false);
        return;
      }
      if (client == clients.end()) {
        client = clients.emplace(key, ClientRecord{next_client_id++, hello.tenant(), Clock::now()}).first;
        clients_now = clients.size();
        {
          std::lock_guard<std::mutex> lock(queue_mutex);
          batcher->add_client(client->second.id);
        }
        queue_cv.notify_one();
        spdlog::info("client {} (tenant '{}') connected", client->second.id, hello.tenant());
      }
      proto::Envelope reply;
      auto* welcome = reply.mutable_welcome();
      welcome->set_client_id(client->second.id);
      welcome->set_model_hash(model->model_hash());
      welcome->set_max_request_bytes(options.max_request_bytes);
      welcome->set_executor_version("symbiosis 0.1.0");
      for (const auto& layer : model->layers()) *welcome->add_layers() = wire::to_proto(layer);
      router.send(identity, zmq::send_flags::sndmore);
      router.send(wire::serialize(reply), zmq::send_flags::none);
      return;
    }
    case proto::Envelope::kRequest: {
      const auto& r = env.request();
      if (client == clients.end()) {
        send_error(identity, r.request_id(), proto::FAILED_PRECONDITION,
                   "request " + std::to_string(r.request_id()) + " before the handshake: send Hello first", true);
        return;
      }
      proto::ErrorCode code;
      std::string problem = validate(r, frames, &code);
      if (!problem.empty()) {
        send_error(identity, r.request_id(), code, problem, true);
        return;
      }
      const auto& layer = model->layers()[r.layer_id()];
      WorkBatcher::Request queued;
      queued.client_id = client->second.id;
      queued.layer_id = r.layer_id();
      queued.op = to_layer_op(r.op());
      queued.tokens = r.shape(0);
      queued.latency = to_latency_class(r.latency_class());
      queued.arrival = Clock::now();
      queued.payload.input = wire::frame_to_tensor(std::move(frames[2]), layer.dtype, {r.shape(0), r.shape(1)});
      queued.payload.identity = std::move(identity);
      queued.payload.request = r;
      {
        std::lock_guard<std::mutex> lock(queue_mutex);
        batcher->push(std::move(queued));
      }
      queue_cv.notify_one();
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
      router.send(identity, zmq::send_flags::sndmore);
      router.send(wire::serialize(reply), zmq::send_flags::none);
      return;
    }
    default:
      send_error(identity, 0, proto::MALFORMED, "unexpected message: the executor takes Hello, Request, Goodbye and StatsRequest", false);
  }
}

void Executor::Impl::forget_client(const std::string& key) {
  auto it = clients.find(key);
  if (it == clients.end()) return;
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    batcher->remove_client(it->second.id);
  }
  queue_cv.notify_one();  // lockstep queues may be ready now
  clients.erase(it);
  clients_now = clients.size();
}

proto::Stats Executor::Impl::collect_stats() {
  proto::Stats s;
  s.set_clients(clients_now);
  s.set_requests(requests);
  s.set_errors(errors);
  s.set_tokens(tokens);
  s.set_compute_seconds(compute_nanos * 1e-9);
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
    layer->set_name(model->layers()[id].name);
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
  auto last_prune = Clock::now();
  while (!stopping) {
    zmq::poll(items, 2, std::chrono::milliseconds(100));
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
    if (now - last_prune > std::chrono::seconds(10)) {
      std::vector<std::string> idle;
      for (const auto& [key, record] : clients) {
        if (now - record.last_seen > kClientIdleLimit) idle.push_back(key);
      }
      for (const auto& key : idle) forget_client(key);
      last_prune = now;
    }
  }
}

void Executor::Impl::run_batch(WorkBatcher::Batch& batch, zmq::socket_t& replies_out) {
  const auto started_at = Clock::now();
  at::Tensor out;
  std::string failure;
  try {
    std::vector<at::Tensor> inputs;
    inputs.reserve(batch.requests.size());
    for (auto& r : batch.requests) inputs.push_back(r.payload.input);
    // Padding-free: the requests' tokens, concatenated.
    auto x = inputs.size() == 1 ? inputs[0] : at::cat(inputs, 0);
    out = model->compute(batch.layer_id, batch.op, x.to(model->device()));
    out = out.to(at::kCPU).contiguous();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  const auto finished_at = Clock::now();
  const double compute_seconds = std::chrono::duration<double>(finished_at - started_at).count();
  compute_nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(finished_at - started_at).count();
  {
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
  int64_t offset = 0;
  for (auto& r : batch.requests) {
    proto::Envelope env;
    auto* reply = env.mutable_reply();
    reply->set_request_id(r.payload.request.request_id());
    replies_out.send(r.payload.identity, zmq::send_flags::sndmore);
    if (!failure.empty()) {
      errors++;
      reply->mutable_error()->set_code(proto::INTERNAL);
      reply->mutable_error()->set_message(failure);
      replies_out.send(wire::serialize(env), zmq::send_flags::none);
      continue;
    }
    auto rows = out.narrow(0, offset, r.tokens);  // each request gets its own rows back
    offset += r.tokens;
    reply->set_dtype(wire::to_proto(rows.scalar_type()));
    reply->add_shape(rows.size(0));
    reply->add_shape(rows.size(1));
    requests++;
    tokens += r.tokens;
    replies_out.send(wire::serialize(env), zmq::send_flags::sndmore);
    replies_out.send(wire::tensor_frame(rows), zmq::send_flags::none);
  }
}

void Executor::Impl::compute_loop() {
  // OpenMP's thread count is per calling thread: set it on the thread that computes.
  if (options.threads > 0) at::set_num_threads(options.threads);
  zmq::socket_t replies_out(context, zmq::socket_type::push);
  replies_out.set(zmq::sockopt::linger, 0);
  replies_out.connect(replies_endpoint);
  std::unique_lock<std::mutex> lock(queue_mutex);
  while (!stopping) {
    const auto now = Clock::now();
    auto batch = batcher->pop(now);
    if (!batch) {
      const auto deadline = batcher->next_deadline(now);
      if (deadline == Clock::time_point::max()) {
        queue_cv.wait(lock);
      } else {
        queue_cv.wait_until(lock, deadline);
      }
      continue;
    }
    lock.unlock();
    run_batch(*batch, replies_out);
    lock.lock();
  }
}

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Executor> Executor::start(const ExecutorOptions& options) {
  options.validate();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  const at::Device device(options.device);
  auto checkpoint = Checkpoint::open(options.model_dir);
  impl->model = BaseModel::load(*checkpoint, options.layers, device, options.dtype);
  spdlog::info("loaded {} base layers ({:.1f} MiB) of model {} from {} on {}", impl->model->layers().size(),
               impl->model->weight_bytes() / 1048576.0, impl->model->model_hash(), options.model_dir.string(),
               options.device);
  impl->batcher = std::make_unique<WorkBatcher>(options.batching);
  impl->counters.resize(impl->model->layers().size());
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
  return {impl_->clients_now, impl_->requests, impl_->errors, impl_->tokens, impl_->compute_nanos * 1e-9};
}

void Executor::shutdown() {
  if (impl_->stopping.exchange(true)) return;
  impl_->queue_cv.notify_all();
  if (impl_->compute_thread.joinable()) impl_->compute_thread.join();
  if (impl_->io_thread.joinable()) impl_->io_thread.join();
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
