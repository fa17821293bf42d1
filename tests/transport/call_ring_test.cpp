// The shared-memory control channel's pieces: segments (sealed, and guarded against faults), the
// call ring (including a producer that corrupts it), wake sockets, and a consumer in another process
// that sleeps and is woken.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include <chrono>
#include <filesystem>
#include <memory>
#include <new>
#include <thread>

#include <c10/util/Exception.h>

#include "transport/call_ring.h"

namespace symbiosis::shm {
namespace {

using Clock = std::chrono::steady_clock;

CallRecord record(uint64_t id) {
  CallRecord r;
  r.header.request_id = id;
  r.header.layer_id = static_cast<uint32_t>(id % 7);
  r.header.tokens = static_cast<int64_t>(id * 3);
  return r;
}

struct RingInSharedMemory {
  SharedMemory memory = SharedMemory::create("test", sizeof(ControlBlock));
  ControlBlock* block = new (memory.data()) ControlBlock();
};

TEST(SharedMemoryTest, AHandedOverDescriptorSeesWhatCreateWroteAndNothingHasAName) {
  auto created = SharedMemory::create("test", 4096);
  static_cast<char*>(created.data())[100] = 42;
  // What a peer does with a descriptor it received: maps it.
  auto mapped = SharedMemory::map_descriptor(UniqueFd(::dup(created.descriptor())), 4096, "test");
  EXPECT_EQ(static_cast<char*>(mapped.data())[100], 42);
  static_cast<char*>(mapped.data())[200] = 7;
  EXPECT_EQ(static_cast<char*>(created.data())[200], 7);
  try {
    SharedMemory::map_descriptor(UniqueFd(::dup(created.descriptor())), 1 << 20, "test");
    FAIL() << "a segment smaller than asked was mapped";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the test segment has 4096 bytes, expected at least 1048576"),
              std::string::npos)
        << e.what();
  }
  // [Proven placement]: the segment is anonymous memory, not a file in /dev/shm that another
  // process could open by name.
  const auto target = std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(created.descriptor()));
  EXPECT_EQ(target.string().rfind("/memfd:symbiosis-test", 0), 0u) << target;
}

// A segment handed over as the control segment that is not one (another process's memory, a stale
// layout) is refused as a c10::Error naming its magic number and the expected one.
TEST(SharedMemoryTest, ASegmentThatIsNotAControlSegmentIsRefusedNamingItsMagicNumber) {
  auto memory = SharedMemory::create("control", sizeof(ControlBlock));
  try {
    map_block<ControlBlock>(memory);
    FAIL() << "a zeroed segment was taken for a control segment";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the segment the executor handed over is not a symbiosis control segment (its "
                                         "magic number is 0x0000000000000000, expected 0x53594d42494f5331)"),
              std::string::npos)
        << e.what();
  }
  RingInSharedMemory shared;
  shared.block->magic = ControlBlock::kMagic;  // as the executor's channel writes it
  EXPECT_EQ(map_block<ControlBlock>(shared.memory), shared.block);
}

// [Sealed segments]: the peer that shares a segment cannot shrink it (the executor would die of
// SIGBUS at its next touch), and one that comes without the seal is refused, naming the seal.
TEST(SharedMemoryTest, SegmentsAreSealedAgainstShrinkingAndAnUnsealedOneIsRefusedNamingTheSeal) {
  auto created = SharedMemory::create("test", 4096);
  EXPECT_NE(::ftruncate(created.descriptor(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(created.descriptor(), 1 << 20), 0) << "the segment grew";
  const int seals = ::fcntl(created.descriptor(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  for (const unsigned flags : {0u, static_cast<unsigned>(MFD_ALLOW_SEALING)}) {  // unsealable, and not sealed
    UniqueFd unsealed(::memfd_create("unsealed", MFD_CLOEXEC | flags));
    ASSERT_TRUE(unsealed);
    ASSERT_EQ(::ftruncate(unsealed.get(), 4096), 0);
    try {
      SharedMemory::map_descriptor(std::move(unsealed), 4096, "payload");
      FAIL() << "a segment its peer could shrink was mapped";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("the payload segment handed over is not sealed against shrinking"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("F_SEAL_SHRINK"), std::string::npos) << e.what();
    }
  }
}

// [Fault guard]: memory that a peer shrank anyway (here, a mapping of an unsealed memfd, which the
// executor never makes) faults; the touch reads zeros instead of killing the process, on any
// thread, and the guard says so. A fault outside every guarded mapping is not swallowed.
TEST(SharedMemoryTest, ATouchOfShrunkMemoryReadsZerosAndIsReportedInsteadOfKillingTheProcess) {
  constexpr size_t kBytes = 3 * 4096;
  UniqueFd fd(::memfd_create("shrinkable", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(fd.get(), kBytes), 0);
  auto* data = static_cast<volatile char*>(::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
  ASSERT_NE(data, MAP_FAILED);
  data[5000] = 9;
  {
    FaultGuard guard(const_cast<char*>(data), kBytes);
    EXPECT_FALSE(guard.faulted());
    ASSERT_EQ(::ftruncate(fd.get(), 0), 0);  // what a hostile peer did to an unsealed segment
    char seen = 1;
    std::thread([&] { seen = data[5000]; }).join();  // not the thread that made the guard
    EXPECT_EQ(seen, 0);
    EXPECT_TRUE(guard.faulted());
    data[100] = 3;  // writable zeros: whoever writes a result there goes on
    EXPECT_EQ(data[100], 3);
  }
  ::munmap(const_cast<char*>(data), kBytes);
  // Unguarded, the same touch still kills (in a child, where it may).
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    UniqueFd other(::memfd_create("unguarded", MFD_CLOEXEC));
    if (::ftruncate(other.get(), 4096) != 0) ::_exit(2);
    auto* page = static_cast<volatile char*>(::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, other.get(), 0));
    if (::ftruncate(other.get(), 0) != 0) ::_exit(2);
    ::_exit(page[10] + 3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) << "status " << status;
}

// [Wake sockets]: a writer wakes a reader that polls only when told the reader sleeps; a writer
// that writes without end fills its socket and never blocks; one whose executor is gone gets no
// SIGPIPE.
TEST(WakeSocketTest, AClientWakesOnlyASleepingExecutorAndAFloodNeverBlocks) {
  RingInSharedMemory shared;
  auto socket = std::make_unique<WakeSocket>();
  UniqueFd writer = socket->take_writer();
  EXPECT_FALSE(socket->take_writer());
  pollfd reader{socket->reader(), POLLIN, 0};
  wake_executor(*shared.block, writer.get());
  EXPECT_EQ(::poll(&reader, 1, 0), 0) << "woke an executor that does not sleep";
  shared.block->executor_sleeping.store(1);
  wake_executor(*shared.block, writer.get());
  EXPECT_EQ(::poll(&reader, 1, 0), 1);
  drain(socket->reader());
  EXPECT_EQ(::poll(&reader, 1, 0), 0) << "a drained pipe still wakes";
  for (int i = 0; i < 200000; ++i) wake(writer.get());  // past the socket's capacity: returns at once
  EXPECT_EQ(::poll(&reader, 1, 0), 1);
  drain(socket->reader());
  socket.reset();  // the executor's end gone: a wake neither blocks nor kills this process
  wake(writer.get());
}

TEST(CallRingTest, DeliversInOrderAndRefusesWhenFull) {
  RingInSharedMemory shared;
  auto& ring = shared.block->requests;
  EXPECT_TRUE(ring.empty());
  for (uint64_t i = 0; i < CallRing::kCapacity; ++i) EXPECT_TRUE(ring.push(record(i)));
  EXPECT_FALSE(ring.push(record(99))) << "a full ring took another record";
  for (uint64_t i = 0; i < CallRing::kCapacity; ++i) {
    auto r = ring.pop();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->header.request_id, i);
    EXPECT_EQ(r->header.tokens, static_cast<int64_t>(i * 3));
  }
  EXPECT_FALSE(ring.pop().has_value());
  EXPECT_TRUE(ring.push(record(100)));  // wraps around
  EXPECT_EQ(ring.pop()->header.request_id, 100u);
}

TEST(CallRingTest, UntrustedReaderDetectsAHeadThatClaimsTooMuch) {
  RingInSharedMemory shared;
  auto& ring = shared.block->requests;
  uint64_t next_read = 0;
  bool corrupt = false;
  ASSERT_TRUE(ring.push(record(1)));
  EXPECT_EQ(ring.pop_untrusted(&next_read, &corrupt)->header.request_id, 1u);
  EXPECT_FALSE(corrupt);
  // A misbehaving client scribbles over the head: more records than the ring can hold.
  reinterpret_cast<std::atomic<uint64_t>*>(&ring)->store(next_read + CallRing::kCapacity + 5);
  EXPECT_FALSE(ring.pop_untrusted(&next_read, &corrupt).has_value());
  EXPECT_TRUE(corrupt);
  // ... or moves it backwards.
  corrupt = false;
  reinterpret_cast<std::atomic<uint64_t>*>(&ring)->store(0);
  EXPECT_FALSE(ring.pop_untrusted(&next_read, &corrupt).has_value());
  EXPECT_TRUE(corrupt);
}

TEST(CallRingTest, ErrorMessagesAreTruncatedAndTerminated) {
  CallRecord r;
  r.set_message(std::string(2 * CallRecord::kMessageBytes, 'x'));
  EXPECT_EQ(r.message_text().size(), CallRecord::kMessageBytes - 1);
  r.set_message("layer 3: shape [2, 5] should be [tokens >= 1, 4]");
  EXPECT_EQ(r.message_text(), "layer 3: shape [2, 5] should be [tokens >= 1, 4]");
}

// [Spin, then sleep]: a consumer in another process that has stopped spinning and sleeps on the
// futex is woken by the producer's notify, well before its deadline.
TEST(CallRingTest, WakesASleepingConsumerInAnotherProcess) {
  RingInSharedMemory shared;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto& ring = shared.block->replies;
    const auto started = Clock::now();
    const bool got = wait_until(
        ring.wait(), [&] { return !ring.empty(); }, std::chrono::microseconds(10), started + std::chrono::seconds(20));
    const auto waited = Clock::now() - started;
    _exit(got && ring.pop()->header.request_id == 7 && waited < std::chrono::seconds(5) ? 0 : 1);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the child is asleep by now
  ASSERT_TRUE(shared.block->replies.push(record(7)));
  shared.block->replies.wait().notify();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the consumer was not woken with the record";
}

TEST(CallRingTest, WaitGivesUpAtTheDeadline) {
  RingInSharedMemory shared;
  auto& ring = shared.block->replies;
  const auto started = Clock::now();
  EXPECT_FALSE(wait_until(
      ring.wait(), [&] { return !ring.empty(); }, std::chrono::microseconds(10),
      started + std::chrono::milliseconds(150)));
  EXPECT_GE(Clock::now() - started, std::chrono::milliseconds(150));
}

}  // namespace
}  // namespace symbiosis::shm
