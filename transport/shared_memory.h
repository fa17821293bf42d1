#pragma once
// POSIX shared memory between a client and the executor on one host, and the futex-based wait
// both sides use on it.
//
// SharedMemory owns one mapping of an anonymous segment (memfd_create + mmap), RAII, copying
// deleted. A segment has no name that another process could open: the side that creates it hands
// its file descriptor to the other side on the executor's local socket, which only the process the
// client proved to be can use ([Proven placement] in transport/local_socket.h). The memory goes
// away with the last mapping and descriptor, even if both processes are killed.
//
// [Sealed segments]
// A process that shares a memfd can shrink it (ftruncate) under the other's mapping, which then
// dies of SIGBUS at its next touch of the lost pages. So every segment is sealed before it is
// handed over: create() seals it against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW) and
// against further seals (F_SEAL_SEAL), and map_descriptor() refuses a segment that does not carry
// F_SEAL_SHRINK, naming the seal. The kernel then refuses the peer's ftruncate, whoever made the
// segment. Each mapping is also watched by a [Fault guard], in case something the seals do not
// cover faults all the same.
//
// [Fault guard]
// Defence in depth: a touch of shared memory that faults (SIGBUS) must cost the peer that shares
// it, never the process. Every SharedMemory mapping is listed in a process-wide table; a SIGBUS
// handler that finds the faulting address in a listed mapping puts anonymous zero pages in its
// place (mmap MAP_FIXED over the whole mapping) and marks it faulted, so the faulting instruction
// runs again on zeros and the thread goes on, whatever thread it was (an OpenMP worker in a GEMM
// included). The owner asks faulted() and drops its peer (the executor's channels say broken()).
// A fault anywhere else goes to the handler that was there before, or kills the process as it
// would have. This is how Wayland compositors survive clients that shrink their shared pools.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/unique_fd.h"
#include "common/unique_handle.h"

namespace symbiosis::shm {

// [Fault guard]: one mapping listed in the process's table while this lives (RAII, move only).
class FaultGuard {
 public:
  FaultGuard() = default;
  // Lists [data, data + bytes); installs the SIGBUS handler the first time. A full table (more
  // than kMaxGuarded mappings) leaves the mapping unguarded, with a warning.
  FaultGuard(void* data, size_t bytes);
  FaultGuard(FaultGuard&& other) noexcept : slot_(std::exchange(other.slot_, -1)) {}
  FaultGuard& operator=(FaultGuard&& other) noexcept;
  FaultGuard(const FaultGuard&) = delete;
  FaultGuard& operator=(const FaultGuard&) = delete;
  ~FaultGuard() { release(); }

  bool faulted() const;
  static constexpr int kMaxGuarded = 8192;

 private:
  void release();
  int slot_ = -1;
};

class SharedMemory {
 public:
  // A new segment of `bytes` (zero-filled), sealed ([Sealed segments]); `purpose` names it in /proc
  // and in errors.
  static SharedMemory create(const std::string& purpose, size_t bytes);
  // Maps the segment a peer handed over; throws when it is smaller than `bytes` or not sealed
  // against shrinking ([Sealed segments]). The mapping keeps the descriptor, so it can be handed on.
  static SharedMemory map_descriptor(UniqueFd descriptor, size_t bytes, const std::string& purpose);

  SharedMemory() = default;
  SharedMemory(SharedMemory&&) = default;
  // Member by member: the guard lets go of the old mapping before it is unmapped.
  SharedMemory& operator=(SharedMemory&&) = default;
  ~SharedMemory() { guard_ = FaultGuard(); }

  void* data() const { return mapping_.get(); }
  size_t size() const { return mapping_.releaser().size; }
  // The segment's descriptor, to hand to a peer (SCM_RIGHTS copies it).
  int descriptor() const { return descriptor_.get(); }
  bool mapped() const { return static_cast<bool>(mapping_); }
  // [Fault guard]: whether a touch of this mapping faulted (it holds zeros since). Any thread.
  bool faulted() const { return guard_.faulted(); }

 private:
  struct Unmap {
    size_t size = 0;
    void operator()(void* data) const;
  };
  FaultGuard guard_;                    // before mapping_, and let go first in the destructor: unlisted, then unmapped
  UniqueHandle<void*, Unmap> mapping_;  // [Owned handles]
  UniqueFd descriptor_;
};

// [Spin, then sleep]
// A waiter first spins on its condition for a short while (a hand-off between processes on one
// host then costs well under a microsecond), then sleeps on a futex word in shared memory. A
// producer changes the state, then calls notify(): it bumps the word and wakes sleepers only if
// there are any, so the hot path makes no system call. The word/sleepers pair follows the Dekker
// pattern with sequentially consistent operations, so no wake-up is lost.
struct WaitWord {
  std::atomic<uint32_t> word{0};
  std::atomic<uint32_t> sleepers{0};

  void notify();
  uint32_t current() const { return word.load(std::memory_order_seq_cst); }
  // Sleeps while word == seen, at most until `deadline`. Returns at once if it changed.
  void sleep_while(uint32_t seen, std::chrono::steady_clock::time_point deadline);
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");

// How long a waiter on `device` spins before sleeping, unless told (spin_us >= 0): a GPU process
// has cores to spare and its peer answers within tens of microseconds, while a futex wake-up can
// cost as much again; on a CPU, spinning takes the cores the computation needs.
constexpr int kSpinUsOnGpu = 1000;
constexpr int kSpinUsOnCpu = 50;
inline int default_spin_us(bool gpu) { return gpu ? kSpinUsOnGpu : kSpinUsOnCpu; }

// Waits until ready() holds: spins for `spin`, then sleeps on `wait` between checks. Returns false
// if `deadline` passed first.
template <typename Ready>
bool wait_until(WaitWord& wait, Ready&& ready, std::chrono::nanoseconds spin,
                std::chrono::steady_clock::time_point deadline) {
  using Clock = std::chrono::steady_clock;
  const auto spin_until = Clock::now() + spin;
  for (uint32_t i = 0;; ++i) {
    if (ready()) return true;
    if ((i & 63) == 0 && Clock::now() >= spin_until) break;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  while (true) {
    const uint32_t seen = wait.current();
    if (ready()) return true;
    if (Clock::now() >= deadline) return false;
    wait.sleep_while(seen, deadline);
  }
}

// This host, as two processes on it agree: hostname and boot id. Equal ids mean shared memory
// can be used between them.
std::string host_id();

}  // namespace symbiosis::shm
