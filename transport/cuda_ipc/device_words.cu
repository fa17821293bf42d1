// [Device words] (device_words.h): the wait kernel.
#include "transport/cuda_ipc/device_words.h"

namespace symbiosis::cuda {
namespace {

// How often a waiting kernel also reads its release word (a read over the bus, where the device
// word is read in the GPU's L2): every this many reads of the device word, some tens of microseconds.
constexpr uint32_t kReleaseEvery = 256;

// Volatile loads and stores: host memory takes no atomics over the bus, and a volatile access
// skips the SM's L1, so that each read sees the other process's writes in L2.
// Waits until h.await is up or h.release lets it go; returns whether the release did.
__device__ bool await_word(const HandOff& h) {
  volatile uint32_t* word = h.await;
  volatile uint32_t* release = h.release;
  bool released = false;
  for (uint32_t reads = 1; *word == 0 && !released; ++reads) {
    released = release != nullptr && reads % kReleaseEvery == 0 && *release != 0;
  }
  return released;
}

// [Early dependents] (common/cuda.h): a kernel captured as this one's programmatic dependent starts
// now, beside the clears that follow, which it does not read.
__device__ void start_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ void clear_words(const HandOff& h, bool released) {
  *reinterpret_cast<volatile uint32_t*>(h.await) = 0;
  for (uint32_t* other : h.clear) {
    if (other != nullptr) *reinterpret_cast<volatile uint32_t*>(other) = 0;
  }
  if (released && h.clear_release) *reinterpret_cast<volatile uint32_t*>(h.release) = 0;
  if (h.host_clears || released) __threadfence_system();  // cleared before the stream's later work
}

__global__ void hand_off(HandOff h) {
  for (uint32_t* word : h.set) {
    if (word == nullptr) continue;
    __threadfence_system();  // what came before (the stream's earlier work, the word before) first
    *reinterpret_cast<volatile uint32_t*>(word) = 1;
  }
  const bool released = await_word(h);
  start_dependents();
  clear_words(h, released);
}

__global__ void hand_offs(HandOffs h) {
  const bool mine = threadIdx.x < h.count;
  const bool released = mine && await_word(h.waits[threadIdx.x]);
  __syncthreads();
  start_dependents();
  if (mine) clear_words(h.waits[threadIdx.x], released);
}

}  // namespace

cudaError_t launch_hand_off(const HandOff& hand_off_words, cudaStream_t stream) {
  hand_off<<<1, 1, 0, stream>>>(hand_off_words);
  return cudaGetLastError();
}

cudaError_t launch_hand_offs(const HandOffs& waits, cudaStream_t stream) {
  hand_offs<<<1, waits.count, 0, stream>>>(waits);
  return cudaGetLastError();
}

}  // namespace symbiosis::cuda
