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
#include <random>

namespace symbiosis::shm {
namespace {

std::string error_text() { return std::strerror(errno); }

std::string fresh_name(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  std::random_device random;
  return "/" + prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(random());
}

void* map(int fd, size_t bytes, const std::string& name) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(data != MAP_FAILED, "cannot map shared memory ", name, " (", bytes, " bytes): ", error_text());
  return data;
}

}  // namespace

void SharedMemory::Unmap::operator()(void* data) const { ::munmap(data, size); }
void SharedMemory::Unlink::operator()(const std::string& name) const { ::shm_unlink(name.c_str()); }

SharedMemory SharedMemory::create(const std::string& prefix, size_t bytes) {
  TORCH_CHECK(bytes > 0, "shared memory segment needs a positive size");
  SharedMemory shm;
  shm.name_ = fresh_name(prefix);
  const int fd = ::shm_open(shm.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "cannot create shared memory ", shm.name_, ": ", error_text(),
              " (is /dev/shm mounted and writable?)");
  shm.link_ = UniqueHandle<std::string, Unlink>(shm.name_);  // unlinked again if what follows fails
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string why = error_text();
    ::close(fd);
    TORCH_CHECK(false, "cannot size shared memory ", shm.name_, " to ", bytes, " bytes: ", why);
  }
  try {
    shm.mapping_ = UniqueHandle<void*, Unmap>(map(fd, bytes, shm.name_), Unmap{bytes});
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return shm;
}

SharedMemory SharedMemory::open(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "cannot open shared memory ", name, ": ", error_text(),
              " (client and executor must share a host and /dev/shm)");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    ::close(fd);
    TORCH_CHECK(false, "shared memory ", name, " has ", st.st_size, " bytes, expected at least ", bytes);
  }
  SharedMemory shm;
  shm.name_ = name;
  try {
    shm.mapping_ = UniqueHandle<void*, Unmap>(map(fd, bytes, name), Unmap{bytes});
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
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
