#include "transport/call_ring.h"

#include <c10/util/Exception.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace symbiosis::shm {

void CallRecord::set_message(const std::string& text) {
  const size_t n = std::min(text.size(), kMessageBytes - 1);
  std::memcpy(message, text.data(), n);
  message[n] = '\0';
}

std::string CallRecord::message_text() const { return std::string(message, strnlen(message, kMessageBytes)); }

bool CallRing::push(const CallRecord& record) {
  const uint64_t head = head_.load(std::memory_order_relaxed);
  if (head - tail_.load(std::memory_order_acquire) >= kCapacity) return false;
  slots_[head % kCapacity] = record;
  head_.store(head + 1, std::memory_order_release);
  return true;
}

std::optional<CallRecord> CallRing::pop() {
  const uint64_t tail = tail_.load(std::memory_order_relaxed);
  if (head_.load(std::memory_order_acquire) == tail) return std::nullopt;
  CallRecord record = slots_[tail % kCapacity];
  tail_.store(tail + 1, std::memory_order_release);
  return record;
}

std::optional<CallRecord> CallRing::pop_untrusted(uint64_t* next_read, bool* corrupt) {
  const uint64_t head = head_.load(std::memory_order_acquire);
  if (head == *next_read) return std::nullopt;
  if (head - *next_read > kCapacity) {  // also catches a head behind next_read (wraps to huge)
    *corrupt = true;
    return std::nullopt;
  }
  CallRecord record = slots_[*next_read % kCapacity];
  record.message[CallRecord::kMessageBytes - 1] = '\0';
  ++*next_read;
  tail_.store(*next_read, std::memory_order_release);
  return record;
}

WakeSocket::WakeSocket() {
  int ends[2];
  TORCH_CHECK(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, ends) == 0,
              "cannot make a wake socket: ", std::strerror(errno));
  reader_ = UniqueFd(ends[0]);
  writer_ = UniqueFd(ends[1]);
}

void check_segment_magic(uint64_t magic, uint64_t expected) {
  if (magic == expected) return;
  char numbers[64];
  std::snprintf(numbers, sizeof numbers, "0x%016" PRIx64 ", expected 0x%016" PRIx64, magic, expected);
  TORCH_CHECK(false, "the segment the executor handed over is not a symbiosis control segment (its magic number is ",
              numbers, ")");
}

void drain(int reader) {
  char bytes[64];
  for (int i = 0; i < 1024 && ::recv(reader, bytes, sizeof bytes, MSG_DONTWAIT) >= 0; ++i) {
  }
}

void wake(int writer) {
  const char byte = 1;
  [[maybe_unused]] const auto sent = ::send(writer, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

void wake_executor(const ControlBlock& block, int writer) {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // [Wake sockets]: the push before the look
  if (block.executor_sleeping.load(std::memory_order_seq_cst) != 0) wake(writer);
}

}  // namespace symbiosis::shm
