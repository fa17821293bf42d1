// [Device words] (device_words.h): the wait kernel.
#include "transport/cuda_ipc/device_words.h"

namespace symbiosis::cuda {
namespace {

// How often a waiting kernel also reads its release word (a read over the bus, where the device
// word is read in the GPU's L2): every this many reads of the device word, some tens of microseconds.
constexpr uint32_t kReleaseEvery = 256;

// Volatile loads and stores: host memory takes no atomics over the bus, and a volatile access
// skips the SM's L1, so that each read sees the other process's writes in L2.
__global__ void hand_off(HandOff h) {
  for (uint32_t* word : h.set) {
    if (word == nullptr) continue;
    __threadfence_system();  // what came before (the stream's earlier work, the word before) first
    *reinterpret_cast<volatile uint32_t*>(word) = 1;
  }
  volatile uint32_t* word = h.await;
  volatile uint32_t* release = h.release;
  bool released = false;
  for (uint32_t reads = 1; *word == 0 && !released; ++reads) {
    released = release != nullptr && reads % kReleaseEvery == 0 && *release != 0;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // [Early dependents] (common/cuda.h): a kernel captured as this one's programmatic dependent
  // starts now, beside the clears below, which it does not read.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  *word = 0;
  for (uint32_t* other : h.clear) {
    if (other != nullptr) *reinterpret_cast<volatile uint32_t*>(other) = 0;
  }
  if (released && h.clear_release) *release = 0;
  if (h.host_clears || released) __threadfence_system();  // cleared before the stream's later work
}

}  // namespace

cudaError_t launch_hand_off(const HandOff& hand_off_words, cudaStream_t stream) {
  hand_off<<<1, 1, 0, stream>>>(hand_off_words);
  return cudaGetLastError();
}

}  // namespace symbiosis::cuda
