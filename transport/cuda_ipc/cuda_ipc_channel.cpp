// The executor's end of the "cuda-ipc" transport: the client's GPU memory (its payload buffer and,
// [Direct operands], the segments of its caching allocator it shares), mapped here through CUDA
// IPC ([Registered buffers] in transport/channel.h).
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "transport/channel.h"
#include "transport/transport.h"
#include "transport/cuda_ipc/cuda_ipc.h"

namespace symbiosis::cuda_ipc {

#ifdef SYMBIOSIS_WITH_CUDA
namespace {

// "cuda-ipc": the client's device buffer on the executor's GPU, mapped through CUDA IPC. A call
// the client numbered is ordered through the control segment's flags ([Stream-ordered hand-off]
// in transport/call_ring.h): it is taken up once its input is written, and the executor's stream
// writes results_ready after its result. Otherwise (headers over ZeroMQ) it is taken up once the
// client's event has completed, and the executor records its own event after writing results;
// the client's stream waits on that before reading.
//
// [No waits on a client] The executor's streams never wait for anything a client controls: a
// client's event, or a flag its GPU writes, is asked from the executor's host, and a call is taken
// up only once they say its input is written. So a client whose GPU never gets there (a kernel that
// spins, a stream waiting on a flag no one sets, an event it destroyed) holds back its own calls
// and nobody else's; a stream wait on its event would stall every batch on that stream.
class CudaIpcChannel : public RegisteredBufferChannel {
 public:
  CudaIpcChannel(uint64_t client_id, at::Device device)
      : RegisteredBufferChannel(TransportKind::kCudaIpc, client_id),
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

  bool recurs(const shm::CallHeader& h) const override { return captured_slot(h) != nullptr && !replays_failed_; }

  bool compute_replayed(const shm::CallHeader& h, const at::Tensor& input, const at::Tensor& destination,
                        const std::function<void()>& compute) override {
    if (!recurs(h)) return false;
    const cuda::Stream stream = cuda::current_stream(device_);
    const Replay::Key key{h.layer_id, h.op, h.tokens, input.data_ptr(), destination.data_ptr(), stream.handle};
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
    if (const cuda::Stream now = cuda::current_stream(device_); now != stream_) {
      if (stream_.valid()) cuda::stream_after(now, stream_);
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
  void map(const proto::RegisterBuffer& r, UniqueFd, proto::BufferRegistered* answer) override {
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
  // [No waits on a client]
  bool input_ready(const shm::CallHeader& h) const override {
    if (h.slot != 0) {  // [Captured calls]; a slot out of range is handed out to be refused
      const auto* slot = captured_slot(h);
      return slot == nullptr || slot->input_ready.load(std::memory_order_acquire) != 0;
    }
    if (h.sequence == 0) return !client_event_.valid() || client_event_.completed();
    return shm::reached(control_block()->inputs_ready.load(std::memory_order_acquire), h.sequence);
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
    for (const cuda::Stream& stream : streams_) cuda::synchronize_stream(stream);
  }

  int device_;
  cuda::Stream stream_;                // this client's last call's
  std::vector<cuda::Stream> streams_;  // every compute stream this client's calls went on (a few at most)
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

}  // namespace

std::shared_ptr<Channel> make_channel(const ChannelContext& context) {
  return std::make_shared<CudaIpcChannel>(context.client_id, context.device);
}
#else
std::shared_ptr<Channel> make_channel(const ChannelContext&) {
  TORCH_CHECK(false, "transport cuda-ipc: this build of symbiosis has no CUDA");
}
#endif

// The client's end (cuda_ipc_client.cpp).
std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome& welcome,
                                             const ClientEndOptions& options);

// [Transports]: this transport's row in transport.cpp's table.
extern const TransportPlugin kPlugin{TransportKind::kCudaIpc, &make_channel, &make_client};

}  // namespace symbiosis::cuda_ipc
