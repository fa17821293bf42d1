#include "common/cuda.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <span>
#include <vector>

#ifdef SYMBIOSIS_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

namespace symbiosis::cuda {
namespace {

bool process_running(const char* comm_prefix) {
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return false;
  bool found = false;
  while (dirent* entry = ::readdir(proc)) {
    if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
    std::ifstream comm(std::string("/proc/") + entry->d_name + "/comm");
    std::string name;
    if (std::getline(comm, name) && name.rfind(comm_prefix, 0) == 0) {
      found = true;
      break;
    }
  }
  ::closedir(proc);
  return found;
}

}  // namespace

bool mps_active() {
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string pipe_dir = dir != nullptr && *dir != '\0' ? dir : "/tmp/nvidia-mps";
  struct stat st {};
  if (::stat((pipe_dir + "/control").c_str(), &st) != 0) return false;
  // /proc/PID/comm holds 15 characters: "nvidia-cuda-mps" covers the control daemon and its server.
  return process_running("nvidia-cuda-mps");
}

const char* mps_hint() {
  return "start it before the executor and the clients, with the same variables in every process: "
         "export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log; "
         "mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d";
}

#ifndef SYMBIOSIS_WITH_CUDA

bool cuda_available() { return false; }
std::string gpu_uuid(int) { TORCH_CHECK(false, "this build of symbiosis has no CUDA"); }

#else

bool cuda_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::string gpu_uuid(int device) {
  cudaDeviceProp prop{};
  SYMBIOSIS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char text[64];
  std::snprintf(text, sizeof(text), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return text;
}

DeviceScope::DeviceScope(int device) {
  SYMBIOSIS_CUDA_CHECK(cudaGetDevice(&previous_));
  switched_ = previous_ != device;
  if (switched_) SYMBIOSIS_CUDA_CHECK(cudaSetDevice(device));
}

DeviceScope::~DeviceScope() {
  if (switched_) SYMBIOSIS_CUDA_WARN(cudaSetDevice(previous_));
}

namespace {

cudaStream_t cuda_stream(Stream stream) {
  TORCH_CHECK(stream.valid(), "no CUDA stream");
  return static_cast<cudaStream_t>(stream.handle);
}

// Driver functions (stream memory operations, address ranges), found through the runtime (so that nothing links
// libcuda, which a machine without a GPU lacks).
template <typename Function>
Function driver_entry(const char* symbol) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found{};
  SYMBIOSIS_CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, &function, 12000, cudaEnableDefault, &found));
  TORCH_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr, "the CUDA driver has no ", symbol,
              " (a driver for CUDA 12 or later is needed)");
  return reinterpret_cast<Function>(function);
}

void check_driver(CUresult status, const char* call) {
  TORCH_CHECK(status == CUDA_SUCCESS, call, " failed: CUDA driver error ", static_cast<int>(status));
}

}  // namespace

void DeviceMemory::OnDevice::operator()(void* data) const {
  try {  // [Owned handles]: a release must not throw
    DeviceScope scope(device);
    release(data);
  } catch (const c10::Error& e) {
    LOG(WARNING) << "releasing device memory on cuda:" << device << ": " << e.what_without_backtrace();
  }
}

size_t allocation_bytes_from(const void* address) {
  using AddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const auto address_range = driver_entry<AddressRange>("cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto start = reinterpret_cast<CUdeviceptr>(address);
  check_driver(address_range(&base, &size, start), "cuMemGetAddressRange");
  return size - (start - base);
}

PinnedRange::PinnedRange(void* data, size_t bytes, bool mapped) {
  const unsigned flags = mapped ? cudaHostRegisterMapped | cudaHostRegisterPortable : cudaHostRegisterDefault;
  SYMBIOSIS_CUDA_CHECK(cudaHostRegister(data, bytes, flags));
  range_ = UniqueHandle<void*, Unregister>(data);
}

void* PinnedRange::device_pointer(void* host) const {
  void* device = nullptr;
  SYMBIOSIS_CUDA_CHECK(cudaHostGetDevicePointer(&device, host, 0));
  return device;
}

void PinnedRange::Unregister::operator()(void* data) const { SYMBIOSIS_CUDA_WARN(cudaHostUnregister(data)); }

ComputeStreams::ComputeStreams(int device, int count) {
  TORCH_CHECK(count >= 1 && count <= 16, "compute stream count must be 1 to 16 (two priorities of CUDA's 32 ",
              "hardware queues), got ", count);
  const auto index = static_cast<c10::DeviceIndex>(device);
  c10::cuda::set_device(index);
  for (const bool high : {true, false}) {  // [Queues of their own]
    for (int i = 0; i < count; ++i) {
      owned_.push_back(OwnedStream::create(device, high));
      streams_.push_back(c10::cuda::getStreamFromExternal(cuda_stream(owned_.back().get()), index).unwrap());
    }
  }
  c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, streams_[0]));
}

void ComputeStreams::use(uint64_t key, bool yield) {
  const size_t count = streams_.size() / 2;
  const size_t next = key % count + (yield ? count : 0);
  if (next == current_) return;
  current_ = next;
  c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, streams_[next]));
}

OwnedStream OwnedStream::create(int device, bool high_priority) {
  DeviceScope scope(device);
  int least = 0, greatest = 0;
  SYMBIOSIS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  SYMBIOSIS_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, high_priority ? greatest : least));
  OwnedStream owned;
  owned.stream_ = UniqueHandle<void*, Destroy>(stream);
  owned.device_ = device;
  return owned;
}

void OwnedStream::Destroy::operator()(void* stream) const {
  SYMBIOSIS_CUDA_WARN(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
}

KeptStreams& KeptStreams::instance() {
  static auto* streams = new KeptStreams();  // never destroyed: a user may go at exit
  return *streams;
}

Stream KeptStreams::take(int device, bool high_priority) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& free = free_[{device, high_priority}];
  if (free.empty()) {
    owned_.push_back(OwnedStream::create(device, high_priority));
    return owned_.back().get();
  }
  const Stream stream = free.back();
  free.pop_back();
  return stream;
}

void KeptStreams::give_back(Stream stream, bool high_priority) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_[{stream.device, high_priority}].push_back(stream);
}

CurrentStreamScope::CurrentStreamScope(Stream stream) {
  const auto device = static_cast<c10::DeviceIndex>(stream.device);
  previous_ = c10::cuda::getCurrentCUDAStream(device).unwrap();
  c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromExternal(cuda_stream(stream), device));
}

CurrentStreamScope::~CurrentStreamScope() {
  c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *previous_));
}

void start_next_kernel_early(Stream stream) {
  const auto s = cuda_stream(stream);
  cudaStreamCaptureStatus status{};
  const cudaGraphNode_t* last = nullptr;
  size_t count = 0;
  SYMBIOSIS_CUDA_CHECK(cudaStreamGetCaptureInfo(s, &status, nullptr, nullptr, &last, nullptr, &count));
  if (status != cudaStreamCaptureStatusActive || count != 1) return;
  cudaGraphNode_t kernel = last[0];
  cudaGraphEdgeData programmatic{};
  programmatic.from_port = cudaGraphKernelNodePortProgrammatic;
  programmatic.type = cudaGraphDependencyTypeProgrammatic;
  SYMBIOSIS_CUDA_CHECK(
      cudaStreamUpdateCaptureDependencies(s, &kernel, &programmatic, 1, cudaStreamSetCaptureDependencies));
}

namespace {
std::atomic<bool> calls_may_start_early{true};
thread_local bool calls_start_early_here = false;
}  // namespace

CallsStartEarly::CallsStartEarly() : previous_(calls_start_early_here) { calls_start_early_here = true; }

CallsStartEarly::~CallsStartEarly() { calls_start_early_here = previous_; }

bool CallsStartEarly::here() { return calls_start_early_here && calls_may_start_early.load(std::memory_order_relaxed); }

void CallsStartEarly::stop() { calls_may_start_early.store(false, std::memory_order_relaxed); }

namespace {
// [Captures and synchronizations]
std::recursive_mutex capturing;  // recursive: a wait on the capturing thread fails rather than hangs
}  // namespace

CapturedWork CapturedWork::capture(Stream stream, const std::function<void()>& work) {
  DeviceScope scope(stream.device);
  auto s = cuda_stream(stream);
  std::lock_guard<std::recursive_mutex> lock(capturing);
  // [Captured allocations]: what the capturing stream allocates meanwhile goes to a pool of its own.
  const auto device = static_cast<c10::DeviceIndex>(stream.device);
  UniqueHandle<PoolId, ReleasePool> pool(at::cuda::graph_pool_handle(), ReleasePool{stream.device});
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(device, pool.get(),
                                                       [s](cudaStream_t allocating) { return allocating == s; });
  SYMBIOSIS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  struct EndAllocating {
    c10::DeviceIndex device;
    PoolId pool;
    ~EndAllocating() { c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool); }
  } end_allocating{device, pool.get()};
  try {
    work();
  } catch (...) {
    SYMBIOSIS_CUDA_WARN(cudaStreamEndCapture(s, &graph));  // the stream leaves capture mode whatever went wrong
    if (graph != nullptr) SYMBIOSIS_CUDA_WARN(cudaGraphDestroy(graph));
    // The failed capture's error stays the thread's last one, and the GEMM library, reading it after
    // its next launch, would take it for its own: the stream's next work would fail too.
    (void)cudaGetLastError();
    throw;
  }
  SYMBIOSIS_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const auto instantiated = cudaGraphInstantiate(&exec, graph, 0);
  SYMBIOSIS_CUDA_WARN(cudaGraphDestroy(graph));
  SYMBIOSIS_CUDA_CHECK(instantiated);
  CapturedWork captured;
  captured.pool_ = std::move(pool);
  captured.exec_ = UniqueHandle<void*, Destroy>(exec);
  return captured;
}

void CapturedWork::ReleasePool::operator()(PoolId pool) const {
  c10::cuda::CUDACachingAllocator::releasePool(static_cast<c10::DeviceIndex>(device), pool);
}

void CapturedWork::launch(Stream stream) const {
  DeviceScope scope(stream.device);
  SYMBIOSIS_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_.get()), cuda_stream(stream)));
}

void CapturedWork::Destroy::operator()(void* exec) const {
  SYMBIOSIS_CUDA_WARN(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec)));
}

Stream current_stream(int device) {
  return {c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), device};
}

void copy_on_stream(void* destination, const void* source, size_t bytes, Stream stream) {
  DeviceScope scope(stream.device);
  SYMBIOSIS_CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, cuda_stream(stream)));
}

namespace {
// The calling thread's event on `device` that synchronize_stream records and waits for, made once:
// a batch of host rows waits at every call ([Batch data path] in base_executor/batch_runner.cpp),
// where making and destroying an event each time would cost microseconds. Destroyed as the thread
// ends (an error then, with CUDA already gone at exit, is of no use to anyone).
cudaEvent_t waiting_event(int device) {
  struct Events {
    std::vector<cudaEvent_t> by_device;
    ~Events() {
      for (cudaEvent_t event : by_device) {
        if (event != nullptr) (void)cudaEventDestroy(event);
      }
    }
  };
  thread_local Events events;
  if (events.by_device.size() <= static_cast<size_t>(device)) events.by_device.resize(device + 1, nullptr);
  cudaEvent_t& event = events.by_device[device];
  if (event == nullptr) SYMBIOSIS_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}
}  // namespace

void synchronize_stream(Stream stream) {
  DeviceScope scope(stream.device);
  const cudaEvent_t event = waiting_event(stream.device);
  {
    std::lock_guard<std::recursive_mutex> lock(capturing);  // [Captures and synchronizations]
    SYMBIOSIS_CUDA_CHECK(cudaEventRecord(event, cuda_stream(stream)));
  }
  SYMBIOSIS_CUDA_CHECK(cudaEventSynchronize(event));
}

void stream_after(Stream stream, Stream earlier) {
  TORCH_CHECK(stream.device == earlier.device, "stream_after: streams of cuda:", stream.device,
              " and cuda:", earlier.device);
  DeviceScope scope(stream.device);
  cudaEvent_t event;
  SYMBIOSIS_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  SYMBIOSIS_CUDA_CHECK(cudaEventRecord(event, cuda_stream(earlier)));
  SYMBIOSIS_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(stream), event, 0));
  SYMBIOSIS_CUDA_CHECK(cudaEventDestroy(event));  // released once the wait is done with it
}

void write_value_on_stream(Stream stream, void* word, uint32_t value) {
  memory_ops_on_stream(stream, {{MemoryOp::kWrite, word, value}});
}

void wait_value_on_stream(Stream stream, void* word, uint32_t value) {
  memory_ops_on_stream(stream, {{MemoryOp::kWaitReached, word, value}});
}

void memory_ops_on_stream(Stream stream, const MemoryOp* ops, size_t count) {
  using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
  static const auto batch = driver_entry<BatchMemOp>("cuStreamBatchMemOp");
  CUstreamBatchMemOpParams params[kMaxMemoryOps] = {};
  TORCH_CHECK(count <= kMaxMemoryOps, "memory_ops_on_stream takes at most ", kMaxMemoryOps, " operations, got ", count);
  unsigned int n = 0;
  for (const MemoryOp& op : std::span(ops, count)) {
    auto& p = params[n++];
    if (op.kind == MemoryOp::kWrite) {
      p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      p.writeValue.address = reinterpret_cast<CUdeviceptr>(op.word);
      p.writeValue.value = op.value;
      p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    } else {
      p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      p.waitValue.address = reinterpret_cast<CUdeviceptr>(op.word);
      p.waitValue.value = op.value;
      p.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    }
  }
  DeviceScope scope(stream.device);  // [Stream's device]: the legacy stream is the current context's
  check_driver(batch(static_cast<CUstream>(stream.handle), n, params, 0), "cuStreamBatchMemOp");
}

#endif  // SYMBIOSIS_WITH_CUDA

}  // namespace symbiosis::cuda
