#include "transport/cuda_ipc/cuda_ipc.h"

#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <cstring>

#include "common/cuda_check.h"

namespace symbiosis::cuda {
namespace {

cudaStream_t cuda_stream(Stream stream) {
  TORCH_CHECK(stream.valid(), "no CUDA stream");
  return static_cast<cudaStream_t>(stream.handle);
}

}  // namespace

DeviceBuffer DeviceBuffer::allocate(int device, size_t bytes, bool zeroed) {
  DeviceScope scope(device);
  void* data = nullptr;
  const cudaError_t status = cudaMalloc(&data, bytes);
  TORCH_CHECK(status == cudaSuccess, "cannot allocate a ", bytes, "-byte CUDA IPC buffer on cuda:", device, ": ",
              cudaGetErrorString(status));
  DeviceBuffer buffer(data, bytes, device, [](void* p) { SYMBIOSIS_CUDA_WARN(cudaFree(p)); });
  if (zeroed) {
    SYMBIOSIS_CUDA_CHECK(cudaMemset(data, 0, bytes));
    // Zero before any kernel reads it, on whatever stream (the memset goes on the legacy one).
    SYMBIOSIS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  }
  return buffer;
}

std::string memory_ipc_handle(int device, void* base) {
  DeviceScope scope(device);
  cudaIpcMemHandle_t handle;
  SYMBIOSIS_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

std::string DeviceBuffer::ipc_handle() const { return memory_ipc_handle(device(), data()); }

MappedDeviceBuffer MappedDeviceBuffer::open(int device, const std::string& ipc_handle, size_t bytes) {
  TORCH_CHECK(ipc_handle.size() == sizeof(cudaIpcMemHandle_t), "CUDA IPC memory handle has ", ipc_handle.size(),
              " bytes, expected ", sizeof(cudaIpcMemHandle_t));
  DeviceScope scope(device);
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
  void* data = nullptr;
  const cudaError_t status = cudaIpcOpenMemHandle(&data, handle, cudaIpcMemLazyEnablePeerAccess);
  if (status != cudaSuccess) {
    // The client's bad handle, not an error of this thread's next launch: cleared, or the next
    // batch of any client would fail with it ([No waits on a client]'s review, issue 44).
    (void)cudaGetLastError();
    TORCH_CHECK(false, "cannot open the client's CUDA IPC memory on cuda:", device, ": ", cudaGetErrorString(status),
                " (is the client on this executor's GPU, in another process?)");
  }
  MappedDeviceBuffer mapped(data, bytes, device, [](void* p) { SYMBIOSIS_CUDA_WARN(cudaIpcCloseMemHandle(p)); });
  // A client that says its memory is larger than what the handle names would have the executor
  // read and write past it.
  const size_t usable = allocation_bytes_from(data);
  TORCH_CHECK(bytes <= usable, "the client's CUDA IPC memory has ", usable, " bytes, but it says ", bytes);
  return mapped;
}

InterprocessEvent InterprocessEvent::create(int device) {
  DeviceScope scope(device);
  InterprocessEvent event;
  cudaEvent_t e;
  SYMBIOSIS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess));
  event.event_ = UniqueHandle<void*, Destroy>(e);
  event.device_ = device;
  return event;
}

InterprocessEvent InterprocessEvent::open(int device, const std::string& ipc_handle) {
  TORCH_CHECK(ipc_handle.size() == sizeof(cudaIpcEventHandle_t), "CUDA IPC event handle has ", ipc_handle.size(),
              " bytes, expected ", sizeof(cudaIpcEventHandle_t));
  DeviceScope scope(device);
  cudaIpcEventHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
  InterprocessEvent event;
  cudaEvent_t e;
  const cudaError_t status = cudaIpcOpenEventHandle(&e, handle);
  if (status != cudaSuccess) (void)cudaGetLastError();  // the peer's bad handle: no error of the next launch
  TORCH_CHECK(status == cudaSuccess, "cannot open the peer's CUDA IPC event on cuda:", device, ": ",
              cudaGetErrorString(status));
  event.event_ = UniqueHandle<void*, Destroy>(e);
  event.device_ = device;
  return event;
}

void InterprocessEvent::Destroy::operator()(void* event) const {
  SYMBIOSIS_CUDA_WARN(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
}

std::string InterprocessEvent::ipc_handle() const {
  DeviceScope scope(device_);
  cudaIpcEventHandle_t handle;
  SYMBIOSIS_CUDA_CHECK(cudaIpcGetEventHandle(&handle, static_cast<cudaEvent_t>(event_.get())));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void InterprocessEvent::record(Stream stream) const {
  DeviceScope scope(stream.device);  // [Stream's device]
  SYMBIOSIS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_.get()), cuda_stream(stream)));
}

void InterprocessEvent::make_stream_wait(Stream stream) const {
  DeviceScope scope(stream.device);
  SYMBIOSIS_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(stream), static_cast<cudaEvent_t>(event_.get()), 0));
}

bool InterprocessEvent::completed() const {
  DeviceScope scope(device_);
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_.get()));
  if (status == cudaSuccess) return true;
  (void)cudaGetLastError();  // the peer's, not ours: cleared
  if (status == cudaErrorNotReady) return false;
  spdlog::warn("a peer's CUDA IPC event cannot be queried ({}); counted as completed", cudaGetErrorString(status));
  return true;
}

}  // namespace symbiosis::cuda
#endif  // SYMBIOSIS_WITH_CUDA
