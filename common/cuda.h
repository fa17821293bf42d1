#pragma once
// [CUDA helpers] What the executor and every transport need of CUDA, in one place that none of
// them owns: whether CUDA and MPS are here, a GPU's UUID, streams that know their GPU, device
// memory owned on its device, pinned host ranges, compute streams, streams of one's own, captured
// work, and the stream operations (copies, waits, the driver's memory operations). What is about
// CUDA IPC alone (IPC memory handles and their mappings, interprocess events) lives with the
// transport that uses it, in transport/cuda_ipc/cuda_ipc.h.
// Every CUDA runtime call goes through SYMBIOSIS_CUDA_CHECK (common/cuda_check.h), which names
// file, line, call and CUDA's own error string; every handle is a UniqueHandle ([Owned handles]).
//
// Built only with CUDA (SYMBIOSIS_WITH_CUDA); cuda_available() says whether this build has it.
#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/unique_handle.h"

namespace symbiosis::cuda {

// True when this build has CUDA and a GPU is visible.
bool cuda_available();
// The GPU's UUID (as nvidia-smi prints it): equal UUIDs are the same GPU across processes.
std::string gpu_uuid(int device);
// Whether NVIDIA MPS serves this process's GPU work (its control daemon is running for our pipe
// directory). Same-GPU clients need it: see docs/operating.md.
bool mps_active();
// How to start MPS, for messages.
const char* mps_hint();

#ifdef SYMBIOSIS_WITH_CUDA

// [Stream's device]
// A CUDA stream and the GPU it belongs to. A cudaStream_t alone does not say its GPU: LibTorch's
// default stream is CUDA's legacy stream, handle 0, which CUDA takes to be the stream of whatever
// device is current on the calling thread. A tenant on cuda:1 whose thread's current device is
// cuda:0 (the default) then enqueued its copies, flag writes and waits on cuda:0's stream,
// unordered with its own work on cuda:1: its losses were NaN, or it hung. Every helper here (and
// in transport/cuda_ipc/cuda_ipc.h) that enqueues on a stream makes the stream's device current
// first.
struct Stream {
  void* handle = nullptr;  // cudaStream_t
  int device = -1;         // -1: no stream
  bool valid() const { return device >= 0; }
  bool operator==(const Stream&) const = default;
};

// Makes `device` the calling thread's current CUDA device for the scope, and the one before it
// current again after ([Stream's device]).
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Device memory released on its own device when the owner goes: the base of the IPC transport's
// DeviceBuffer and MappedDeviceBuffer (transport/cuda_ipc/cuda_ipc.h), which differ only in how
// the memory is had and given back.
class DeviceMemory {
 public:
  using Release = void (*)(void* data);
  DeviceMemory() = default;

  void* data() const { return memory_.get(); }
  size_t size() const { return size_; }
  int device() const { return memory_.releaser().device; }

 protected:
  DeviceMemory(void* data, size_t size, int device, Release release)
      : memory_(data, OnDevice{device, release}), size_(size) {}

 private:
  // Gives the memory back on its own device.
  struct OnDevice {
    int device = 0;
    Release release = nullptr;
    void operator()(void* data) const;
  };
  UniqueHandle<void*, OnDevice> memory_;  // [Owned handles]
  size_t size_ = 0;
};

// How many bytes of the device allocation that holds `address` (on the current device) lie from
// `address` to the allocation's end (the driver's cuMemGetAddressRange).
size_t allocation_bytes_from(const void* address);

// Pins (cudaHostRegister) a host range for asynchronous copies; unregisters on destruction.
// Mapped, the GPU can also address it (device_pointer), as stream memory operations need.
class PinnedRange {
 public:
  PinnedRange() = default;
  PinnedRange(void* data, size_t bytes, bool mapped = false);  // throws when CUDA refuses
  // The GPU's address of `host`, a byte of a mapped range.
  void* device_pointer(void* host) const;

 private:
  struct Unregister {
    void operator()(void* data) const;
  };
  UniqueHandle<void*, Unregister> range_;  // [Owned handles]
};

// [Steps launched ahead] (transport/cuda_ipc/cuda_ipc_channel.cpp): a stream of the caller's own
// (LibTorch's pool hands the same few streams to everyone), non-blocking, at the GPU's highest or
// default priority.
class OwnedStream {
 public:
  static OwnedStream create(int device, bool high_priority);
  OwnedStream() = default;
  Stream get() const { return {stream_.get(), device_}; }
  bool valid() const { return static_cast<bool>(stream_); }

 private:
  struct Destroy {
    void operator()(void* stream) const;
  };
  UniqueHandle<void*, Destroy> stream_;  // cudaStream_t; [Owned handles]
  int device_ = -1;
};

// [Compute streams]
// Makes `device` the calling thread's current device and gives the thread `count` high-priority
// streams of its own (no implicit syncs with the legacy stream), and as many of normal priority.
// use(key) makes stream key % count current. The executor's scheduler thread puts a batch of one
// same-GPU request, computed in place in the client's memory, on the client's stream, so that the
// small GEMMs of different clients run side by side instead of one after another; every other batch
// (packed rows, host rows, NCCL receives), whose buffers come from the allocator, goes on the first
// stream, so that the executor keeps one set of such buffers, as with one stream.
// [Inference first on the GPU]: a fine-tuning request computed in place goes on the client's
// normal-priority stream (use(key, /*yield=*/true)), so the GPU starts the blocks of inference
// batches, on high-priority streams, before those of fine-tuning GEMMs queued beside them: a decode
// call waits behind at most the fine-tuning blocks already running.
// [Queues of their own]: the streams are made here, not taken from LibTorch's pool. CUDA gives a
// process's streams its hardware queues in turn as they are made ([Hardware queues] in
// client_runtime/training/step_graph.cpp), and the pool makes its streams 32 a priority at once:
// the kept streams made after it for runs launched ahead, whose waits on their clients' flags hold
// back whatever shares their queue, then took the very queues of the compute streams, so that a
// tenant's run waiting for its inputs held back the batches of every client on that queue. Made
// first, the 2 x count compute streams take queues that the next 32 - 2 x count kept streams do not.
class ComputeStreams {
 public:
  ComputeStreams(int device, int count);
  void use(uint64_t key, bool yield = false);

 private:
  std::vector<OwnedStream> owned_;    // count high-priority streams, then count of normal priority
  std::vector<c10::Stream> streams_;  // the same, as LibTorch's
  size_t current_ = 0;
};

// [Kept streams]
// Streams made on demand and kept for the process's life, each held by one user at a time and
// handed to the next when given back: a user's later work may be ordered after the stream of one
// gone (so the stream must outlive it), per-stream resources (the GEMM library's workspace) do not
// grow with users that came and went, and no two users share one while they hold it (LibTorch's
// pool hands its 32 streams a priority out in turn). The executor's runs launched ahead and the
// client's captured steps take theirs here. Thread-safe; never destroyed.
class KeptStreams {
 public:
  static KeptStreams& instance();
  // A free stream of `device` at that priority, or a new one.
  Stream take(int device, bool high_priority);
  void give_back(Stream stream, bool high_priority);

 private:
  KeptStreams() = default;
  std::mutex mutex_;
  std::vector<OwnedStream> owned_;
  std::map<std::pair<int, bool>, std::vector<Stream>> free_;  // by device and priority
};

// Makes `stream` LibTorch's current stream of its device for the scope (what LibTorch's operations,
// the GEMM library's included, enqueue on), and the one before it again after.
class CurrentStreamScope {
 public:
  explicit CurrentStreamScope(Stream stream);
  ~CurrentStreamScope();
  CurrentStreamScope(const CurrentStreamScope&) = delete;
  CurrentStreamScope& operator=(const CurrentStreamScope&) = delete;

 private:
  std::optional<c10::Stream> previous_;  // LibTorch's, as it was
};

// [Replayed calls]
// Work on a stream captured once into a CUDA graph and launched again as a whole: one launch
// (~2.5 µs of host time) in place of what the work enqueues (a cuBLAS GEMM: 8–11 µs). The
// executor captures the GEMM of each captured call of a client's step ([Captured calls] in
// transport/call_ring.h), whose operands lie at the same addresses at every replay.
//
// [Captured allocations]
// What the work allocates from LibTorch's caching allocator while it is captured (an MLP block's
// intermediate rows: [MLP blocks] in base_executor/base_model.h) comes from a memory pool of the
// captured work's own, as at::cuda::CUDAGraph's does: every replay writes it, so nothing else may be
// given it until the work is destroyed, and then the pool goes back.
class CapturedWork {
 public:
  CapturedWork() = default;
  // Captures what `work` enqueues on `stream` (it runs nothing); throws, capture ended, when it fails.
  static CapturedWork capture(Stream stream, const std::function<void()>& work);
  void launch(Stream stream) const;
  bool valid() const { return static_cast<bool>(exec_); }

 private:
  struct Destroy {
    void operator()(void* exec) const;
  };
  // [Captured allocations]: the pool (c10's MempoolId_t), given back on its device after the graph
  // (members go in reverse order).
  using PoolId = std::pair<unsigned long long, unsigned long long>;
  struct ReleasePool {
    int device = 0;
    void operator()(PoolId pool) const;
  };
  UniqueHandle<PoolId, ReleasePool> pool_;
  UniqueHandle<void*, Destroy> exec_;  // cudaGraphExec_t; [Owned handles]
};

// [Early dependents]
// Called while capturing `stream`, right after a kernel that lets its dependents start before it
// ends (PTX's griddepcontrol.launch_dependents, as HandOff's waits do once their word is up): the
// next node captured on `stream` becomes a programmatic dependent of it, so it starts at that
// instruction, not at the kernel's end (the kernel's tail and the next one's launch then overlap
// it). For a kernel whose later writes the next one does not read. That node must be a kernel: any
// other fails its capture (the executor's run then goes call by call, with a warning: it is the
// call's GEMM there). Outside a capture, nothing.
void start_next_kernel_early(Stream stream);
// On a tenant's side, a captured call's hand-off starts the step's next kernel so
// (transport/cuda_ipc/cuda_ipc_client.cpp; N = 1's step 2.45 ms against 2.50, V60), in the capture
// of a decode step (while a CallsStartEarly lives on the capturing thread: StepGraph's). What
// follows a call is the model's code, which may enqueue something other than a kernel there: a
// capture that fails with it turns it off for the process (stop()), and StepGraph captures again.
class CallsStartEarly {
 public:
  CallsStartEarly();
  ~CallsStartEarly();
  CallsStartEarly(const CallsStartEarly&) = delete;
  CallsStartEarly& operator=(const CallsStartEarly&) = delete;
  static bool here();  // on this thread, now
  static void stop();

 private:
  bool previous_;
};

// The current CUDA stream of `device` (LibTorch's).
Stream current_stream(int device);
// Waits for what `stream` has enqueued so far.
//
// [Captures and synchronizations]
// The executor's compute streams are every client's, and a thread that lets a client go waits for
// its work on them (CudaIpcChannel's destructor, transport/cuda_ipc/cuda_ipc_channel.cpp) while another
// may be capturing one of them (CapturedWork). Synchronizing a stream that is being captured fails
// and spoils the capture: in Table 5 under lockstep (V62), the capture of a packed batch failed as
// a client left, and the failure's error then failed the calls after it. So captures and the
// records these waits wait for are made one at a time, and the wait itself holds nothing.
void synchronize_stream(Stream stream);
// Orders `stream`'s later work after what `earlier` has enqueued so far (on the same GPU).
void stream_after(Stream stream, Stream earlier);
// [Stream-ordered hand-off] (transport/call_ring.h): the driver's 32-bit stream memory operations
// on a word the GPU addresses (a mapped PinnedRange's device_pointer). The write is fenced after
// the stream's earlier work; the wait holds the stream until the word reaches `value` (modulo 2^32).
void write_value_on_stream(Stream stream, void* word, uint32_t value);
void wait_value_on_stream(Stream stream, void* word, uint32_t value);
// Several of those in one driver call (cuStreamBatchMemOp), in order; at most 4.
struct MemoryOp {
  enum Kind { kWrite, kWaitReached } kind;
  void* word;
  uint32_t value;
};
// In order, as one batch (a wait holds back the operations after it); at most kMaxMemoryOps.
constexpr size_t kMaxMemoryOps = 64;
void memory_ops_on_stream(Stream stream, const MemoryOp* ops, size_t count);
inline void memory_ops_on_stream(Stream stream, std::initializer_list<MemoryOp> ops) {
  memory_ops_on_stream(stream, ops.begin(), ops.size());
}
// cudaMemcpyAsync device to device on `stream`: what a payload copy needs, without ATen's
// per-operation overhead (a few microseconds per call, on every base-layer call).
void copy_on_stream(void* destination, const void* source, size_t bytes, Stream stream);

#endif  // SYMBIOSIS_WITH_CUDA

}  // namespace symbiosis::cuda
