#include "transport/client_transport.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "common/cuda.h"
#include "transport/call_ring.h"
#include "transport/client_payload.h"
#include "transport/local_socket.h"
#include "transport/zmq_wire.h"

namespace symbiosis {

// A call's Request header (its payload, if any, follows in a frame of its own).
proto::Envelope request_envelope(const CallSpec& spec, const at::Tensor& x) {
  proto::Envelope env;
  auto* r = env.mutable_request();
  r->set_request_id(spec.request_id);
  r->set_layer_id(spec.layer->id);
  r->set_op(spec.op);
  r->set_dtype(wire::to_proto(x.scalar_type()));
  r->add_shape(x.size(0));
  r->add_shape(x.size(1));
  r->set_latency_class(spec.latency_class);
  return env;
}

// The executor's Reply to this call over ZeroMQ, its frames in `frames`; skips late answers to
// calls that timed out.
proto::Reply await_reply(ControlSocket& socket, const CallSpec& spec, std::vector<zmq::message_t>& frames) {
  while (true) {
    frames = socket.receive("a layer request");
    auto reply_env = ControlSocket::parse_or_throw(frames);
    TORCH_CHECK(reply_env.has_reply(), "executor answered a request with something other than a reply");
    if (reply_env.reply().request_id() == spec.request_id) return reply_env.reply();
  }
}

namespace {

constexpr const char* kCaptureNeeds =
    "a captured step needs a client on the executor's GPU (transport cuda-ipc) with the shared-memory "
    "control channel (control \"auto\" on the executor's host) and direct operands";

// [Shutdown notice]: how often a same-host wait looks for the executor's notice over ZeroMQ.
constexpr auto kShutdownLookEvery = std::chrono::milliseconds(100);

constexpr uint64_t kAlignment = 256;
uint64_t align_up(uint64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// Payloads through a ClientPayload; headers through the shared-memory control channel, or over
// ZeroMQ when the Welcome names no control segment (a client on another host, or control "zmq").
class PayloadTransport : public ClientTransport {
 public:
  PayloadTransport(ControlSocket& socket, const proto::Welcome& welcome, const ClientEndOptions& options,
                   const std::function<std::unique_ptr<ClientPayload>()>& make_payload)
      : socket_(socket), options_(options), kind_(welcome.transport()), zmq_control_(!welcome.control_channel()) {
    if (!zmq_control_) {
      auto descriptors = socket.take_descriptors();
      TORCH_CHECK(descriptors.size() == 2, "executor named a control channel but handed over ", descriptors.size(),
                  " descriptors (expected the control segment and the wake socket)");
      control_memory_ =
          shm::SharedMemory::map_descriptor(std::move(descriptors[0]), sizeof(shm::ControlBlock), "control");
      control_ = shm::map_block<shm::ControlBlock>(control_memory_);
      wake_ = std::move(descriptors[1]);  // [Wake sockets] (transport/call_ring.h)
    }
    payload_ = make_payload();
    spin_ = std::chrono::microseconds(options_.spin_us >= 0 ? options_.spin_us
                                                            : shm::default_spin_us(options_.device.is_cuda()));
    ordered_ = !zmq_control_ && payload_->order_through(control_memory_);
    if (ordered_) watchdog_ = std::thread([this] { watch(); });
  }

  ~PayloadTransport() override {
    if (!ordered_) return;
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      leaving_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
    try {
      settle();  // the calls in flight use the buffer and the flags that go with us
    } catch (const c10::Error&) {
      // Their errors have no one to go to now.
    }
  }

  at::Tensor call(const CallSpec& spec, const at::Tensor& x) override {
    check_usable();
    shm::CallRecord record;
    auto& h = record.header;
    h.request_id = spec.request_id;
    h.layer_id = spec.layer->id;
    h.op = spec.op;
    h.dtype = wire::to_proto(x.scalar_type());
    h.latency_class = spec.latency_class;
    h.tokens = x.size(0);
    h.features = x.size(1);
    at::Tensor direct;
    if (ordered_) {
      raise_errors();
      direct = payload_->place_direct(x, spec.out_features, h);
    }
    if (capture_) return capture_call(*spec.layer, record, direct);
    if (!direct.defined()) {
      const uint64_t in_bytes = x.nbytes();
      const uint64_t out_bytes = static_cast<uint64_t>(x.size(0)) * spec.out_features * x.element_size();
      const uint64_t bytes = align_up(in_bytes) + out_bytes;
      if (ordered_ && !payload_->fits(bytes)) settle();  // a larger buffer replaces the one the calls in flight use
      payload_->reserve(bytes);
      h.in_offset = 0;
      h.out_offset = align_up(in_bytes);
      h.buffer_generation = payload_->generation();
      payload_->send_input(x, h.in_offset);
    }
    if (ordered_) {
      h.sequence = next_sequence();
      payload_->announce_input(h.sequence);
      push_request(record);
      issued_.store(h.sequence, std::memory_order_release);
      payload_->await_result(h.sequence);
      if (direct.defined()) return direct;
      return payload_->receive_output(h.out_offset, x.scalar_type(), {x.size(0), spec.out_features}, x.device());
    }
    const auto [code, message] = zmq_control_ ? exchange_over_zmq(spec, x, h) : exchange_over_shm(spec, record);
    if (code != proto::OK) {
      payload_->abandon_output();
      // [Back-pressure]: a refused call may be sent again, but for nccl: its abandoned send aborted
      // the communicator (transport/nccl/nccl_client.cpp), so the refusal stays an error there.
      throw_executor_error(code, message, "layer '" + spec.layer->name + "'",
                           kind_ != transport_name(TransportKind::kNccl));
    }
    return payload_->receive_output(h.out_offset, x.scalar_type(), {x.size(0), spec.out_features}, x.device());
  }

  bool can_capture() const override { return ordered_; }

  void begin_capture() override {
    TORCH_CHECK(ordered_, kCaptureNeeds, "; this ", kind_, " client's calls are answered ",
                zmq_control_ ? "over ZeroMQ" : "by reply");
    TORCH_CHECK(!capture_, "begin_capture: this client is capturing already");
    payload_->before_capture();
    capture_ = std::make_shared<CapturedCalls>();
  }

  std::shared_ptr<const CapturedCalls> end_capture() override {
    TORCH_CHECK(capture_, "end_capture: this client is not capturing");
    return std::exchange(capture_, nullptr);
  }

  void replay(const CapturedCalls& calls, uint64_t first_request_id) override {
    check_usable();
    TORCH_CHECK(!capture_, "replay: this client is capturing");
    raise_errors();
    uint64_t request_id = first_request_id;
    for (auto record : calls.records) {
      record.header.request_id = request_id++;
      record.header.sequence = next_sequence();
      push_request(record);
      issued_.store(record.header.sequence, std::memory_order_release);
    }
    payload_->replayed(issued_.load());
  }

  bool results_lost() const override {
    return ordered_ && (voided_ || control_->runs_voided.load() != 0 ||
                        !shm::reached(control_->results_ready.load(), issued_.load()));
  }

  // [Stream-ordered hand-off]: waits on the host until every call made so far has its result,
  // then throws the first error among them. When the executor lets calls go unanswered for the
  // timeout, releases the GPU's waits on them and stops the transport.
  void settle() override {
    if (!ordered_) return;
    const uint32_t issued = issued_.load(std::memory_order_acquire);
    auto next_look = std::chrono::steady_clock::now() + kShutdownLookEvery;
    const bool done = spin_then_sleep([&] {
      if (shm::reached(control_->results_ready.load(), issued)) return true;
      // [Shutdown notice]: an executor that said it stops will not answer.
      if (std::chrono::steady_clock::now() < next_look) return false;
      next_look += kShutdownLookEvery;
      if (socket_.executor_gone()) {
        give_up();
        socket_.check_not_gone();
      }
      return false;
    });
    if (!done) {
      give_up();
      TORCH_CHECK(false, "executor at ", socket_.endpoint(), " did not answer call ", issued, " within ",
                  socket_.timeout_ms(), " ms (is it running?)");
    }
    if (control_->runs_voided.load(std::memory_order_acquire) != 0) {  // [Voided runs]
      give_up();
      throw ExecutorLost({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                         "the executor at " + socket_.endpoint() +
                             " let this client's calls launched ahead go without their inputs (it drops a client "
                             "whose run stands still), so their results are void");
    }
    raise_errors();
  }

 private:
  struct Answer {
    proto::ErrorCode code;
    std::string message;
  };

  // Throws ExecutorLost once the connection is lost (the watchdog may have seen it first), or that
  // the transport stopped after a call timed out.
  void check_usable() {
    if (broken_) socket_.executor_gone();
    socket_.check_not_gone();
    TORCH_CHECK(!broken_, "the ", kind_, " transport to ", socket_.endpoint(),
                " stopped after a call timed out; connect a new Client");
  }

  // Waits until ready() holds, at most the call timeout: spins first, then naps.
  template <typename Ready>
  bool spin_then_sleep(Ready&& ready) const {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(socket_.timeout_ms());
    while (!ready()) {
      const auto now = Clock::now();
      if (now >= deadline) return false;
      if (now - start > spin_) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }

  // The next call's number; 0 means "answered by reply".
  uint32_t next_sequence() { return ++last_sequence_ == 0 ? ++last_sequence_ : last_sequence_; }

  // [Captured calls]: records the call, whose operands place_direct named, and enqueues its slot's
  // flag operations on the stream being captured.
  at::Tensor capture_call(const LayerInfo& layer, shm::CallRecord& record, const at::Tensor& direct) {
    TORCH_CHECK(direct.defined(), "layer '", layer.name, "': ", kCaptureNeeds,
                "; this call's input or result lies where the executor cannot read it (not in this client's "
                "caching allocator, rows not 16-byte aligned, or direct operands off)");
    TORCH_CHECK(capture_->records.size() < shm::kCallSlots, "a captured step makes at most ", shm::kCallSlots,
                " base-layer calls");
    record.header.slot = static_cast<uint32_t>(capture_->records.size() + 1);
    payload_->announce_captured(record.header.slot);
    capture_->records.push_back(record);
    return direct;
  }

  // Throws the first error the executor answered an ordered call with.
  void raise_errors() {
    while (auto reply = control_->replies.pop()) {
      if (reply->error_code == proto::OK) continue;  // answers calls made before ordering (none) or that timed out
      throw_executor_error(
          static_cast<proto::ErrorCode>(reply->error_code), reply->message_text(),
          "an earlier call (request " + std::to_string(reply->header.request_id) + "), whose result is void");
    }
    if (gave_up_.load() && socket_.executor_gone()) socket_.check_not_gone();  // [Executor restart]
    TORCH_CHECK(!gave_up_.load(), "executor at ", socket_.endpoint(), " let calls go unanswered for ",
                socket_.timeout_ms(), " ms (is it running?); connect a new Client");
  }

  // Lets the GPU's waits on every call made so far go, and stops the transport.
  void give_up() {
    broken_ = true;
    gave_up_ = true;
    if (!shm::reached(control_->results_ready.load(), issued_.load())) voided_ = true;
    control_->results_ready.store(issued_.load());
    for (auto& slot : control_->slots) slot.result_ready.store(1);  // [Captured calls]
  }

  // The watchdog: a client blocked in a CUDA synchronization cannot see an executor that stopped
  // answering, so this thread looks for it: an executor that closed the client's local link (it
  // died), or no result for the call timeout while calls are open. Either releases the GPU's waits.
  void watch() {
    std::unique_lock<std::mutex> lock(watch_mutex_);
    uint32_t last = control_->results_ready.load();
    auto since = std::chrono::steady_clock::now();
    while (!watch_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return leaving_; })) {
      const uint32_t now_ready = control_->results_ready.load();
      const auto now = std::chrono::steady_clock::now();
      if (now_ready != last || shm::reached(now_ready, issued_.load())) {
        last = now_ready;
        since = now;
      } else if (!gave_up_ &&
                 (socket_.link_closed() || now - since > std::chrono::milliseconds(socket_.timeout_ms()))) {
        give_up();
      }
    }
  }

  void push_request(const shm::CallRecord& record) {
    // The executor empties the ring at every turn of its loop.
    const bool pushed = spin_then_sleep([&] { return control_->requests.push(record); });
    TORCH_CHECK(pushed, "executor at ", socket_.endpoint(), " did not take request ", record.header.request_id,
                " for layer id ", record.header.layer_id, " within ", socket_.timeout_ms(), " ms (is it running?)");
    shm::wake_executor(*control_, wake_.get());
  }

  Answer exchange_over_shm(const CallSpec& spec, const shm::CallRecord& record) {
    push_request(record);
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + std::chrono::milliseconds(socket_.timeout_ms());
    while (true) {
      // [Shutdown notice]: the executor's notice comes over ZeroMQ, so the wait on the control
      // segment looks there between slices.
      bool got = false;
      while (true) {
        const auto slice_end = std::min(deadline, Clock::now() + kShutdownLookEvery);
        got = shm::wait_until(
            control_->replies.wait(), [&] { return !control_->replies.empty(); }, spin_, slice_end);
        if (got || slice_end == deadline) break;
        if (socket_.executor_gone()) {
          broken_ = true;
          socket_.check_not_gone();
        }
      }
      if (!got) {
        broken_ = true;
        TORCH_CHECK(false, "executor at ", socket_.endpoint(), " did not answer request ", spec.request_id,
                    " for layer '", spec.layer->name, "' within ", socket_.timeout_ms(), " ms (is it running?)");
      }
      auto reply = control_->replies.pop();
      if (reply->header.request_id != spec.request_id) continue;  // older ones answered calls that timed out
      return {static_cast<proto::ErrorCode>(reply->error_code), reply->message_text()};
    }
  }

  Answer exchange_over_zmq(const CallSpec& spec, const at::Tensor& x, const shm::CallHeader& h) {
    auto env = request_envelope(spec, x);
    auto* r = env.mutable_request();
    r->set_in_offset(h.in_offset);
    r->set_out_offset(h.out_offset);
    r->set_buffer_generation(h.buffer_generation);
    socket_.send(env);
    std::vector<zmq::message_t> frames;
    try {
      const auto reply = await_reply(socket_, spec, frames);
      if (!reply.has_error()) return {proto::OK, ""};
      return {reply.error().code(), reply.error().message()};
    } catch (const c10::Error&) {
      broken_ = true;  // a timed-out call's payload may still be in flight
      throw;
    }
  }

  ControlSocket& socket_;
  ClientEndOptions options_;
  std::string kind_;
  bool zmq_control_;
  shm::SharedMemory control_memory_;
  shm::ControlBlock* control_ = nullptr;
  UniqueFd wake_;  // [Wake sockets]: this client's end of its wake socket
  std::unique_ptr<ClientPayload> payload_;
  std::chrono::microseconds spin_{0};
  std::atomic<bool> broken_{false};
  // [Stream-ordered hand-off]
  bool ordered_ = false;
  uint32_t last_sequence_ = 0;              // the last call's number
  std::atomic<uint32_t> issued_{0};         // the last number pushed to the executor
  std::atomic<bool> gave_up_{false};        // the watchdog or settle() found the executor silent
  std::atomic<bool> voided_{false};         // give_up() released calls that had no result
  std::shared_ptr<CapturedCalls> capture_;  // [Captured calls]: what the capture under way recorded
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  bool leaving_ = false;  // guarded by watch_mutex_
  std::thread watchdog_;
};

}  // namespace

void ClientTransport::begin_capture() { TORCH_CHECK(false, kCaptureNeeds, "; this client's calls go over tcp"); }

std::unique_ptr<ClientTransport> make_payload_transport(
    ControlSocket& socket, const proto::Welcome& welcome, const ClientEndOptions& options,
    const std::function<std::unique_ptr<ClientPayload>()>& make_payload) {
  return std::make_unique<PayloadTransport>(socket, welcome, options, make_payload);
}

proto::Placement local_placement(const std::string& device) {
  proto::Placement p;
  p.set_host_id(shm::host_id());
  p.set_pid(::getpid());
  p.set_device(device);
  const at::Device d(device);
  if (d.is_cuda()) {
    p.set_gpu_uuid(cuda::gpu_uuid(d.has_index() ? d.index() : 0));
    p.set_mps(cuda::mps_active());
  }
  return p;
}

}  // namespace symbiosis
