#pragma once
// CUDA IPC pieces of the same-GPU transport, each an RAII owner with copying deleted:
//  - DeviceBuffer: the client's payload buffer, cudaMalloc'd so that its IPC handle names exactly
//    this allocation (a handle to a block of LibTorch's caching allocator would name the start of
//    its segment instead), wrapped as tensors without copies;
//  - MappedDeviceBuffer: the executor's mapping of a client's DeviceBuffer (cudaIpcOpenMemHandle);
//  - InterprocessEvent: an event one process records and the other waits on in its stream, so the
//    two processes' GPU work is ordered without a host synchronization per layer.
// Streams, device memory and the other CUDA helpers these build on are [CUDA helpers]
// (common/cuda.h). Every CUDA runtime call goes through SYMBIOSIS_CUDA_CHECK (common/cuda_check.h),
// which names file, line, call and CUDA's own error string; every handle is a UniqueHandle
// ([Owned handles]).
//
// Built only with CUDA (SYMBIOSIS_WITH_CUDA).
#include <cstddef>
#include <string>

#include "common/cuda.h"
#include "common/unique_handle.h"

namespace symbiosis::cuda {

#ifdef SYMBIOSIS_WITH_CUDA

// The client's payload buffer (and [Device words]): cudaMalloc'd, so its IPC handle names exactly
// this allocation.
class DeviceBuffer : public DeviceMemory {
 public:
  // `zeroed`: filled with zeros, and done, before this returns ([Device words] start at 0).
  static DeviceBuffer allocate(int device, size_t bytes, bool zeroed = false);
  DeviceBuffer() = default;
  std::string ipc_handle() const;  // cudaIpcMemHandle_t's bytes

 private:
  using DeviceMemory::DeviceMemory;
};

// cudaIpcMemHandle_t's bytes for the allocation on `device` that starts at `base` (a cudaMalloc'd
// block: a DeviceBuffer, or a segment of LibTorch's caching allocator).
std::string memory_ipc_handle(int device, void* base);

// The executor's mapping of a client's DeviceBuffer, or of a segment of its caching allocator.
class MappedDeviceBuffer : public DeviceMemory {
 public:
  // Throws naming the problem when the handle is not a buffer of at least `bytes` on `device`.
  static MappedDeviceBuffer open(int device, const std::string& ipc_handle, size_t bytes);
  MappedDeviceBuffer() = default;

 private:
  using DeviceMemory::DeviceMemory;
};

class InterprocessEvent {
 public:
  static InterprocessEvent create(int device);
  static InterprocessEvent open(int device, const std::string& ipc_handle);
  InterprocessEvent() = default;

  std::string ipc_handle() const;  // on the event's GPU ([Stream's device]: the driver crashed otherwise)
  void record(Stream stream) const;
  void make_stream_wait(Stream stream) const;
  // Whether the work the event's last record followed is done, asked from the host (never
  // blocks). An event CUDA cannot query (its error is logged and cleared) counts as completed:
  // nothing waits on it.
  bool completed() const;
  bool valid() const { return static_cast<bool>(event_); }

 private:
  struct Destroy {
    void operator()(void* event) const;
  };
  UniqueHandle<void*, Destroy> event_;  // cudaEvent_t; [Owned handles]
  int device_ = 0;
};

#endif  // SYMBIOSIS_WITH_CUDA

}  // namespace symbiosis::cuda
