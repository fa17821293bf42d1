#pragma once
// [Device words]
// A captured call's two hand-offs between the tenant's GPU and the executor's ([Captured calls] in
// transport/call_ring.h) go through flags in host memory, which a stream memory operation's wait
// reads over the bus: 5.5 to 8.5 µs a hand-off at N = 1 on an H200, eight a layer (V41). Words in
// the tenant's GPU memory, read in the GPU's L2 by a one-thread kernel that spins on them, carry
// them faster (V15, bench/flag_handoff.cpp). So a cuda-ipc client allocates two words a slot in its
// own GPU memory (result words at [slot], input words at [kCallSlots + 1 + slot]), offers their
// CUDA IPC handle through its control block (ControlBlock::device_words_handle), and the executor
// maps them at its first captured call.
// A client's captured call is one kernel (HandOff) that announces the input and waits for the
// result, where stream memory operations and a waiting kernel cost a quarter of a millisecond more
// a decode step at N = 1 (V49); the executor's side is a waiting kernel and a stream memory write.
//  - Results: the executor sets the slot's device result word with a stream memory write after the
//    call's GEMM, whether the call is in a run launched ahead ([Steps launched ahead] in
//    cuda_ipc_channel.cpp) or taken up by its host (a kernel there costs a launch more on the
//    call's path: N = 1's step 2.53 to 2.59 ms against 2.61 to 2.63 with it, V52, V53); the device
//    word instead of the host one, never both (a host word set beside a device one would let the
//    slot's next wait through: V42). The client's kernel waits on it, reading the host result word
//    now and then: the client's own give_up() releases its waits by setting the host words. The
//    wait clears the slot's device result and input words (the call is done), and the host result
//    word only where that let it go: otherwise only give_up() sets it, and then every wait may go.
//  - Inputs: the client's kernel first sets the slot's host input word (what the executor's host
//    reads to take the call up, [No waits on a client]) and then its device input word, each
//    fenced after what came before. A run launched ahead waits on the device word in a kernel,
//    which clears both, and is released by the control block's runs_voided ([Voided runs]) instead.
//    The call's GEMM is that kernel's programmatic dependent ([Early dependents] in common/cuda.h):
//    it starts as the word comes up, beside the clears and their fence (N = 1's step 2.50 and 2.54
//    ms against 2.55 and 2.57 after the kernel's end, V58).
//  - Why no word is stale: a slot's device input word is cleared by the wait for the slot's
//    result, on the client's stream before its next input is set; a run waits for a slot only
//    after the run's earlier slots got inputs that the client's stream set after that clear.
//  - Only under MPS, on both sides: without it the two processes' kernels take turns on the GPU,
//    and a kernel spinning on a word would hold it through its time slice while the writer waits.
//  - Whichever side cannot (no MPS, SYMBIOSIS_DEVICE_WORDS=0 in the client's environment, the
//    executor unable to map them) uses the host words alone, as before.
// Without LibTorch's headers ([Torch-free kernels] in kernels/launch.h): the kernel is also the
// device way of bench/flag_handoff.cpp.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace symbiosis::cuda {

// One thread, after the stream's earlier work: sets each of `set` to 1, in order, each visible
// everywhere before the next (device or mapped host memory); then waits until
// *await (device memory) is non-zero, or until *release (mapped host memory, read every so many
// reads of the word; null: never) is, lets its programmatic dependents start ([Early dependents]
// in common/cuda.h), and clears await and each of `clear`, and *release too
// where it let the wait go and `clear_release` is set. Cleared words in host memory (`clear`
// with `host_clears`, or the release word) are fenced at system scope before the kernel ends;
// device words need no fence: the stream's later kernels, and the other process's once they
// are ordered after those, see them.
struct HandOff {
  uint32_t* set[2] = {nullptr, nullptr};
  uint32_t* await = nullptr;  // required
  uint32_t* release = nullptr;
  uint32_t* clear[2] = {nullptr, nullptr};
  bool clear_release = false;
  bool host_clears = true;
};

// Enqueues the kernel on `stream`; returns cudaGetLastError() after it.
cudaError_t launch_hand_off(const HandOff& hand_off, cudaStream_t stream);

// [Runs launched together] (cuda_ipc_channel.cpp): the waits of several clients' calls in one
// kernel, a thread each, each as HandOff's (their `set` unused); its programmatic dependents start
// once every wait has let go.
constexpr uint32_t kMaxHandOffs = 16;
struct HandOffs {
  HandOff waits[kMaxHandOffs];
  uint32_t count = 0;
};
cudaError_t launch_hand_offs(const HandOffs& hand_offs, cudaStream_t stream);

// The client's environment variable that, set to 0, keeps its captured calls' flags in host memory.
constexpr const char* kDeviceWordsVariable = "SYMBIOSIS_DEVICE_WORDS";

// [Device words]' layout: words a client allocates, and where a slot's are.
constexpr size_t device_word_count(uint32_t slots) { return 2 * (size_t{slots} + 1); }
inline uint32_t* device_result_word(void* words, uint32_t slots, uint32_t slot) {
  return static_cast<uint32_t*>(words) + slot;
}
inline uint32_t* device_input_word(void* words, uint32_t slots, uint32_t slot) {
  return static_cast<uint32_t*>(words) + slots + 1 + slot;
}

}  // namespace symbiosis::cuda
