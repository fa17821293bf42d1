// [Device flags] (flag_handoff_kernel.h): the hand-off kernel.
#include "bench/flag_handoff_kernel.h"

namespace symbiosis::bench {
namespace {

// How often a waiting kernel also reads its host word (a read over the bus, where a device word is
// read in the GPU's L2): every this many reads of the device word, some tens of microseconds.
constexpr uint32_t kHostEvery = 256;

// One thread. Volatile loads and stores: host memory takes no atomics over PCIe, and a volatile
// access skips the SM's L1, so that each read sees the other process's writes in L2.
__global__ void flag_handoff_kernel(FlagHandoff h) {
  if (h.set_device != nullptr || h.set_host != nullptr) {
    __threadfence_system();  // the stream's earlier work (this kernel follows it) before the flags
    if (h.set_device != nullptr) *reinterpret_cast<volatile uint32_t*>(h.set_device) = 1;
    __threadfence_system();  // set_device before set_host: who sees the host word finds the device one set
    if (h.set_host != nullptr) {
      *reinterpret_cast<volatile uint32_t*>(h.set_host) = 1;
      // Drained now, not when the kernel ends: the kernel goes on to wait, and a store to host memory
      // may sit in the GPU's write path meanwhile, where the executor's host polling the word cannot see it.
      __threadfence_system();
    }
  }
  if (h.await_device == nullptr) return;
  volatile uint32_t* device_word = h.await_device;
  volatile uint32_t* host_word = h.await_host;
  for (uint32_t reads = 1; *device_word == 0; ++reads) {
    if (host_word != nullptr && reads % kHostEvery == 0 && *host_word != 0) break;
    __nanosleep(32);
  }
  if (h.await_host_too && host_word != nullptr) {
    while (*host_word == 0) __nanosleep(32);
  }
  *device_word = 0;
  if (host_word != nullptr) *host_word = 0;
  __threadfence_system();  // cleared before the stream's later work
}

}  // namespace

cudaError_t launch_flag_handoff(const FlagHandoff& handoff, cudaStream_t stream) {
  flag_handoff_kernel<<<1, 1, 0, stream>>>(handoff);
  return cudaGetLastError();
}

}  // namespace symbiosis::bench
