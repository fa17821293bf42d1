// The executor's end of the "cuda-ipc" transport: the client's GPU memory (its payload buffer and,
// [Direct operands], the segments of its caching allocator it shares), mapped here through CUDA
// IPC ([Registered buffers] in transport/channel.h).
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common/cuda.h"
#include "common/cuda_check.h"
#include "common/slow_scope.h"
#include "transport/channel.h"
#include "transport/transport.h"
#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/cuda_ipc/device_words.h"

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
// and nobody else's; a stream wait on its event would stall every batch on that stream. The one
// exception is a stream of the client's own, below.
//
// [Steps launched ahead]
// A tenant's captured decode step ([Captured calls] in transport/call_ring.h) makes the same calls
// at every step: the same layers, slots and operands. Taken up one by one, each call waits for the
// executor's host to see its input flag, check it and launch its GEMM: 49 µs a call from one batch
// to the next at N = 1 on an H200, where the GEMM takes 7 (benchmarks-history.md, V9). So once a
// run of a client's decode calls, slot 1 up with consecutive sequences, has been computed call by
// call (computed(): alone, or packed with other clients') and comes again with the same headers,
// the channel captures the whole run into one CUDA graph on a stream of the client's own: for each
// call, a wait on the GPU for its slot's input flag, the flag cleared, the GEMM, the result flag
// set. Each later run with the same headers is then one launch, made as soon as its headers
// arrive, and the calls hand over between the two processes' GPU work through the flags alone,
// with no host on their path.
//  - Everyone else: the waits are on this client's stream, which nothing else uses (the executor
//    asks CUDA for 32 hardware queues, base_executor/main.cpp, so that streams seldom share one).
//    Whatever synchronizes the whole GPU (freeing memory, closing another client's IPC mapping)
//    waits for the run too, so a thread of its own (AheadWatchdog) looks every 100 ms: a run its
//    client's GPU has not finished kStall after its launch has its input flags set by the
//    executor's host, so that the stream drains, and the client is dropped at the scheduler's
//    next look.
//  - Order: a run is launched only once every call handed out before it has its result, after the
//    client's last stream's work; results_ready is written after it.
//  - Only decode calls: fine-tuning calls gain from packing with other clients' calls. Decode calls
//    packed with other tenants' ([Replayed batches] in base_executor/batch_runner.cpp) are
//    recorded too, and their next step launched ahead, alone: runs launched ahead beat steps
//    packed call by call (V47, V55), and when packed calls were not recorded, a tenant whose
//    recording step was packed stayed packed: in V52 and V53 half the tenants of eight went call
//    by call, packed up to seven together, for most of the run (TPOT p50 13.3 to 13.8 ms, the
//    others 4.7 to 8.8; 63 to 64% of the calls launched ahead, against 99% in the other runs).
//  - A new payload buffer or a change of shared segments forgets the runs (their operands moved).
//
// [Runs launched together]
// Tenants decoding the same model make the same calls at every step; launched alone, each step's
// calls read the layer's weights for its own rows, and N tenants read them N times. So the ready
// runs of several clients with one signature (the same layers, ops and widths, call by call, and
// rows of one power of two: a tenant of 8 sequences does not wait for one of 256) may be
// launched as one graph on the stream of the first (the leader): for each call, one kernel waiting
// on every client's input word ([Device words]: HandOffs), one GEMM over all their rows (packed in,
// and out again to each client's memory: CallEnqueuer::enqueue_packed), each client's result word.
// The scheduler decides who goes together and when (base_executor/run_gathering.h); the tenants
// then finish their steps together, and their next runs come close together.
//  - Only clients whose words are in their GPU memory go together (the others' waits are stream
//    memory operations, one client at a time).
//  - Everyone else: a client that stalls holds back the clients launched with it, up to kStall. The
//    watchdog then voids the run of each client whose GPU has announced none of the inputs the
//    group waits for; a client with an input announced and not yet taken waits for another's, and
//    is left alone, so that only the stalled client is dropped and the others go on.
//  - A group's graph is kept by its leader (kGroups, the least recently used going), under the
//    runs it was made of: a run its client forgets, or a group of other members, makes a new one.

class CudaIpcChannel;

// [Steps launched ahead]: the thread that releases stalled runs, over every channel that launched
// one. Never destroyed (a channel may go at exit).
class AheadWatchdog {
 public:
  static AheadWatchdog& instance() {
    static auto* watchdog = new AheadWatchdog();
    return *watchdog;
  }
  void add(CudaIpcChannel* channel);
  // After this returns, the thread does not touch `channel`.
  void remove(CudaIpcChannel* channel) {
    std::lock_guard<std::mutex> lock(mutex_);
    channels_.erase(std::remove(channels_.begin(), channels_.end(), channel), channels_.end());
  }

 private:
  void run();
  std::mutex mutex_;
  std::vector<CudaIpcChannel*> channels_;
  bool started_ = false;
};

class CudaIpcChannel : public RegisteredBufferChannel {
 public:
  CudaIpcChannel(uint64_t client_id, at::Device device, bool mps, uint32_t lane)
      : RegisteredBufferChannel(TransportKind::kCudaIpc, client_id),
        device_(device.has_index() ? device.index() : 0),
        mps_(mps),
        lane_(lane),
        executor_event_(cuda::InterprocessEvent::create(device_)),
        control_pin_(control_memory().data(), control_memory().size(), /*mapped=*/true),
        results_ready_(control_pin_.device_pointer(&control_block()->results_ready)) {}

  ~CudaIpcChannel() override {
    // Work enqueued on our buffer or flags must finish before they go, whichever thread drops
    // the last reference; a run launched ahead waits for flags the client may never set.
    if (watched_) AheadWatchdog::instance().remove(this);
    release_launched();
    try {
      synchronize_streams();
    } catch (const c10::Error& e) {  // a destructor must not throw: that would end the executor
      spdlog::error("client {}: waiting for its work as it goes failed: {}", client_id(), e.what_without_backtrace());
    }
    if (ahead_stream_.valid()) cuda::KeptStreams::instance().give_back(ahead_stream_, /*high_priority=*/true);
  }

  // AheadWatchdog's thread: releases the run launched last if it has stalled.
  void release_if_stalled(std::chrono::steady_clock::time_point now) {
    std::lock_guard<std::mutex> lock(launched_mutex_);
    if (!launched_at_ || now - *launched_at_ <= kStall ||
        shm::reached(control_block()->results_ready.load(std::memory_order_acquire), launched_last_)) {
      return;
    }
    // [Runs launched together]: an input announced and not yet taken waits for another client's.
    if (launched_with_others_ && std::any_of(launched_slots_.begin(), launched_slots_.end(), [&](uint32_t slot) {
          return control_block()->slots[slot].input_ready.load(std::memory_order_acquire) != 0;
        })) {
      return;
    }
    stall_state_ = launched_state();
    void_launched();
    launched_at_.reset();
    stalled_ = true;
  }

  bool orders_by_flags() const override { return true; }

  // [Transport set-up]: ShareSegments ([Direct operands] in cuda_ipc_client.cpp) maps the client's
  // allocations it adds, and lets go of those it releases (no call in flight names them), on a
  // thread of its own ([Segments mapped aside]); answered once that is done.
  proto::Envelope set_up(const proto::Envelope& message) override {
    if (!message.has_share_segments()) return Channel::set_up(message);
    TORCH_CHECK(!segment_change_.valid(),
                "ShareSegments came before the executor answered the client's last one; "
                "send the next once it is answered");
    const proto::ShareSegments& r = message.share_segments();
    std::vector<cuda::MappedDeviceBuffer> released;
    for (const uint32_t id : r.release()) {
      const auto it = segments_.find(id);
      TORCH_CHECK(it != segments_.end(), "ShareSegments releases segment ", id, ", which is not shared");
      released.push_back(std::move(it->second));
      segments_.erase(it);
    }
    std::vector<proto::Segment> added(r.add().begin(), r.add().end());
    for (size_t i = 0; i < added.size(); ++i) {
      const auto& s = added[i];
      TORCH_CHECK(s.id() != 0, "ShareSegments: segment id 0 is the payload buffer; shared segments count from 1");
      TORCH_CHECK(s.bytes() > 0, "ShareSegments: segment ", s.id(), " has no bytes");
      TORCH_CHECK(!segments_.count(s.id()) &&
                      std::none_of(added.begin(), added.begin() + i, [&](const auto& o) { return o.id() == s.id(); }),
                  "ShareSegments adds segment ", s.id(), ", which is already shared");
      TORCH_CHECK(segments_.size() + i < kMaxSegments, "ShareSegments: a client shares at most ", kMaxSegments,
                  " segments at once");
    }
    forget_runs();
    segment_change_ =
        std::async(std::launch::async, change_segments, device_, client_id(), std::move(released), std::move(added));
    proto::Envelope answer;
    answer.mutable_segments_shared();
    return answer;
  }

  // [Segments mapped aside]: on a thread of its own, closes the mappings of the segments released
  // and opens those added.
  static std::vector<std::pair<uint32_t, cuda::MappedDeviceBuffer>> change_segments(
      int device, uint64_t client, std::vector<cuda::MappedDeviceBuffer> released, std::vector<proto::Segment> added) {
    const SlowScope slow("client " + std::to_string(client) + ": mapping its shared segments");
    released.clear();
    std::vector<std::pair<uint32_t, cuda::MappedDeviceBuffer>> opened;
    for (const auto& s : added)
      opened.emplace_back(s.id(), cuda::MappedDeviceBuffer::open(device, s.cuda_ipc_handle(), s.bytes()));
    return opened;
  }

  bool setup_done() override {
    if (!segment_change_.valid()) return true;
    if (segment_change_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    for (auto& [id, mapped] : segment_change_.get()) segments_.emplace(id, std::move(mapped));  // rethrows its error
    return true;
  }

  bool recurs(const shm::CallHeader& h) const override { return captured_slot(h) != nullptr && !replays_failed_; }

  bool compute_replayed(const shm::CallHeader& h, const at::Tensor& input, const at::Tensor& destination, int variant,
                        const std::function<void()>& compute) override {
    if (!recurs(h)) return false;
    const cuda::Stream stream = cuda::current_stream(device_);
    const Replay::Key key{h.layer_id, h.op, h.tokens, input.data_ptr(), destination.data_ptr(), stream.handle};
    auto& replay = replays_[{h.slot, variant}];
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

  void computed(const shm::CallHeader& h) override {
    if (recurs(h)) record(h);
  }

  // [Steps launched ahead]
  std::optional<uint64_t> run_ready() override {
    ready_ = nullptr;
    if (stalled_) {
      std::lock_guard<std::mutex> lock(launched_mutex_);
      drop("its GPU did not write the inputs of the calls launched ahead for it within " +
           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kStall).count()) + " s (" + stall_state_ +
           ")");
      return std::nullopt;
    }
    if (ahead_failed_ || replays_failed_) return std::nullopt;
    const uint32_t done = control_block()->results_ready.load(std::memory_order_acquire);
    if (!shm::reached(done, last_out_)) return std::nullopt;
    const auto& waiting = pending();
    if (broken() || waiting.empty() || waiting.front().slot != 1 ||
        waiting.front().latency_class != proto::INFERENCE_DECODE) {
      return std::nullopt;
    }
    finish_recording();  // every call before this one has its result: the run recorded is whole
    bool partial = false;
    ready_ = matching_run(waiting, &partial);
    if (ready_ == nullptr) {
      // The client pushes a step's headers one by one after launching it: its first call is held
      // a moment (kAwaitRun, once) for the rest of a run it begins, rather than taken up alone.
      if (!partial) {
        hold_until_.reset();
      } else if (hold_sequence_ != waiting.front().sequence) {
        hold_sequence_ = waiting.front().sequence;
        hold_until_ = Clock::now() + kAwaitRun;
      }
      return std::nullopt;
    }
    // [Runs launched together]: a client without device words goes alone, its run's signature its own.
    return device_words() != nullptr ? ready_->signature : ready_->id | kOwnSignature;
  }

  std::vector<std::vector<shm::CallHeader>> launch_ahead(const std::vector<Channel*>& together,
                                                         CallEnqueuer& enqueuer) override {
    std::vector<CudaIpcChannel*> members;  // this transport's, by run_ready's contract
    for (Channel* channel : together) members.push_back(static_cast<CudaIpcChannel*>(channel));
    if (members.size() > 1 && groups_failed_) return each_alone(members, enqueuer);
    cuda::CapturedWork* work = nullptr;
    try {
      if (!ahead_stream_.valid()) {
        // [Kept streams] (common/cuda.h), its GEMM library's handle and workspace made before any capture.
        ahead_stream_ = cuda::KeptStreams::instance().take(device_, /*high_priority=*/true);
        cuda::CurrentStreamScope scope(ahead_stream_);
        enqueuer.warm_up_stream();
      }
      if (members.size() == 1) {
        if (!ready_->work.valid()) ready_->work = capture_run(ready_->calls, enqueuer);
        work = &ready_->work;
      } else {
        work = &group_for(members, enqueuer).work;
      }
    } catch (const c10::Error& e) {
      if (members.size() == 1) {
        ahead_failed_ = true;
        runs_.clear();
        ready_ = nullptr;
        spdlog::warn("client {}: its decode steps are not launched ahead: {}", client_id(), e.what_without_backtrace());
        return std::vector<std::vector<shm::CallHeader>>(1);  // none launched: it goes call by call
      }
      groups_failed_ = true;
      groups_.clear();
      spdlog::warn("client {}: decode steps are not launched together with its: {}", client_id(),
                   e.what_without_backtrace());
      return each_alone(members, enqueuer);
    }
    const cuda::Stream stream = ahead_stream_;
    for (auto* member : members) member->use_stream(stream);
    work->launch(stream);
    std::vector<std::vector<shm::CallHeader>> launched;
    for (auto* member : members) launched.push_back(member->launched_on(stream, members.size() > 1));
    return launched;
  }

  // [Runs launched together]: each member's ready run launched alone (this leader's groups failed).
  static std::vector<std::vector<shm::CallHeader>> each_alone(const std::vector<CudaIpcChannel*>& members,
                                                              CallEnqueuer& enqueuer) {
    std::vector<std::vector<shm::CallHeader>> launched;
    for (auto* member : members) launched.push_back(member->launch_ahead({member}, enqueuer)[0]);
    return launched;
  }

  void finish_writes(const shm::CallHeader& h) override {
    use_stream(cuda::current_stream(device_));
    if (auto* slot = captured_slot(h)) {
      // results_ready first: a client that goes on past the slot's flag finds the call answered.
      cuda::memory_ops_on_stream(
          stream_, {{cuda::MemoryOp::kWrite, results_ready_, h.sequence}, {cuda::MemoryOp::kWrite, result_word(h), 1}});
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
    forget_runs();
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
    // [Steps launched ahead]: held while the rest of its run's headers come.
    if (hold_until_ && h.slot == 1 && h.sequence == hold_sequence_ && Clock::now() < *hold_until_) return false;
    if (after_unfinished_run()) return false;
    if (h.slot != 0) {  // [Captured calls]; a slot out of range is handed out to be refused
      const auto* slot = captured_slot(h);
      return slot == nullptr || slot->input_ready.load(std::memory_order_acquire) != 0;
    }
    if (h.sequence == 0) return !client_event_.valid() || client_event_.completed();
    return shm::reached(control_block()->inputs_ready.load(std::memory_order_acquire), h.sequence);
  }
  void taken(const shm::CallHeader& h) override {
    if (auto* slot = captured_slot(h)) slot->input_ready.store(0, std::memory_order_release);
    if (h.sequence != 0) last_out_ = h.sequence;
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

  // [Calls after a run] No call is taken up while the run launched before it has not finished: its
  // GEMM would go on a compute stream that every client uses, ordered after that run (use_stream),
  // which waits for this client's GPU. An honest client writes a call's input only after the run's
  // results, so it is never held; a client that writes a later call's input and never the run's
  // would hold every client's calls on that stream until AheadWatchdog drops it.
  bool after_unfinished_run() const {
    if (!unfinished_run_) return false;
    if (!shm::reached(control_block()->results_ready.load(std::memory_order_acquire), *unfinished_run_)) return true;
    unfinished_run_.reset();
    return false;
  }

  // [Compute streams]: a batch of another client's, or a run launched ahead, may put this client's
  // next call on another stream than the last; results_ready must still count up in order.
  void use_stream(cuda::Stream now) {
    if (now == stream_) return;
    if (stream_.valid()) cuda::stream_after(now, stream_);
    if (std::find(streams_.begin(), streams_.end(), now) == streams_.end()) streams_.push_back(now);
    stream_ = now;
  }

  // [Steps launched ahead]
  using Clock = std::chrono::steady_clock;
  static constexpr auto kStall = std::chrono::seconds(5);
  // How long a run's first call waits for the rest of its headers (V12: without it, 80% of the
  // steps at N = 1 began before their headers were all pushed, and went call by call).
  static constexpr auto kAwaitRun = std::chrono::microseconds(200);
  static constexpr size_t kRuns = 8;    // recorded runs kept (a decode bucket each), the least recently used going
  static constexpr size_t kGroups = 8;  // [Runs launched together]: group graphs a leader keeps
  static constexpr uint64_t kOwnSignature = uint64_t{1} << 63;  // or'd with a run's id: a signature no other run has

  struct Run {
    std::vector<shm::CallHeader> calls;  // as first handed out
    uint64_t signature = 0;              // of its calls' layers, ops, dtypes and widths
    uint64_t id = 0;                     // unique in the process: names it in a group's key
    cuda::CapturedWork work;             // captured at the run's first launch (alone)
    uint64_t last_use = 0;
  };

  // [Runs launched together]: one graph for the runs of several clients, kept by the first.
  struct Group {
    std::vector<uint64_t> runs;  // the members' runs' ids, in launch order
    cuda::CapturedWork work;
    uint64_t last_use = 0;
  };

  // A run's signature: what must agree, call by call, for runs of several clients to be one graph
  // (kOwnSignature's bit clear), and the power of two of its rows: runs of other sizes could be one
  // graph too, but the small one would wait for the large one's longer steps (Table 5's tenants of 2
  // to 256 sequences, launched together, took 1.24x the time a token: V69), and the client's lane
  // ([Decode halves]: a tenant's two halves never wait for each other in one launch).
  static uint64_t signature_of(const std::vector<shm::CallHeader>& calls, uint32_t lane) {
    uint64_t hash = (calls.size() ^ (uint64_t{lane} << 48)) * 0x100000001b3ULL;
    for (const auto& h : calls) {
      for (const uint64_t part :
           {uint64_t{h.layer_id}, static_cast<uint64_t>(h.op), static_cast<uint64_t>(h.dtype),
            static_cast<uint64_t>(h.features), uint64_t{std::bit_width(static_cast<uint64_t>(h.tokens))}}) {
        hash = (hash ^ part) * 0x100000001b3ULL;
      }
    }
    return hash & ~kOwnSignature;
  }

  // Whether two calls are the same call of a step: all but their request ids and sequences.
  static bool same_call(const shm::CallHeader& a, const shm::CallHeader& b) {
    return a.layer_id == b.layer_id && a.op == b.op && a.dtype == b.dtype && a.latency_class == b.latency_class &&
           a.tokens == b.tokens && a.features == b.features && a.in_offset == b.in_offset &&
           a.out_offset == b.out_offset && a.buffer_generation == b.buffer_generation && a.in_segment == b.in_segment &&
           a.out_segment == b.out_segment && a.slot == b.slot;
  }

  // A decode call computed (computed()): slot 1 starts a run, the next slot with the next sequence
  // extends it, anything else ends the recording without a run.
  void record(const shm::CallHeader& h) {
    if (h.latency_class != proto::INFERENCE_DECODE) {
      recording_.clear();
    } else if (h.slot == 1) {
      finish_recording();
      recording_ = {h};
    } else if (!recording_.empty() && h.slot == recording_.back().slot + 1 &&
               h.sequence == recording_.back().sequence + 1) {
      recording_.push_back(h);
    } else {
      recording_.clear();
    }
  }

  // Where the executor's stream sets a captured call's result flag: the slot's device word ([Device
  // words]), or its host word when the client offered none.
  void* result_word(const shm::CallHeader& h) {
    if (void* words = device_words()) return cuda::device_result_word(words, shm::kCallSlots, h.slot);
    return control_pin_.device_pointer(&control_block()->slots[h.slot].result_ready);
  }

  // [Device words]: the client's, mapped when its first captured call is answered, or nullptr (it
  // offered none then, the executor runs without MPS, or they do not map: its flags are then the host
  // words, for good). A GPU runs at most 128 kernels at once (an H100's or H200's resident grids),
  // and each client with its words mapped may have a wait running here (its run launched ahead) and
  // one in its own process: were all 128 waits, the kernels that end them could not start. MPS takes
  // 48 processes a GPU (the soak notes in docs/benchmarks-history.md), so at most 47 clients' waits
  // run in each place.
  void* device_words() {
    if (words_looked_) return words_.data();
    words_looked_ = true;
    const auto& block = *control_block();
    if (block.device_words_offered.load(std::memory_order_acquire) == 0 || !mps_) return nullptr;
    try {
      words_ = cuda::MappedDeviceBuffer::open(device_,
                                              std::string(block.device_words_handle, sizeof(block.device_words_handle)),
                                              sizeof(uint32_t) * cuda::device_word_count(shm::kCallSlots));
      spdlog::info("client {}: its captured calls hand over through words in its GPU memory", client_id());
    } catch (const c10::Error& e) {
      spdlog::warn(
          "client {}: the words it offered in its GPU memory do not map ({}); its captured calls hand "
          "over through the control segment's words",
          client_id(), e.what_without_backtrace());
    }
    return words_.data();
  }

  void finish_recording() {
    if (recording_.size() < 2) {
      recording_.clear();
      return;
    }
    const bool known = std::any_of(runs_.begin(), runs_.end(), [&](const Run& run) {
      return run.calls.size() == recording_.size() &&
             std::equal(run.calls.begin(), run.calls.end(), recording_.begin(), same_call);
    });
    if (!known) {
      if (runs_.size() == kRuns) {
        runs_.erase(std::min_element(runs_.begin(), runs_.end(),
                                     [](const Run& a, const Run& b) { return a.last_use < b.last_use; }));
      }
      static std::atomic<uint64_t> runs_made{0};
      const uint64_t signature = signature_of(recording_, lane_);
      runs_.push_back({std::move(recording_), signature, ++runs_made, {}, ++uses_});
    }
    recording_.clear();
  }

  // The recorded run the waiting calls begin with, whole and numbered in order; nullptr if none,
  // and then *partial says whether they are the beginning of one whose other headers are to come.
  Run* matching_run(const std::deque<shm::CallHeader>& waiting, bool* partial) {
    for (auto& run : runs_) {
      const size_t compared = std::min(run.calls.size(), waiting.size());
      bool same = true;
      for (size_t i = 0; i < compared && same; ++i) {
        same = same_call(run.calls[i], waiting[i]) &&
               waiting[i].sequence == waiting[0].sequence + static_cast<uint32_t>(i);
      }
      if (same && compared == run.calls.size()) return &run;
      *partial = *partial || same;
    }
    return nullptr;
  }

  cuda::CapturedWork capture_run(const std::vector<shm::CallHeader>& calls, CallEnqueuer& enqueuer) {
    const cuda::Stream stream = ahead_stream_;
    return cuda::CapturedWork::capture(stream, [&] {
      cuda::CurrentStreamScope scope(stream);
      for (const auto& h : calls) {
        await_input(stream, h);
        enqueuer.enqueue(*this, h);
        // The last call's flag is set at each launch, after results_ready ([Device words]: a stream
        // memory write, not a kernel, for the others too).
        if (&h != &calls.back()) cuda::write_value_on_stream(stream, result_word(h), 1);
      }
    });
  }

  // Where a stalled run stood, for the drop's message: which of its calls' flags are up (input:
  // written by the client's GPU and not yet taken by the run; result: set by the run and not yet
  // taken by the client's GPU), and the two counters. launched_mutex_ held.
  std::string launched_state() const {
    const auto& block = *control_block();
    const bool on_device = words_.data() != nullptr;  // [Device words]: the result flags are there
    std::string inputs, results = on_device ? "in its GPU memory" : "";
    for (const uint32_t slot : launched_slots_) {
      inputs += block.slots[slot].input_ready.load(std::memory_order_acquire) ? '1' : '0';
      if (!on_device) results += block.slots[slot].result_ready.load(std::memory_order_acquire) ? '1' : '0';
    }
    return std::to_string(launched_slots_.size()) + " calls launched; input flags " + inputs + "; result flags " +
           results + "; results_ready " + std::to_string(block.results_ready.load(std::memory_order_acquire)) + " of " +
           std::to_string(launched_last_) + "; inputs_ready " +
           std::to_string(block.inputs_ready.load(std::memory_order_acquire));
  }

  // A run's wait for a call's input, and the input flags cleared: on the slot's device input word
  // ([Device words]; runs_voided lets it go), or a stream wait on its host word.
  void await_input(cuda::Stream stream, const shm::CallHeader& h) {
    void* input_ready = control_pin_.device_pointer(&control_block()->slots[h.slot].input_ready);
    void* words = device_words();
    if (words == nullptr) {
      cuda::memory_ops_on_stream(
          stream, {{cuda::MemoryOp::kWaitReached, input_ready, 1}, {cuda::MemoryOp::kWrite, input_ready, 0}});
      return;
    }
    SYMBIOSIS_CUDA_CHECK(cuda::launch_hand_off(input_wait(h), static_cast<cudaStream_t>(stream.handle)));
    cuda::start_next_kernel_early(stream);  // [Early dependents]: the call's GEMM, once the input is up
  }

  // [Device words]: a run's wait for call h's input on its device word, which clears the slot's host
  // input word too; runs_voided lets it go.
  cuda::HandOff input_wait(const shm::CallHeader& h) {
    cuda::HandOff wait;
    wait.await = cuda::device_input_word(device_words(), shm::kCallSlots, h.slot);
    wait.release = static_cast<uint32_t*>(control_pin_.device_pointer(&control_block()->runs_voided));
    wait.clear[0] = static_cast<uint32_t*>(control_pin_.device_pointer(&control_block()->slots[h.slot].input_ready));
    return wait;
  }

  // [Runs launched together]: the graph of `members`' ready runs (this channel first), made at the
  // group's first launch.
  Group& group_for(const std::vector<CudaIpcChannel*>& members, CallEnqueuer& enqueuer) {
    std::vector<uint64_t> runs;
    for (const auto* member : members) runs.push_back(member->ready_->id);
    auto it = std::find_if(groups_.begin(), groups_.end(), [&](const auto& g) { return g->runs == runs; });
    if (it == groups_.end()) {
      if (groups_.size() == kGroups) {
        groups_.erase(std::min_element(groups_.begin(), groups_.end(),
                                       [](const auto& a, const auto& b) { return a->last_use < b->last_use; }));
      }
      std::string who;
      for (const auto* member : members) who += (who.empty() ? "" : ", ") + std::to_string(member->client_id());
      spdlog::info("client {}: a graph of the decode steps of clients {} launched together ({} kept)", client_id(), who,
                   groups_.size() + 1);
      auto group = std::make_unique<Group>();
      group->runs = std::move(runs);
      capture_group(*group, members, enqueuer);
      groups_.push_back(std::move(group));
      it = std::prev(groups_.end());
    }
    (*it)->last_use = ++uses_;
    return **it;
  }

  void capture_group(Group& group, const std::vector<CudaIpcChannel*>& members, CallEnqueuer& enqueuer) {
    TORCH_CHECK(members.size() <= cuda::kMaxHandOffs, "at most ", cuda::kMaxHandOffs, " runs launched together");
    const auto& calls = members[0]->ready_->calls;
    int64_t rows = 0;
    for (const auto* member : members) {
      const auto& theirs = member->ready_->calls;
      TORCH_CHECK(theirs.size() == calls.size(), "runs of different lengths launched together");
      for (size_t i = 0; i < calls.size(); ++i) {
        TORCH_CHECK(theirs[i].layer_id == calls[i].layer_id && theirs[i].op == calls[i].op &&
                        theirs[i].dtype == calls[i].dtype && theirs[i].features == calls[i].features,
                    "runs of different calls launched together");
      }
      rows += std::max_element(theirs.begin(), theirs.end(), [](const auto& a, const auto& b) {
                return a.tokens < b.tokens;
              })->tokens;
    }
    if (packing_rows_ < rows) {                 // a larger scratch: the graphs made on the smaller one go
      cuda::synchronize_stream(ahead_stream_);  // the last group's work on it first
      groups_.clear();
      packing_scratch_ = enqueuer.packing_scratch(rows);
      packing_rows_ = rows;
    }
    const cuda::Stream stream = ahead_stream_;
    group.work = cuda::CapturedWork::capture(stream, [&] {
      cuda::CurrentStreamScope scope(stream);
      std::vector<std::pair<Channel*, shm::CallHeader>> packed;
      std::vector<cuda::MemoryOp> results;
      for (size_t i = 0; i < calls.size(); ++i) {
        packed.clear();
        results.clear();
        cuda::HandOffs waits;
        for (auto* member : members) {
          const auto& h = member->ready_->calls[i];
          waits.waits[waits.count++] = member->input_wait(h);
          packed.emplace_back(member, h);
          results.push_back({cuda::MemoryOp::kWrite, member->result_word(h), 1});
        }
        SYMBIOSIS_CUDA_CHECK(cuda::launch_hand_offs(waits, static_cast<cudaStream_t>(stream.handle)));
        cuda::start_next_kernel_early(stream);  // [Early dependents]: the packing copy, once every input is up
        enqueuer.enqueue_packed(packed, packing_scratch_);
        // The last call's words are set at each launch, after results_ready.
        if (i + 1 < calls.size()) cuda::memory_ops_on_stream(stream, results.data(), results.size());
      }
    });
  }

  // After the launch of this client's ready run (alone or with others) on `stream`: hands its calls out.
  std::vector<shm::CallHeader> launched_on(cuda::Stream stream, bool with_others) {
    Run* run = ready_;
    ready_ = nullptr;
    const auto& waiting = pending();
    std::vector<shm::CallHeader> calls(waiting.begin(),
                                       waiting.begin() + static_cast<std::ptrdiff_t>(run->calls.size()));
    last_out_ = calls.back().sequence;
    // results_ready before the last call's result flag, which lets the client go on: its next
    // run then finds every call before it answered.
    cuda::memory_ops_on_stream(stream, {{cuda::MemoryOp::kWrite, results_ready_, last_out_},
                                        {cuda::MemoryOp::kWrite, result_word(calls.back()), 1}});
    run->last_use = ++uses_;
    if (!watched_) {
      AheadWatchdog::instance().add(this);
      watched_ = true;
    }
    {
      std::lock_guard<std::mutex> lock(launched_mutex_);
      launched_slots_.clear();
      for (const auto& h : run->calls) launched_slots_.push_back(h.slot);
      launched_last_ = last_out_;
      launched_at_ = Clock::now();
      launched_with_others_ = with_others;
    }
    unfinished_run_ = last_out_;
    hand_out(calls.size());
    return calls;
  }

  // The run launched last may wait on the GPU for input flags its client will never set: set them
  // from here, so that it drains (its results are void: the client is gone or dropped).
  void release_launched() {
    std::lock_guard<std::mutex> lock(launched_mutex_);
    if (launched_at_ && !shm::reached(control_block()->results_ready.load(std::memory_order_acquire), launched_last_))
      void_launched();
  }

  // [Voided runs]
  // A run let go without its client's inputs computes on whatever its client's memory holds, and
  // sets its result flags and results_ready as a run with inputs would. The client may still be
  // there: one whose GPU stood still (behind another stream's wait on its hardware queue: [Hardware
  // queues] in client_runtime/training/step_graph.cpp) and was dropped for it. Its GPU then goes on
  // with these results, and its host, whose settle() waits for results_ready alone, took them for
  // real ones: a generator kept the token the voided step chose (V36). So the word runs_voided is set
  // first, before the input flags that let the run go (with [Device words], the word itself lets its
  // waits go), and the client's settle() reads it once results_ready has come: set, the results are
  // void, and the client redoes the step on a new connection. launched_mutex_ held.
  void void_launched() {
    control_block()->runs_voided.store(1, std::memory_order_release);
    for (const uint32_t slot : launched_slots_)
      control_block()->slots[slot].input_ready.store(1, std::memory_order_release);
  }

  void forget_runs() {
    runs_.clear();
    recording_.clear();
    ready_ = nullptr;
  }

  int device_;
  bool mps_;                           // NVIDIA MPS serves the executor: [Device words] only then
  uint32_t lane_;                      // its Hello's ([Decode halves]), in its runs' signatures
  cuda::Stream stream_;                // this client's last call's
  std::vector<cuda::Stream> streams_;  // every compute stream this client's calls went on (a few at most)
  // [Replayed calls]: each captured call's GEMM, by slot, with what it was captured for.
  struct Replay {
    using Key = std::tuple<uint32_t, int32_t, int64_t, const void*, const void*, void*>;
    Key key;  // layer, op, tokens, input, destination, stream
    cuda::CapturedWork work;
  };
  std::map<std::pair<uint32_t, int>, Replay> replays_;  // by slot and variant
  bool replays_failed_ = false;
  // [Steps launched ahead]
  std::vector<Run> runs_;                   // recorded, at most kRuns
  std::vector<shm::CallHeader> recording_;  // the run being computed call by call
  Run* ready_ = nullptr;                    // the run the pending calls begin with (run_ready), until launched
  uint64_t uses_ = 0;
  cuda::Stream ahead_stream_;  // from the first launch this client leads ([Kept streams])
  // [Runs launched together]: graphs of groups this client leads, and the packed rows they share.
  std::vector<std::unique_ptr<Group>> groups_;
  at::Tensor packing_scratch_;  // CallEnqueuer::packing_scratch, for packing_rows_ rows
  int64_t packing_rows_ = 0;
  bool groups_failed_ = false;
  bool watched_ = false;        // by AheadWatchdog
  uint32_t last_out_ = 0;       // the sequence of the last numbered call handed out
  uint32_t hold_sequence_ = 0;  // a run's first call held for its other headers, until
  std::optional<Clock::time_point> hold_until_;
  bool ahead_failed_ = false;
  // The run launched last, shared with AheadWatchdog's thread.
  std::mutex launched_mutex_;
  std::vector<uint32_t> launched_slots_;
  uint32_t launched_last_ = 0;  // its last call's sequence
  bool launched_with_others_ = false;
  std::optional<Clock::time_point> launched_at_;
  std::atomic<bool> stalled_{false};  // released by the watchdog: the client is dropped
  std::string stall_state_;           // where the run stood then (launched_state)
  // [Calls after a run]: the last call's sequence of the run launched last, until its results are
  // written (the scheduler's thread).
  mutable std::optional<uint32_t> unfinished_run_;
  cuda::InterprocessEvent executor_event_, client_event_;
  cuda::PinnedRange control_pin_;  // the control segment, for the flags' stream writes
  void* results_ready_;            // the GPU's address of the control block's results_ready
  cuda::MappedDeviceBuffer buffer_;
  // [Device words]: the client's, once looked for (device_words).
  bool words_looked_ = false;
  cuda::MappedDeviceBuffer words_;
  // [Direct operands]: the client's allocations its calls may name, by id.
  static constexpr size_t kMaxSegments = size_t{1} << 16;
  std::unordered_map<uint32_t, cuda::MappedDeviceBuffer> segments_;
  // [Segments mapped aside] A mapping's close waits for the whole GPU to finish what it was given,
  // including other clients' runs launched ahead, which wait on their clients' GPU work, which may
  // wait on a call that only the scheduler's thread takes up: closed there, it held every client
  // until AheadWatchdog dropped some (M8, M9, V26: 5 s). So ShareSegments' closes and opens go on a
  // thread of their own, the scheduler's thread goes on, and the client's answer waits for them.
  std::future<std::vector<std::pair<uint32_t, cuda::MappedDeviceBuffer>>> segment_change_;
};

void AheadWatchdog::add(CudaIpcChannel* channel) {
  std::lock_guard<std::mutex> lock(mutex_);
  channels_.push_back(channel);
  if (!started_) {
    started_ = true;
    std::thread([this] { run(); }).detach();
  }
}

void AheadWatchdog::run() {
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (auto* channel : channels_) channel->release_if_stalled(now);
  }
}

}  // namespace

std::shared_ptr<Channel> make_channel(const ChannelContext& context) {
  return std::make_shared<CudaIpcChannel>(context.client_id, context.device, context.mps, context.lane);
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
extern const TransportPlugin kPlugin{TransportKind::kCudaIpc, &cuda::cuda_available, &make_channel, &make_client};

}  // namespace symbiosis::cuda_ipc
