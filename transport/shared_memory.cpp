#include "transport/shared_memory.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>

namespace symbiosis::shm {
namespace {

std::string error_text() { return std::strerror(errno); }

void* map(int fd, size_t bytes, const std::string& purpose) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(data != MAP_FAILED, "cannot map the ", purpose, " segment (", bytes, " bytes): ", error_text());
  return data;
}

}  // namespace

void SharedMemory::Unmap::operator()(void* data) const { ::munmap(data, size); }

SharedMemory SharedMemory::create(const std::string& purpose, size_t bytes) {
  TORCH_CHECK(bytes > 0, "a shared memory segment needs a positive size");
  UniqueFd fd(::memfd_create(("symbiosis-" + purpose).c_str(), MFD_CLOEXEC));
  TORCH_CHECK(fd, "cannot create the ", purpose, " segment: ", error_text());
  TORCH_CHECK(::ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0, "cannot size the ", purpose, " segment to ",
              bytes, " bytes: ", error_text());
  return map_descriptor(std::move(fd), bytes, purpose);
}

SharedMemory SharedMemory::map_descriptor(UniqueFd descriptor, size_t bytes, const std::string& purpose) {
  TORCH_CHECK(descriptor, "no descriptor came for the ", purpose, " segment");
  struct stat st {};
  TORCH_CHECK(::fstat(descriptor.get(), &st) == 0, "cannot inspect the ", purpose, " segment: ", error_text());
  TORCH_CHECK(S_ISREG(st.st_mode), "the descriptor handed over for the ", purpose, " segment is not shared memory");
  TORCH_CHECK(static_cast<size_t>(st.st_size) >= bytes, "the ", purpose, " segment has ", st.st_size,
              " bytes, expected at least ", bytes);
  SharedMemory shm;
  shm.mapping_ = UniqueHandle<void*, Unmap>(map(descriptor.get(), bytes, purpose), Unmap{bytes});
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
