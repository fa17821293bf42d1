#include "base_executor/same_host_channel.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <new>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "transport/cuda_ipc.h"
#include "transport/zmq_wire.h"

namespace symbiosis {

SameHostChannel::SameHostChannel(std::string kind, uint64_t client_id)
    : kind_(std::move(kind)), client_id_(client_id) {
  control_ = shm::SharedMemory::create("symbiosis-control", sizeof(shm::ControlBlock));
  block_ = new (control_.data()) shm::ControlBlock();
  block_->magic = shm::ControlBlock::kMagic;
}

SameHostChannel::~SameHostChannel() = default;

void SameHostChannel::setup_nccl(const proto::NcclSetup&) {
  TORCH_CHECK(false, "NcclSetup on a ", kind_, " client: only nccl clients set up a communicator");
}

void SameHostChannel::share_segments(const proto::ShareSegments&) {
  TORCH_CHECK(false, "ShareSegments from a ", kind_, " client: only cuda-ipc clients share segments");
}

void SameHostChannel::receive_into(const shm::CallHeader&, const at::Tensor&) {
  TORCH_CHECK(false, "internal: a ", kind_, " input is read where it lies, not received");
}

void SameHostChannel::deliver(const shm::CallHeader&, const at::Tensor&) {
  TORCH_CHECK(false, "internal: a ", kind_, " result has a destination and is not delivered");
}

std::optional<shm::CallHeader> SameHostChannel::next_request() {
  if (broken_) return std::nullopt;
  // Held calls are bounded like the ring: a client runs at most twice its capacity ahead of its GPU.
  while (waiting_.size() < shm::CallRing::kCapacity) {
    bool corrupt = false;
    auto record = block_->requests.pop_untrusted(&next_read_, &corrupt);
    if (corrupt) {
      spdlog::warn("client {}: its request ring is corrupt; dropping the client", client_id_);
      broken_ = true;
      return std::nullopt;
    }
    if (!record) break;
    waiting_.push_back(record->header);
  }
  if (waiting_.empty() || !input_ready(waiting_.front())) return std::nullopt;
  auto h = waiting_.front();
  waiting_.pop_front();
  taken(h);
  return h;
}

void SameHostChannel::refuse(const shm::CallHeader& h, proto::ErrorCode code, const std::string& message) {
  push_reply(h, code, message);
  after_refusal(h);
}

void SameHostChannel::control_over_zmq(zmq::context_t& context, std::string replies_endpoint, std::string identity) {
  zmq_context_ = &context;
  replies_endpoint_ = std::move(replies_endpoint);
  identity_ = std::move(identity);
  control_.unlink();
}

void SameHostChannel::push_reply(const shm::CallHeader& h, proto::ErrorCode code, const std::string& message) {
  if (zmq_context_ != nullptr) {
    if (!replies_) {
      replies_ = std::make_unique<zmq::socket_t>(*zmq_context_, zmq::socket_type::push);
      replies_->set(zmq::sockopt::linger, 0);
      replies_->connect(replies_endpoint_);
    }
    proto::Envelope env;
    if (code == proto::OK) {
      env.mutable_reply()->set_request_id(h.request_id);
    } else {
      env = wire::error_envelope(h.request_id, code, message, /*as_reply=*/true);
    }
    wire::send_to(*replies_, identity_, env);
    return;
  }
  shm::CallRecord record;
  record.header = h;
  record.error_code = code;
  if (!message.empty()) record.set_message(message);
  // The client has one call in flight, so its reply ring has room; if not, it stopped reading.
  if (!block_->replies.push(record)) {
    spdlog::warn("client {}: its reply ring is full; dropping the client", client_id_);
    broken_ = true;
    return;
  }
  block_->replies.wait().notify();
}

namespace {

// The memory a call's offset refers to: the payload buffer (segment 0) or a shared segment.
struct Region {
  const char* base = nullptr;  // nullptr: nothing is registered under that id
  uint64_t size = 0;
};

std::string region_problem(const shm::CallHeader& h, uint64_t in_bytes, uint64_t out_bytes, Region in, Region out,
                           uint64_t generation) {
  if (h.in_segment == 0 || h.out_segment == 0) {
    if (generation == 0) return "no payload buffer is registered (send RegisterBuffer first)";
    if (h.buffer_generation != generation) {
      return "names payload buffer generation " + std::to_string(h.buffer_generation) + ", but generation " +
             std::to_string(generation) + " is registered";
    }
  }
  auto missing = [](uint32_t segment) {
    return "names segment " + std::to_string(segment) + ", which the client has not shared (send ShareSegments first)";
  };
  if (in.base == nullptr) return "input " + missing(h.in_segment);
  if (out.base == nullptr) return "output " + missing(h.out_segment);
  auto outside = [](const char* what, uint64_t offset, uint64_t bytes, uint64_t segment, uint64_t size) {
    if (offset <= size && bytes <= size - offset) return std::string();
    return std::string(what) + " [" + std::to_string(offset) + ", +" + std::to_string(bytes) + ") lies outside the " +
           std::to_string(size) + "-byte " +
           (segment == 0 ? std::string("payload buffer") : "shared segment " + std::to_string(segment));
  };
  if (auto problem = outside("input", h.in_offset, in_bytes, h.in_segment, in.size); !problem.empty()) return problem;
  if (auto problem = outside("output", h.out_offset, out_bytes, h.out_segment, out.size); !problem.empty()) {
    return problem;
  }
  if (h.in_offset % 16 != 0 || h.out_offset % 16 != 0) return "payload offsets must be multiples of 16 bytes";
  const char* input = in.base + h.in_offset;
  const char* output = out.base + h.out_offset;
  if (input < output + out_bytes && output < input + in_bytes) return "input and output regions overlap";
  return "";
}

// A client whose payload lives in a buffer it registered (shm, cuda-ipc): a call names offsets into
// it, inputs are read and results written there in place. Subclasses map the buffer.
class RegisteredBufferChannel : public SameHostChannel {
 public:
  using SameHostChannel::SameHostChannel;

  proto::BufferRegistered register_buffer(const proto::RegisterBuffer& r) final {
    TORCH_CHECK(r.generation() == generation_ + 1, "RegisterBuffer generation ", r.generation(), ", expected ",
                generation_ + 1);
    proto::BufferRegistered answer;
    map(r, &answer);
    generation_ = r.generation();
    answer.set_generation(generation_);
    return answer;
  }
  std::string check_payload(const shm::CallHeader& h, uint64_t in_bytes, uint64_t out_bytes) const final {
    return region_problem(h, in_bytes, out_bytes, region(h.in_segment), region(h.out_segment), generation_);
  }
  at::Tensor input(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) final {
    before_read(h);
    return view(region(h.in_segment), h.in_offset, dtype, shape);
  }
  at::Tensor destination(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) final {
    return view(region(h.out_segment), h.out_offset, dtype, shape);
  }

 protected:
  // Maps the buffer `r` names in place of the previous one (which then goes); may add to `answer`.
  virtual void map(const proto::RegisterBuffer& r, proto::BufferRegistered* answer) = 0;
  virtual void* base() const = 0;
  virtual size_t size() const = 0;
  // [Direct operands]: a segment the client shared (id > 0), or an empty Region.
  virtual Region shared_segment(uint32_t) const { return {}; }
  virtual at::TensorOptions view_options() const = 0;
  // Before an input is read: order the compute stream after the client's writes, if needed.
  virtual void before_read(const shm::CallHeader&) {}

 private:
  Region region(uint32_t segment) const {
    if (segment != 0) return shared_segment(segment);
    return {static_cast<const char*>(base()), base() == nullptr ? 0 : size()};
  }
  at::Tensor view(Region region, uint64_t offset, at::ScalarType dtype, at::IntArrayRef shape) const {
    return at::from_blob(const_cast<char*>(region.base) + offset, shape, view_options().dtype(dtype));
  }
  uint64_t generation_ = 0;  // of the buffer mapped now
};

// "shm": the client's host shared-memory segment. On a GPU executor it is pinned, so inputs and
// results move by DMA without a staging copy.
class HostShmChannel : public RegisteredBufferChannel {
 public:
  HostShmChannel(uint64_t client_id, at::Device device) : RegisteredBufferChannel("shm", client_id), device_(device) {}

 protected:
  void map(const proto::RegisterBuffer& r, proto::BufferRegistered*) override {
    TORCH_CHECK(!r.shm_name().empty(), "RegisterBuffer for an shm client needs shm_name");
    auto memory = shm::SharedMemory::open(r.shm_name(), r.bytes());
#ifdef SYMBIOSIS_WITH_CUDA
    pinned_ = cuda::PinnedRange();
    if (device_.is_cuda()) {
      try {
        pinned_ = cuda::PinnedRange(memory.data(), memory.size());
      } catch (const c10::Error& e) {
        spdlog::warn("client {}: payload buffer not pinned, copies will be synchronous: {}", client_id(),
                     e.what_without_backtrace());
      }
    }
#endif
    memory_ = std::move(memory);
  }
  void* base() const override { return memory_.data(); }
  size_t size() const override { return memory_.size(); }
  at::TensorOptions view_options() const override { return at::TensorOptions(); }

 private:
  at::Device device_;
#ifdef SYMBIOSIS_WITH_CUDA
  cuda::PinnedRange pinned_;  // declared before memory_: unpinned before unmapped
#endif
  shm::SharedMemory memory_;
};

#ifdef SYMBIOSIS_WITH_CUDA
// "cuda-ipc": the client's device buffer on the executor's GPU, mapped through CUDA IPC. A call
// the client numbered is ordered through the control segment's flags ([Stream-ordered hand-off]
// in transport/call_ring.h): it is taken up once its input is written, and the executor's stream
// writes results_ready after its result. Otherwise (headers over ZeroMQ) the executor's stream
// waits on the client's event before reading an input, and records the executor's event after
// writing results; the client's stream waits on that before reading.
class CudaIpcChannel : public RegisteredBufferChannel {
 public:
  CudaIpcChannel(uint64_t client_id, at::Device device)
      : RegisteredBufferChannel("cuda-ipc", client_id),
        device_(device.has_index() ? device.index() : 0),
        executor_event_(cuda::InterprocessEvent::create(device_)),
        control_pin_(control_memory().data(), control_memory().size(), /*mapped=*/true),
        results_ready_(control_pin_.device_pointer(&control_block()->results_ready)) {}

  ~CudaIpcChannel() override {
    // Work enqueued on our buffer or flags must finish before they go, whichever thread drops
    // the last reference.
    synchronize_streams();
  }

  bool orders_by_flags() const override { return true; }

  void share_segments(const proto::ShareSegments& r) override {
    for (const uint32_t id : r.release()) {
      TORCH_CHECK(segments_.erase(id) == 1, "ShareSegments releases segment ", id, ", which is not shared");
    }
    for (const auto& s : r.add()) {
      TORCH_CHECK(s.id() != 0, "ShareSegments: segment id 0 is the payload buffer; shared segments count from 1");
      TORCH_CHECK(s.bytes() > 0, "ShareSegments: segment ", s.id(), " has no bytes");
      TORCH_CHECK(!segments_.count(s.id()), "ShareSegments adds segment ", s.id(), ", which is already shared");
      TORCH_CHECK(segments_.size() < kMaxSegments, "ShareSegments: a client shares at most ", kMaxSegments,
                  " segments at once");
      segments_.emplace(s.id(), cuda::MappedDeviceBuffer::open(device_, s.cuda_ipc_handle(), s.bytes()));
    }
  }

  bool compute_replayed(const shm::CallHeader& h, const at::Tensor& input, const at::Tensor& destination,
                        const std::function<void()>& compute) override {
    if (captured_slot(h) == nullptr || replays_failed_) return false;
    void* stream = cuda::current_stream(device_);
    const Replay::Key key{h.layer_id, h.op, h.tokens, input.data_ptr(), destination.data_ptr(), stream};
    auto& replay = replays_[h.slot];
    if (!replay.work.valid() || replay.key != key) {
      try {
        replay.work = cuda::CapturedWork::capture(stream, compute);
      } catch (const c10::Error& e) {
        replays_failed_ = true;
        replays_.clear();
        spdlog::warn("client {}: its captured calls run without graphs: {}", client_id(), e.what_without_backtrace());
        return false;
      }
      replay.key = key;
    }
    replay.work.launch(stream);
    return true;
  }

  void finish_writes(const shm::CallHeader& h) override {
    // [Compute streams]: a batch of another client's may have put this call on another stream
    // than the last; results_ready must still count up in order.
    if (void* now = cuda::current_stream(device_); now != stream_) {
      if (stream_ != nullptr) cuda::stream_after(now, stream_);
      if (std::find(streams_.begin(), streams_.end(), now) == streams_.end()) streams_.push_back(now);
      stream_ = now;
    }
    if (auto* slot = captured_slot(h)) {
      cuda::memory_ops_on_stream(stream_, {{cuda::MemoryOp::kWrite, control_pin_.device_pointer(&slot->result_ready), 1},
                                           {cuda::MemoryOp::kWrite, results_ready_, h.sequence}});
    } else if (h.sequence != 0) {
      cuda::write_value_on_stream(stream_, results_ready_, h.sequence);
    } else {
      executor_event_.record(stream_);
    }
  }

 protected:
  void map(const proto::RegisterBuffer& r, proto::BufferRegistered* answer) override {
    TORCH_CHECK(!r.cuda_ipc_handle().empty(), "RegisterBuffer for a cuda-ipc client needs cuda_ipc_handle");
    if (!client_event_.valid()) client_event_ = cuda::InterprocessEvent::open(device_, r.client_event());
    auto mapped = cuda::MappedDeviceBuffer::open(device_, r.cuda_ipc_handle(), r.bytes());
    if (buffer_.data() != nullptr) synchronize_streams();  // work still on the old buffer
    buffer_ = std::move(mapped);
    answer->set_executor_event(executor_event_.ipc_handle());
  }
  void* base() const override { return buffer_.data(); }
  size_t size() const override { return buffer_.size(); }
  Region shared_segment(uint32_t id) const override {
    const auto it = segments_.find(id);
    if (it == segments_.end()) return {};
    return {static_cast<const char*>(it->second.data()), it->second.size()};
  }
  at::TensorOptions view_options() const override { return at::TensorOptions().device(at::kCUDA, device_); }
  void before_read(const shm::CallHeader& h) override {
    if (h.sequence == 0) client_event_.make_stream_wait(cuda::current_stream(device_));
  }
  bool input_ready(const shm::CallHeader& h) const override {
    if (h.slot != 0) {  // [Captured calls]; a slot out of range is handed out to be refused
      const auto* slot = captured_slot(h);
      return slot == nullptr || slot->input_ready.load(std::memory_order_acquire) != 0;
    }
    return h.sequence == 0 || shm::reached(control_block()->inputs_ready.load(std::memory_order_acquire), h.sequence);
  }
  void taken(const shm::CallHeader& h) override {
    if (auto* slot = captured_slot(h)) slot->input_ready.store(0, std::memory_order_release);
  }
  // The client's stream waits for a numbered call's result, which will not come: let it go on.
  void after_refusal(const shm::CallHeader& h) override {
    if (h.sequence != 0) finish_writes(h);
  }

 private:
  // The slot a captured call names, or nullptr (not captured, or a slot out of range: refused).
  shm::CallSlot* captured_slot(const shm::CallHeader& h) const {
    if (h.slot == 0 || h.slot > shm::kCallSlots || h.sequence == 0) return nullptr;
    return &control_block()->slots[h.slot];
  }

  void synchronize_streams() {
    for (void* stream : streams_) cuda::synchronize_stream(stream);
  }

  int device_;
  void* stream_ = nullptr;       // cudaStream_t of this client's last call
  std::vector<void*> streams_;   // every compute stream this client's calls went on (a few at most)
  // [Replayed calls]: each captured call's GEMM, by slot, with what it was captured for.
  struct Replay {
    using Key = std::tuple<uint32_t, int32_t, int64_t, const void*, const void*, void*>;
    Key key;  // layer, op, tokens, input, destination, stream
    cuda::CapturedWork work;
  };
  std::unordered_map<uint32_t, Replay> replays_;
  bool replays_failed_ = false;
  cuda::InterprocessEvent executor_event_, client_event_;
  cuda::PinnedRange control_pin_;  // the control segment, for the flags' stream writes
  void* results_ready_;            // the GPU's address of the control block's results_ready
  cuda::MappedDeviceBuffer buffer_;
  // [Direct operands]: the client's allocations its calls may name, by id.
  static constexpr size_t kMaxSegments = size_t{1} << 16;
  std::unordered_map<uint32_t, cuda::MappedDeviceBuffer> segments_;
};
#endif

}  // namespace

std::shared_ptr<SameHostChannel> SameHostChannel::create(const std::string& kind, uint64_t client_id,
                                                         at::Device device, GpuClientCount gpu_clients) {
  if (kind == "shm") return std::make_shared<HostShmChannel>(client_id, device);
  if (kind == "cuda-ipc") {
#ifdef SYMBIOSIS_WITH_CUDA
    return std::make_shared<CudaIpcChannel>(client_id, device);
#else
    TORCH_CHECK(false, "transport cuda-ipc: this build of symbiosis has no CUDA");
#endif
  }
  if (kind == "nccl") return make_nccl_channel(client_id, device, std::move(gpu_clients));
  TORCH_CHECK(false, "unknown same-host transport '", kind, "'");
}

Doorbell::Doorbell() {
  memory_ = shm::SharedMemory::create("symbiosis-doorbell", sizeof(shm::DoorbellBlock));
  block_ = new (memory_.data()) shm::DoorbellBlock();
  block_->magic = shm::DoorbellBlock::kMagic;
}

}  // namespace symbiosis
