#pragma once
// [Device flags] (bench/flag_handoff.cpp): a captured call's hand-off between a tenant's GPU work and
// the executor's made by one-thread kernels spinning on flags in device memory, where the transport
// uses the driver's stream memory operations on flags in host memory ([Stream-ordered hand-off] in
// transport/call_ring.h). Host words stay beside the device ones, as the transport would need them:
// its executor's host takes a call up when the slot's host input_ready is set ([No waits on a
// client]), and releases waits by setting host words. So the tenant's kernel sets the device word,
// then the host one; the executor's kernel awaits the device word, confirms the host one and clears
// both; the executor sets only the device result word, and the tenant's kernel reads the host word
// now and then so that a host's release still lets it go. Without LibTorch's headers ([Torch-free
// kernels] in kernels/launch.h).
#include <cuda_runtime_api.h>

#include <cstdint>

namespace symbiosis::bench {

// What one hand-off kernel does, in this order (a null word: that part is skipped):
//  1. after the stream's earlier work, sets set_device and then set_host to 1;
//  2. waits until await_device is non-zero (or, looked at now and then, await_host is: a release
//     made from a host), then, when await_host_too, until await_host is non-zero as well; then
//     clears both.
struct FlagHandoff {
  uint32_t* set_device = nullptr;
  uint32_t* set_host = nullptr;  // mapped host memory
  uint32_t* await_device = nullptr;
  uint32_t* await_host = nullptr;  // mapped host memory
  bool await_host_too = false;
};

// Enqueues the kernel on `stream`; returns cudaGetLastError() after it.
cudaError_t launch_flag_handoff(const FlagHandoff& handoff, cudaStream_t stream);

}  // namespace symbiosis::bench
