// The executor's end of the "nccl" transport (see transport/channel.h): the client, on another
// GPU, sends each input and receives each result over a 2-rank NCCL communicator, the client rank
// 0 and the executor rank 1. Headers arrive through the shared-memory control channel.
//
// [NCCL streams] Receives and sends run on a side stream of the channel's own, joined to the
// compute stream by two events the channel keeps: the compute stream waits for a receive only
// where the GEMM needs it, and a send (which completes only once the client posts its receive)
// never holds up the batches of other clients behind it. A receive lands straight in the client's
// rows of the batch.
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "transport/channel.h"
#include "transport/nccl/nccl_comm.h"
#include "transport/transport.h"

#ifdef SYMBIOSIS_WITH_NCCL
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

namespace symbiosis::nccl {

#ifdef SYMBIOSIS_WITH_NCCL
namespace {

constexpr int kClientRank = 0;
// Joining and connecting run on the communicator's own thread, so a generous limit costs nothing
// while clients start many at once.
constexpr std::chrono::milliseconds kConnectTimeout{30000};
// [NCCL transfer watchdog]: how long one transfer may wait for the client's side of it.
constexpr std::chrono::seconds kTransferLimit{10};
constexpr std::chrono::milliseconds kWatchInterval{200};

// [NCCL transfer watchdog]
// A client that never posts its side of a transfer (the send of a call's input, the receive of its
// result), or aborts in the middle of one, leaves NCCL's kernel for it waiting on the executor's
// GPU: the channel's side stream stops, and the compute stream, which waits for a receive before
// the batch that reads it, stops every batch behind it. A thread of the channel's own looks five
// times a second; a transfer that has waited kTransferLimit aborts the client's communicator, so
// its kernels end and the streams go on, and counts as a client gone (failed()), which the front
// door forgets. The watch needs a thread of its own: whatever else waits for the stalled GPU (the
// scheduler's thread, or the front door giving back a leaving tenant's pinned buffer) cannot be
// the one to end the stall. So a tenant that withholds a transfer stalls the executor's GPU once,
// for at most kTransferLimit, and is dropped, with the reason in the log.
// Transfers complete in order on the side stream: each started one records an event in a ring,
// with its start time, and the watch looks for the oldest not yet complete. A slot reused before it
// was looked at holds a later transfer, whose completion implies the earlier one's.
class TransferWatch {
 public:
  explicit TransferWatch(int device) {
    c10::cuda::CUDAGuard guard(device);
    for (auto& slot : slots_) SYMBIOSIS_CUDA_CHECK(cudaEventCreateWithFlags(&slot.event, cudaEventDisableTiming));
  }
  ~TransferWatch() {
    for (auto& slot : slots_) SYMBIOSIS_CUDA_WARN(cudaEventDestroy(slot.event));
  }
  TransferWatch(const TransferWatch&) = delete;
  TransferWatch& operator=(const TransferWatch&) = delete;

  // The scheduler's thread: a transfer was just enqueued on `stream`.
  void started(cudaStream_t stream) {
    const uint64_t transfer = issued_.load(std::memory_order_relaxed) + 1;
    auto& slot = slots_[transfer % kSlots];
    slot.started.store(Clock::now().time_since_epoch().count());
    SYMBIOSIS_CUDA_CHECK(cudaEventRecord(slot.event, stream));
    issued_.store(transfer, std::memory_order_release);
  }

  // Any thread: whether the oldest transfer not yet complete started more than kTransferLimit ago.
  bool stuck() const {
    std::lock_guard<std::mutex> lock(check_mutex_);
    const uint64_t issued = issued_.load(std::memory_order_acquire);
    if (issued - checked_ > kSlots) checked_ = issued - kSlots;
    for (; checked_ < issued; ++checked_) {
      const auto& slot = slots_[(checked_ + 1) % kSlots];
      const cudaError_t status = cudaEventQuery(slot.event);
      if (status == cudaSuccess) continue;
      (void)cudaGetLastError();  // not ready is no error of this thread's
      const auto waited = Clock::now() - Clock::time_point(Clock::duration(slot.started.load()));
      return status == cudaErrorNotReady && waited > kTransferLimit;
    }
    return false;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr uint64_t kSlots = 64;
  struct Slot {
    cudaEvent_t event = nullptr;
    std::atomic<Clock::rep> started{0};
  };
  std::array<Slot, kSlots> slots_;
  std::atomic<uint64_t> issued_{0};  // transfers started; written by the scheduler's thread
  mutable std::mutex check_mutex_;
  mutable uint64_t checked_ = 0;  // transfers seen complete; guarded by check_mutex_
};

class NcclChannel : public Channel {
 public:
  NcclChannel(uint64_t client_id, at::Device device, std::shared_ptr<std::atomic<int>> gpu_clients)
      : Channel(TransportKind::kNccl, client_id),
        device_(device.has_index() ? device.index() : 0),
        side_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)),
        transfers_(device_),
        gpu_clients_(gpu_clients ? std::move(gpu_clients) : std::make_shared<std::atomic<int>>(0)) {
    ++*gpu_clients_;
  }
  ~NcclChannel() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(watch_mutex_);
        closing_ = true;
      }
      watch_wake_.notify_all();
      watchdog_.join();
    }
    --*gpu_clients_;
  }

  proto::BufferRegistered register_buffer(const proto::RegisterBuffer&, UniqueFd) override {
    TORCH_CHECK(false, "an nccl client registers no payload buffer (send NcclSetup)");
  }

  // [Transport set-up]: NcclSetup starts joining the client's communicator; it is answered with
  // NcclReady once setup_done().
  proto::Envelope set_up(const proto::Envelope& message) override {
    if (!message.has_nccl_setup()) return Channel::set_up(message);
    TORCH_CHECK(comm_ == nullptr, "NCCL is already set up for this client");
    auto comm = std::make_shared<nccl::Communicator>(message.nccl_setup().unique_id(), /*rank=*/1, device_, kClientRank,
                                                     kConnectTimeout);
    {
      std::lock_guard<std::mutex> lock(comm_mutex_);
      comm_ = std::move(comm);
    }
    watchdog_ = std::thread([this] { watch(); });
    proto::Envelope answer;
    answer.mutable_nccl_ready();
    return answer;
  }

  // Joined and connected, on the communicator's own thread ([NCCL blocking mode]): never blocks.
  bool setup_done() override { return comm_ != nullptr && comm_->ready(); }

  Status check_payload(const shm::CallHeader&, uint64_t, uint64_t) const override {
    if (comm_ == nullptr) return {StatusCode::kInvalidArgument, "NCCL is not set up (send NcclSetup first)"};
    if (comm_->aborted()) return {StatusCode::kInvalidArgument, "this client's NCCL communicator was aborted"};
    return Status::ok();
  }

  at::Tensor input(const shm::CallHeader&, at::ScalarType, at::IntArrayRef) override { return {}; }

  // `rows` belong to the compute stream (the batch): the side stream writes them once the compute
  // stream's earlier work is done (their memory may have served it), and the compute stream reads
  // them once the receive is done; so the caching allocator needs no note of the side stream.
  void receive_into(const shm::CallHeader&, const at::Tensor& rows) override {
    auto compute = c10::cuda::getCurrentCUDAStream(device_);
    compute_done_.record(compute);
    compute_done_.block(side_stream_);
    comm_->recv(rows, kClientRank, side_stream_.stream());
    transfers_.started(side_stream_.stream());
    received_.record(side_stream_);
    received_.block(compute);
  }

  at::Tensor destination(const shm::CallHeader&, at::ScalarType, at::IntArrayRef) override { return {}; }

  void deliver(const shm::CallHeader&, const at::Tensor& rows) override {
    compute_done_.record(c10::cuda::getCurrentCUDAStream(device_));
    compute_done_.block(side_stream_);
    comm_->send(rows, kClientRank, side_stream_.stream());
    transfers_.started(side_stream_.stream());
    c10::cuda::CUDACachingAllocator::recordStream(rows.storage().data_ptr(), side_stream_);
  }

  bool release_replies() override {
    if (!held_reply_ || !compute_done_.query()) return held_reply_.has_value();
    push_reply(*held_reply_, Status::ok());
    held_reply_.reset();
    return false;
  }

  bool failed() const override {
    if (stuck_.load()) return true;
    std::lock_guard<std::mutex> lock(comm_mutex_);
    return comm_ && comm_->failed();
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(comm_mutex_);
    if (comm_) comm_->abort();
  }

 protected:
  // A refused call's input or result will never be exchanged: the communicator cannot be used again.
  void after_refusal(const shm::CallHeader&) override { abort(); }

  // [NCCL readiness] The client posts its receive when the reply comes. Until the result arrives
  // that receive's kernel occupies SMs of the client's GPU, polling; alone on its GPU the client
  // has nothing else to run, but beside other clients it takes SMs from their work (measured: 8
  // clients of a 1B model on one GPU ran 0.67x as fast as with the rule below, and 1.07x their
  // local placement with it). So when other nccl clients share its GPU, the reply waits until the
  // result is computed: compute_done_, last recorded by deliver() after the call's GEMM. The client
  // has one call in flight, so one reply at most is held.
  bool hold_reply(const shm::CallHeader& h) override {
    if (gpu_clients_->load() < 2) return false;
    held_reply_ = h;
    return true;
  }

 private:
  // [NCCL transfer watchdog]: the watchdog_ thread's loop, until the channel closes or a transfer is stuck.
  void watch() {
    SYMBIOSIS_CUDA_WARN(cudaSetDevice(device_));
    std::unique_lock<std::mutex> lock(watch_mutex_);
    while (!watch_wake_.wait_for(lock, kWatchInterval, [&] { return closing_; })) {
      if (!transfers_.stuck()) continue;
      spdlog::warn(
          "client {}: an NCCL transfer has waited {} s for the client's side of it (it never posted its "
          "send or receive, or aborted in the middle); dropping the client ([NCCL transfer watchdog])",
          client_id(), kTransferLimit.count());
      stuck_.store(true);
      abort();
      return;
    }
  }

  int device_;
  c10::cuda::CUDAStream side_stream_;
  // Reused for every call (a wait takes the event as last recorded): no event is made per call.
  at::cuda::CUDAEvent compute_done_, received_;
  TransferWatch transfers_;  // [NCCL transfer watchdog]
  std::atomic<bool> stuck_{false};
  std::shared_ptr<std::atomic<int>> gpu_clients_;
  std::optional<shm::CallHeader> held_reply_;
  mutable std::mutex comm_mutex_;             // guards comm_ being set (scheduler thread) against abort() (front door)
  std::shared_ptr<nccl::Communicator> comm_;  // set once; the scheduler thread reads it without the lock
  std::mutex watch_mutex_;                    // guards closing_
  std::condition_variable watch_wake_;
  bool closing_ = false;
  std::thread watchdog_;  // started with the communicator; joined before the members it reads go
};

}  // namespace
#endif

std::shared_ptr<Channel> make_channel(const ChannelContext& context) {
#ifdef SYMBIOSIS_WITH_NCCL
  TORCH_CHECK(context.device.is_cuda(), "transport nccl needs an executor on a GPU; this one runs on ", context.device);
  return std::make_shared<NcclChannel>(context.client_id, context.device, context.gpu_clients);
#else
  (void)context;
  TORCH_CHECK(false, "transport nccl: this build of symbiosis has no NCCL");
#endif
}

// The client's end (nccl_client.cpp).
std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome& welcome,
                                             const ClientEndOptions& options);

// [Transports]: this transport's row in transport.cpp's table.
extern const TransportPlugin kPlugin{TransportKind::kNccl, &nccl_available, &make_channel, &make_client};

}  // namespace symbiosis::nccl
