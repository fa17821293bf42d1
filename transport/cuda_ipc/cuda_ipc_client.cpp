// The client's end of the "cuda-ipc" transport: a cudaMalloc'd payload buffer on the client's GPU
// (which is the executor's), shared through CUDA IPC, and [Direct operands].
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "common/cuda.h"
#include "common/cuda_check.h"
#include "common/slow_scope.h"
#include "transport/call_ring.h"
#include "transport/client_payload.h"
#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/cuda_ipc/device_words.h"
#include "transport/shared_memory.h"

#ifdef SYMBIOSIS_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace symbiosis::cuda_ipc {

#ifdef SYMBIOSIS_WITH_CUDA
namespace {

// [Direct operands]
// A cuda-ipc client whose calls are ordered through the flags hands the executor its own tensors:
// the input where the model left it, and a result tensor allocated for the call. Copying both
// through the payload buffer costs two launches on the client's host and two passes over the rows
// on the GPU, every call. A CUDA IPC handle names a whole cudaMalloc'd allocation, so the client
// shares each segment of LibTorch's caching allocator a call touches once (ShareSegments), and a
// call names a segment and an offset into it; the executor checks every call's regions against
// what was shared, as it does for the buffer.
//  - Lifetimes: the client reuses a tensor's memory only through work on its stream after the
//    call's result wait, which comes after the executor has read and written it; nothing is held.
//  - A segment the allocator gives back to CUDA (emptyCache, an allocation retried after running
//    out of memory): freeing memory another process has open is undefined in CUDA. The allocator
//    reports the segment just before it frees it (SegmentFrees); each client that shared it waits
//    for its calls in flight and has the executor close its mapping, and the free goes on after.
//  - The buffer takes the call instead: memory not from the caching allocator, rows not 16-byte
//    aligned, an input on another device. Memory without a legacy IPC handle (expandable
//    segments) or an executor that refuses a segment ends direct operands for the client.
class CudaIpcPayload;

// The process's one trace tracker on LibTorch's caching allocator (trackers cannot be detached,
// so this outlives every client), passing each segment the allocator frees to the clients that
// shared it, before CUDA frees it.
class SegmentFrees {
 public:
  static SegmentFrees& instance() {
    static auto* frees = new SegmentFrees();  // never destroyed: the allocator may call it at exit
    return *frees;
  }
  void add(CudaIpcPayload* payload) {
    std::lock_guard<std::mutex> lock(mutex_);
    payloads_.push_back(payload);
  }
  void remove(CudaIpcPayload* payload) {
    std::lock_guard<std::mutex> lock(mutex_);
    payloads_.erase(std::remove(payloads_.begin(), payloads_.end(), payload), payloads_.end());
  }

 private:
  SegmentFrees();  // after CudaIpcPayload
  std::mutex mutex_;
  std::vector<CudaIpcPayload*> payloads_;
};

// "cuda-ipc": a cudaMalloc'd buffer on the client's GPU, which is the executor's GPU. Calls are
// ordered through the control segment's flags ([Stream-ordered hand-off] in
// transport/call_ring.h), or, with headers over ZeroMQ, through two interprocess events: the
// client records its event after writing an input; the executor's stream waits on it, and records
// the executor's event after writing the result, on which the client's stream waits before reading.
class CudaIpcPayload : public RegisteredBuffer {
 public:
  CudaIpcPayload(ControlSocket& socket, int device, bool direct_operands)
      : RegisteredBuffer(socket),
        device_(device),
        client_event_(cuda::InterprocessEvent::create(device)),
        direct_(direct_operands) {}

  ~CudaIpcPayload() override {
    if (watching_frees_) SegmentFrees::instance().remove(this);
    // The GPU must be done with the buffer and the flags before they go.
    try {
      if (stream_.valid()) cuda::synchronize_stream(stream_);
    } catch (const c10::Error&) {
    }
    // The executor lets go of this client's segments only when it forgets the client, which may
    // come after this process has given them back to CUDA.
    std::lock_guard<std::mutex> lock(socket_mutex_);
    if (segments_.empty()) return;
    proto::Envelope env;
    for (const auto& [base, segment] : segments_) env.mutable_share_segments()->add_release(segment.id);
    try {
      socket_.exchange_setup(env, "the release of the shared segments");
    } catch (const c10::Error& e) {
      spdlog::warn("cuda-ipc client: the executor did not release its shared segments: {}", e.what_without_backtrace());
    }
  }

  at::Tensor place_direct(const at::Tensor& x, int64_t out_features, shm::CallHeader& h) override {
    if (!direct_ || x.device() != at::Device(at::kCUDA, device_)) return {};
    auto out = at::empty({x.size(0), out_features}, x.options());
    const auto input = locate(x);
    const auto result = input ? locate(out) : std::nullopt;
    if (!result) return {};
    h.in_segment = input->segment;
    h.in_offset = input->offset;
    h.out_segment = result->segment;
    h.out_offset = result->offset;
    use_stream();
    return out;
  }

  // The caching allocator is about to give the segment at `base` back to CUDA (any thread, its
  // lock held): once the calls in flight are done, the executor closes its mapping.
  void segment_freed(const char* base) {
    std::lock_guard<std::mutex> lock(socket_mutex_);
    const auto it = segments_.find(base);
    if (it == segments_.end()) return;
    const Segment segment = it->second;
    proto::Envelope env;
    env.mutable_share_segments()->add_release(segment.id);
    segments_.erase(it);
    try {
      // The allocator's lock is held all along: every thread of this process that allocates waits too.
      const SlowScope slow("cuda-ipc client: the release of segment " + std::to_string(segment.id) + " (" +
                           std::to_string(segment.bytes) + " bytes)");
      wait_for_calls();
      socket_.exchange_setup(env, "a segment's release");
    } catch (const c10::Error& e) {
      spdlog::warn("cuda-ipc client: the executor did not release a segment before it was freed: {}",
                   e.what_without_backtrace());
    }
  }

  void send_input(const at::Tensor& x, uint64_t offset) override {
    const at::Device gpu(at::kCUDA, device_);
    const auto input = x.device() == gpu ? x : x.to(gpu);  // contiguous, the layer's dtype (VirtLayer)
    const cuda::Stream stream = use_stream();
    cuda::copy_on_stream(static_cast<char*>(buffer_.data()) + offset, input.data_ptr(), input.nbytes(), stream);
    if (inputs_ready_ == nullptr) client_event_.record(stream);
  }

  at::Tensor receive_output(uint64_t offset, at::ScalarType dtype, at::IntArrayRef shape, at::Device device) override {
    const cuda::Stream stream = use_stream();
    if (inputs_ready_ == nullptr) executor_event_.make_stream_wait(stream);
    auto out = at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCUDA, device_));
    cuda::copy_on_stream(out.data_ptr(), static_cast<const char*>(buffer_.data()) + offset, out.nbytes(), stream);
    return device == out.device() ? out : out.to(device);
  }

  bool order_through(shm::SharedMemory& control) override {
    control_pin_ = cuda::PinnedRange(control.data(), control.size(), /*mapped=*/true);
    block_ = static_cast<shm::ControlBlock*>(control.data());
    results_ready_ = control_pin_.device_pointer(&block_->results_ready);
    inputs_ready_ = control_pin_.device_pointer(&block_->inputs_ready);
    watching_frees_ = direct_;  // calls ordered so may name segments
    if (watching_frees_) SegmentFrees::instance().add(this);
    offer_device_words();
    return true;
  }
  // On the stream send_input just used.
  void announce_input(uint32_t sequence) override {
    cuda::write_value_on_stream(stream_, inputs_ready_, sequence);
    announced_.store(sequence, std::memory_order_release);
  }
  void await_result(uint32_t sequence) override { cuda::wait_value_on_stream(stream_, results_ready_, sequence); }
  void announce_captured(uint32_t slot) override {
    auto& flags = block_->slots[slot];
    auto* input_ready = static_cast<uint32_t*>(control_pin_.device_pointer(&flags.input_ready));
    auto* result_ready = static_cast<uint32_t*>(control_pin_.device_pointer(&flags.result_ready));
    const cuda::Stream stream = use_stream();
    if (words_.data() == nullptr) {
      cuda::memory_ops_on_stream(stream, {{cuda::MemoryOp::kWrite, input_ready, 1},
                                          {cuda::MemoryOp::kWaitReached, result_ready, 1},
                                          {cuda::MemoryOp::kWrite, result_ready, 0}});
      return;
    }
    // [Device words]: the host input word first, which whoever sees the device one then finds set.
    uint32_t* device_input = cuda::device_input_word(words_.data(), shm::kCallSlots, slot);
    cuda::HandOff hand_off;
    hand_off.set[0] = input_ready;
    hand_off.set[1] = device_input;
    hand_off.await = cuda::device_result_word(words_.data(), shm::kCallSlots, slot);
    hand_off.release = result_ready;  // give_up()
    hand_off.clear_release = true;
    hand_off.clear[0] = device_input;
    hand_off.host_clears = false;
    SYMBIOSIS_CUDA_CHECK(cuda::launch_hand_off(hand_off, static_cast<cudaStream_t>(stream.handle)));
    // [Early dependents]: the step's next kernel starts once the result is up.
    if (cuda::CallsStartEarly::here()) cuda::start_next_kernel_early(stream);
  }
  // [Capture's stream]: a decode graph is warmed up on its own stream and captured on it later,
  // after other steps (a prefill, another batch size's graph) ran on other streams; the wait that
  // use_stream() would add is made here, before the capture, not recorded into it.
  void before_capture() override { use_stream(); }
  void replayed(uint32_t sequence) override { announced_.store(sequence, std::memory_order_release); }

 protected:
  void allocate(uint64_t bytes) override { next_ = cuda::DeviceBuffer::allocate(device_, bytes); }
  int describe(proto::RegisterBuffer* r) override {
    r->set_cuda_ipc_handle(next_.ipc_handle());
    r->set_client_event(client_event_.ipc_handle());
    return -1;
  }
  void registered(const proto::BufferRegistered& answer) override {
    if (!executor_event_.valid()) executor_event_ = cuda::InterprocessEvent::open(device_, answer.executor_event());
    // Work of this stream may still read the old buffer.
    if (buffer_.data() != nullptr) cuda::synchronize_stream(use_stream());
    buffer_ = std::move(next_);
  }

 private:
  // The current stream, ordered after the stream of the previous call if it was another (a call's
  // copies reuse the buffer regions the previous call's copies and flags guard).
  cuda::Stream use_stream() {
    const cuda::Stream stream = cuda::current_stream(device_);
    if (stream_.valid() && stream_ != stream) cuda::stream_after(stream, stream_);
    stream_ = stream;
    return stream;
  }

  struct Place {
    uint32_t segment;
    uint64_t offset;
  };

  // Where t's data lies in a segment shared with the executor (sharing its segment first), or
  // nullopt when it cannot be named so: not the caching allocator's, or rows not 16-byte aligned.
  // Memory that has no legacy IPC handle (expandable segments), or an executor that refuses,
  // ends direct operands for this client. Every call asks twice: a segment shared before is found
  // in segments_ by address, without the allocator.
  std::optional<Place> locate(const at::Tensor& t) {
    const auto& allocation = t.storage().data_ptr();
    const auto* data = static_cast<const char*>(t.data_ptr());
    if (allocation.get_deleter() != c10::cuda::CUDACachingAllocator::get()->raw_deleter() ||
        reinterpret_cast<uintptr_t>(data) % 16 != 0) {
      return std::nullopt;
    }
    {
      std::lock_guard<std::mutex> lock(socket_mutex_);
      if (auto place = known_place(data, t.nbytes())) return place;
    }
    try {
      size_t bytes = 0;
      // The allocator's lock, not under ours: segment_freed is called holding it, then takes ours.
      const auto* base =
          static_cast<const char*>(c10::cuda::CUDACachingAllocator::getBaseAllocation(allocation.get(), &bytes));
      proto::Envelope env;
      auto* add = env.mutable_share_segments()->add_add();
      add->set_bytes(bytes);
      add->set_cuda_ipc_handle(cuda::memory_ipc_handle(device_, const_cast<char*>(base)));
      std::lock_guard<std::mutex> lock(socket_mutex_);
      // Segments shared before that overlap this one were given back to CUDA without a word from
      // the allocator: the executor closes their mappings.
      for (auto it = segments_.begin(); it != segments_.end();) {
        if (it->first < base + bytes && base < it->first + it->second.bytes) {
          spdlog::warn("cuda-ipc client: segment {} was freed unseen; the executor lets it go", it->second.id);
          env.mutable_share_segments()->add_release(it->second.id);
          it = segments_.erase(it);
        } else {
          ++it;
        }
      }
      add->set_id(next_segment_);
      socket_.exchange_setup(env, "the sharing of a segment");
      segments_.emplace(base, Segment{next_segment_++, bytes});
      return known_place(data, t.nbytes());
    } catch (const ExecutorLost&) {
      throw;  // [Executor restart]: not a reason to stop sharing segments
    } catch (const c10::Error& e) {
      direct_ = false;
      spdlog::info("cuda-ipc client: calls go through the payload buffer from now on ({})", e.what_without_backtrace());
      return std::nullopt;
    }
  }

  // The place of `bytes` at `data`, all inside a segment already shared (socket_mutex_ held), or nullopt.
  std::optional<Place> known_place(const char* data, size_t bytes) const {
    auto it = segments_.upper_bound(data);  // the first segment after data
    if (it == segments_.begin()) return std::nullopt;
    --it;
    const auto offset = static_cast<uint64_t>(data - it->first);
    if (offset + bytes > it->second.bytes) return std::nullopt;
    return Place{it->second.id, offset};
  }

  // [Device words] (device_words.h): allocated, zeroed and offered through the control block, under
  // MPS and unless SYMBIOSIS_DEVICE_WORDS is 0; a client whose GPU cannot share them keeps the host
  // words alone.
  void offer_device_words() {
    const char* wanted = std::getenv(cuda::kDeviceWordsVariable);
    if ((wanted != nullptr && std::string(wanted) == "0") || !cuda::mps_active()) return;
    try {
      auto words = cuda::DeviceBuffer::allocate(device_, sizeof(uint32_t) * cuda::device_word_count(shm::kCallSlots),
                                                /*zeroed=*/true);
      const std::string handle = words.ipc_handle();
      TORCH_CHECK(handle.size() == sizeof(block_->device_words_handle), "a CUDA IPC handle of ", handle.size(),
                  " bytes, where the control block holds ", sizeof(block_->device_words_handle));
      std::memcpy(block_->device_words_handle, handle.data(), handle.size());
      words_ = std::move(words);
      block_->device_words_offered.store(1, std::memory_order_release);
    } catch (const c10::Error& e) {
      spdlog::info("cuda-ipc client: captured calls hand over through host words alone ({})",
                   e.what_without_backtrace());
    }
  }

  // Until the executor has answered every call announced so far (at most the call timeout).
  void wait_for_calls() const {
    const uint32_t last = announced_.load(std::memory_order_acquire);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(socket_.timeout_ms());
    while (!shm::reached(block_->results_ready.load(std::memory_order_acquire), last)) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "the executor did not answer call ", last, " within ",
                  socket_.timeout_ms(), " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  int device_;
  cuda::InterprocessEvent client_event_, executor_event_;
  cuda::DeviceBuffer buffer_, next_;
  cuda::Stream stream_;  // the last call's
  cuda::PinnedRange control_pin_;
  shm::ControlBlock* block_ = nullptr;  // the control segment, once ordering through its flags
  void* inputs_ready_ = nullptr;        // GPU addresses of the control block's flags
  void* results_ready_ = nullptr;
  cuda::DeviceBuffer words_;            // [Device words], once offered
  std::atomic<uint32_t> announced_{0};  // the last call whose input was announced
  // [Direct operands]
  struct Segment {
    uint32_t id;
    size_t bytes;
  };
  bool direct_;
  bool watching_frees_ = false;              // registered with SegmentFrees
  std::map<const char*, Segment> segments_;  // shared, by base address; guarded by socket_mutex_
  uint32_t next_segment_ = 1;                // 0 names the payload buffer
};

SegmentFrees::SegmentFrees() {
  using Trace = c10::CachingDeviceAllocator::TraceEntry;
  // The allocator attaches a tracker to the devices it has set up, which it does at LibTorch's
  // first use of CUDA: before it, a tracker would hear of no free at all.
  at::globalContext().lazyInitDevice(at::kCUDA);
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([this](const Trace& e) {
    if (e.action_ != Trace::SEGMENT_FREE) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* payload : payloads_) payload->segment_freed(reinterpret_cast<const char*>(e.addr_));
  });
}

}  // namespace
#endif

std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome& welcome,
                                             const ClientEndOptions& options) {
  TORCH_CHECK(options.device.is_cuda(),
              "transport cuda-ipc needs a client on the executor's GPU; this client's device is ", options.device);
#ifdef SYMBIOSIS_WITH_CUDA
  const int device = options.device.has_index() ? options.device.index() : 0;
  return make_payload_transport(socket, welcome, options, [&] {
    return std::make_unique<CudaIpcPayload>(socket, device, options.direct_operands);
  });
#else
  TORCH_CHECK(false, "transport cuda-ipc: this build of symbiosis has no CUDA");
#endif
}

}  // namespace symbiosis::cuda_ipc
