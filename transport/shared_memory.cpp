#include "transport/shared_memory.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <signal.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <mutex>

namespace symbiosis::shm {
namespace {

std::string error_text() { return std::strerror(errno); }

void* map(int fd, size_t bytes, const std::string& purpose) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(data != MAP_FAILED, "cannot map the ", purpose, " segment (", bytes, " bytes): ", error_text());
  return data;
}

// [Fault guard]: the table the SIGBUS handler reads. A slot is free, being filled or emptied
// (the handler skips it), or live.
enum SlotState : int { kFree = 0, kBusy = 1, kLive = 2 };
struct GuardedRange {
  std::atomic<int> state{kFree};
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "the SIGBUS handler reads the table lock-free");
GuardedRange guarded[FaultGuard::kMaxGuarded];
struct sigaction previous_sigbus {};

void restore_previous_and_return(int signal, siginfo_t* info, void* context) {
  if ((previous_sigbus.sa_flags & SA_SIGINFO) != 0 && previous_sigbus.sa_sigaction != nullptr) {
    return previous_sigbus.sa_sigaction(signal, info, context);
  }
  if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
    return previous_sigbus.sa_handler(signal);
  }
  // Returning re-runs the faulting instruction, which now dies as it would have without us.
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  ::sigaction(SIGBUS, &fallback, nullptr);
}

void on_sigbus(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (auto& range : guarded) {
    if (range.state.load() != kLive) continue;
    const uintptr_t begin = range.begin.load(), end = range.end.load();
    if (address < begin || address >= end) continue;
    // Zeros in place of the lost pages; the faulting instruction runs again on them.
    void* zeros = ::mmap(reinterpret_cast<void*>(begin), end - begin, PROT_READ | PROT_WRITE,
                         MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (zeros == MAP_FAILED) break;
    range.faulted.store(true);
    return;
  }
  restore_previous_and_return(signal, info, context);
}

void install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = &on_sigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    TORCH_CHECK(::sigaction(SIGBUS, &action, &previous_sigbus) == 0,
                "cannot install the SIGBUS handler: ", error_text());
  });
}

// [Sealed segments]
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

}  // namespace

FaultGuard::FaultGuard(void* data, size_t bytes) {
  install_sigbus_handler();
  static std::atomic<uint32_t> hint{0};
  const uint32_t start = hint.fetch_add(1);
  for (int i = 0; i < kMaxGuarded; ++i) {
    const int slot = static_cast<int>((start + i) % kMaxGuarded);
    int expected = kFree;
    if (!guarded[slot].state.compare_exchange_strong(expected, kBusy)) continue;
    guarded[slot].begin.store(reinterpret_cast<uintptr_t>(data));
    guarded[slot].end.store(reinterpret_cast<uintptr_t>(data) + bytes);
    guarded[slot].faulted.store(false);
    guarded[slot].state.store(kLive);
    slot_ = slot;
    return;
  }
  spdlog::warn("more than {} shared memory mappings: one of {} bytes is not guarded against faults", kMaxGuarded,
               bytes);
}

FaultGuard& FaultGuard::operator=(FaultGuard&& other) noexcept {
  if (this != &other) {
    release();
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

bool FaultGuard::faulted() const { return slot_ >= 0 && guarded[slot_].faulted.load(); }

void FaultGuard::release() {
  if (slot_ < 0) return;
  guarded[slot_].state.store(kBusy);
  guarded[slot_].begin.store(0);
  guarded[slot_].end.store(0);
  guarded[slot_].state.store(kFree);
  slot_ = -1;
}

void SharedMemory::Unmap::operator()(void* data) const { ::munmap(data, size); }

SharedMemory SharedMemory::create(const std::string& purpose, size_t bytes) {
  TORCH_CHECK(bytes > 0, "a shared memory segment needs a positive size");
  UniqueFd fd(::memfd_create(("symbiosis-" + purpose).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  TORCH_CHECK(fd, "cannot create the ", purpose, " segment: ", error_text());
  TORCH_CHECK(::ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0, "cannot size the ", purpose, " segment to ", bytes,
              " bytes: ", error_text());
  TORCH_CHECK(::fcntl(fd.get(), F_ADD_SEALS, kSeals) == 0, "cannot seal the ", purpose, " segment: ", error_text());
  return map_descriptor(std::move(fd), bytes, purpose);
}

SharedMemory SharedMemory::map_descriptor(UniqueFd descriptor, size_t bytes, const std::string& purpose) {
  TORCH_CHECK(descriptor, "no descriptor came for the ", purpose, " segment");
  struct stat st {};
  TORCH_CHECK(::fstat(descriptor.get(), &st) == 0, "cannot inspect the ", purpose, " segment: ", error_text());
  TORCH_CHECK(S_ISREG(st.st_mode), "the descriptor handed over for the ", purpose, " segment is not shared memory");
  const int seals = ::fcntl(descriptor.get(), F_GET_SEALS);
  TORCH_CHECK(seals >= 0 && (seals & F_SEAL_SHRINK) != 0, "the ", purpose,
              " segment handed over is not sealed against shrinking: create it with memfd_create(MFD_ALLOW_SEALING) "
              "and add F_SEAL_SHRINK (fcntl F_ADD_SEALS) before handing it over");
  TORCH_CHECK(static_cast<size_t>(st.st_size) >= bytes, "the ", purpose, " segment has ", st.st_size,
              " bytes, expected at least ", bytes);
  SharedMemory shm;
  shm.mapping_ = UniqueHandle<void*, Unmap>(map(descriptor.get(), bytes, purpose), Unmap{bytes});
  shm.guard_ = FaultGuard(shm.mapping_.get(), bytes);
  shm.descriptor_ = std::move(descriptor);
  return shm;
}

void WaitWord::notify() {
  word.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) > 0) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

void WaitWord::sleep_while(uint32_t seen, std::chrono::steady_clock::time_point deadline) {
  const auto left = deadline - std::chrono::steady_clock::now();
  if (left <= std::chrono::nanoseconds(0)) return;
  // Sleep in slices of at most 100 ms so a waiter also notices what no one notifies (a peer that died).
  const auto slice = std::min<std::chrono::nanoseconds>(left, std::chrono::milliseconds(100));
  timespec timeout{static_cast<time_t>(slice.count() / 1000000000), static_cast<long>(slice.count() % 1000000000)};
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (word.load(std::memory_order_seq_cst) == seen) {
    // Not FUTEX_PRIVATE: the word is shared between processes.
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &timeout, nullptr, 0);
  }
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

std::string host_id() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(host) + "/" + boot;
}

}  // namespace symbiosis::shm
