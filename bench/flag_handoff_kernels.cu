// symbiosis-bench-flag-handoff's flags set and awaited by kernels (one thread each) rather than by the
// driver's stream memory operations: a spinning kernel sees a word of device memory change within the
// GPU's L2, where a stream's wait is the GPU front end's polling.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace {

// Sets `set` (when given), then spins until `await` (when given) is non-zero and clears it.
__global__ void handoff_kernel(uint32_t* set, uint32_t* await) {
  if (set != nullptr) {
    __threadfence_system();  // the work before this kernel, visible before the flag
    atomicExch(set, 1u);
  }
  if (await != nullptr) {
    while (atomicAdd(await, 0u) == 0) __nanosleep(32);
    atomicExch(await, 0u);
    __threadfence_system();
  }
}

}  // namespace

cudaError_t flag_handoff(uint32_t* set, uint32_t* await, cudaStream_t stream) {
  handoff_kernel<<<1, 1, 0, stream>>>(set, await);
  return cudaGetLastError();
}
