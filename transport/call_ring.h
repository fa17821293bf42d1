#pragma once
// [Shared-memory control channel]
// When a client shares a host with the executor, per-call headers do not travel over ZeroMQ (a
// round trip there costs ~60 us before any work) but through a control segment in shared memory:
// two single-producer single-consumer rings of fixed-size CallRecords, requests (client to
// executor) and replies (executor to client). A CallRecord is the fixed binary form of
// proto::Request and proto::Reply. Payloads never travel in the ring: they sit in the client's
// registered payload buffer (host shared memory, a CUDA IPC device buffer) at the offsets the
// record names, or move over NCCL.
//
// Waking: a client pushes a request and wakes the executor through its own wake socket, if the
// executor sleeps ([Wake sockets]); the executor pushes a reply and notifies the ring's own
// WaitWord, on which the client sleeps. Both spin briefly first ([Spin, then sleep]).
//
// [Wake sockets]
// Nothing a client can write is read by the executor for another client: each same-host client
// wakes the executor's scheduler through a socket pair of its own (Unix datagrams), whose one end
// the executor hands it with its control segment and whose other end the executor keeps. When the
// scheduler has spun without work, it sets executor_sleeping in every client's control block,
// looks at every ring once more, and sleeps in poll() on every socket (and its own inbox's); a
// client pushes its request, then sends one byte if it sees executor_sleeping set. Both sides
// fence between their store and their load (the Dekker pattern), so a request is either seen by
// the scheduler's last look or wakes it. A client that lies about the flag, or never sends, only
// delays its own calls; one that sends without end only wakes the scheduler, as calls would, and
// its socket's buffer fills (its sends then fail, with no effect on anyone else); one that closes
// its end is no longer polled (its calls are then found by the scheduler's spin alone). A socket,
// not a pipe: a send to an executor that died fails instead of raising SIGPIPE in the client
// (MSG_NOSIGNAL), and the ends are separate files, so no flag the client sets on its end changes
// the executor's. The shared doorbell this replaces was one futex word every client could write,
// so one client could make the executor sleep through the others' calls.
//
// [Stream-ordered hand-off]
// A cuda-ipc client with this channel orders a call's two hand-offs on the GPU instead of through
// the reply ring, so that neither process's host waits for the other's GPU:
//  - the client's stream writes the call's sequence number into inputs_ready (a 32-bit stream
//    memory write, fenced after the work that wrote the input: the model's own, or a copy into the
//    payload buffer); the client's host pushes the header (its sequence set) and goes on at once;
//  - the executor takes the call up when its host sees inputs_ready reach the sequence, and its
//    stream writes the sequence into results_ready after the result;
//  - the client's stream waits until results_ready reaches the sequence before it reads the result
//    (in its buffer, or in a tensor of its own: [Direct operands] in
//    transport/cuda_ipc/cuda_ipc_client.cpp).
// Both words live in this segment, which each process pins and maps for its GPU. A client's calls
// complete in order, so the words only grow (compared modulo 2^32; sequence 0 is never used).
// Only errors come back as replies; the client reports them at its next call or when it settles
// (Client::settle), and the executor writes results_ready for a refused call too, so the
// client's stream never waits for a result that will not come.
//
// [Captured calls]
// A client that captures its step in a CUDA graph (client_runtime/training/step_graph.h) cannot number a
// call when its GPU reaches it: a graph's stream memory operations write and wait for the values
// they were captured with, the same at every replay. So a captured call has a slot of its own, the
// same at every replay: a pair of flags in this segment, each set by its producer and cleared by
// its consumer, so that a replay finds them as the capture left them:
//  - the client's graph sets the slot's input_ready once the input is written; the executor takes
//    the call up when its host sees it set, and clears it;
//  - the executor's stream sets the slot's result_ready after the result (and writes the call's
//    sequence into results_ready, as for any numbered call); the client's graph waits until it is
//    set, then clears it.
// The headers are recorded at capture; at each replay the client's host pushes them again, each
// with a new request id and sequence, once the replay is launched. A client's calls still complete
// in order, so no slot is set twice before its consumer has cleared it. Under MPS the flags' GPU
// halves are words in the client's GPU memory, set and waited on by one-thread kernels ([Device
// words] in transport/cuda_ipc/device_words.h); the input flag here stays, for the executor's host.
//
// Trust: the executor never trusts what a client wrote. It keeps its own read position (a
// corrupted head is detected as a ring that claims more than its capacity) and validates every
// record like a ZeroMQ request.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "common/unique_fd.h"
#include "transport/shared_memory.h"

namespace symbiosis::shm {

// One call as the executor sees it, whatever transport it came by.
struct CallHeader {
  uint64_t request_id = 0;
  uint32_t layer_id = 0;
  int32_t op = 0;             // proto::Op
  int32_t dtype = 0;          // proto::DType
  int32_t latency_class = 0;  // proto::LatencyClass
  int64_t tokens = 0;
  int64_t features = 0;
  uint64_t in_offset = 0;          // byte offset of the input in the payload buffer or in_segment
  uint64_t out_offset = 0;         // byte offset where the result goes, in the buffer or out_segment
  uint64_t buffer_generation = 0;  // which registration of the payload buffer the offsets refer to
  uint32_t sequence = 0;           // [Stream-ordered hand-off]: the call's number; 0 for a call answered by reply
  // [Direct operands]: the shared segment each offset refers to; 0 is the payload buffer.
  uint32_t in_segment = 0;
  uint32_t out_segment = 0;
  uint32_t slot = 0;  // [Captured calls]: the call's slot, 1 to kCallSlots; 0 for a call not captured
};

struct CallRecord {
  static constexpr size_t kMessageBytes = 384;
  CallHeader header;
  int32_t error_code = 0;  // replies: proto::ErrorCode; OK means the result is at out_offset
  char message[kMessageBytes] = {};

  void set_message(const std::string& text);
  std::string message_text() const;
};

class CallRing {
 public:
  // A client's calls complete in order, but one that orders them on the GPU pushes headers ahead
  // of its GPU ([Stream-ordered hand-off]); the executor empties the ring at every turn of its loop.
  // A replay of a captured step pushes all its headers at once ([Captured calls]): a Llama-3.2-1B
  // training step makes 221 calls.
  static constexpr uint64_t kCapacity = 256;

  // Producer side. False when the ring is full (the consumer is stuck or gone).
  bool push(const CallRecord& record);
  // Consumer side, trusting the producer (a client reading the executor's replies).
  std::optional<CallRecord> pop();
  bool empty() const { return head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_acquire); }
  // Consumer side, not trusting the producer: whether the producer claims records past next_read.
  bool has_after(uint64_t next_read) const { return head_.load(std::memory_order_acquire) != next_read; }
  // Consumer side, not trusting the producer: `next_read` is the consumer's private position.
  // Returns nullopt when empty; sets *corrupt when the shared head is impossible.
  std::optional<CallRecord> pop_untrusted(uint64_t* next_read, bool* corrupt);

  WaitWord& wait() { return wait_; }

 private:
  alignas(64) std::atomic<uint64_t> head_{0};  // next slot the producer writes
  alignas(64) std::atomic<uint64_t> tail_{0};  // next slot the consumer reads
  alignas(64) WaitWord wait_;                  // the consumer sleeps here
  alignas(64) CallRecord slots_[kCapacity];
};

// [Captured calls]: one call position of a captured step.
struct CallSlot {
  std::atomic<uint32_t> input_ready{0};   // set (1) by the client's GPU, cleared by the executor's host
  std::atomic<uint32_t> result_ready{0};  // set (1) by the executor's GPU, cleared by the client's GPU
};
constexpr uint32_t kCallSlots = 4096;  // calls a captured step may make

// The per-client control segment. Created (zero-filled) by the executor, mapped by the client.
struct ControlBlock {
  static constexpr uint64_t kMagic = 0x53594d42494f5331ull;  // "SYMBIOS1"
  uint64_t magic = 0;
  CallRing requests;  // client -> executor
  CallRing replies;   // executor -> client
  // [Stream-ordered hand-off]: written by the GPUs, read by the executor's host and the client's GPU.
  alignas(64) std::atomic<uint32_t> inputs_ready{0};
  alignas(64) std::atomic<uint32_t> results_ready{0};
  // [Wake sockets]: set by the executor while its scheduler sleeps; read by the client.
  alignas(64) std::atomic<uint32_t> executor_sleeping{0};
  // [Voided runs] (transport/cuda_ipc/cuda_ipc_channel.cpp): set by the executor's host before it
  // lets a run launched ahead go without its client's inputs; read by the client's host.
  alignas(64) std::atomic<uint32_t> runs_voided{0};
  alignas(64) CallSlot slots[kCallSlots + 1];  // [Captured calls]: slot 0 is never used
  // [Device words] (transport/cuda_ipc/device_words.h): a cuda-ipc client's words in its own GPU
  // memory for its captured calls' flags, offered (1) once their CUDA IPC handle is written here;
  // written by the client before its first call, read by the executor's host.
  alignas(64) std::atomic<uint32_t> device_words_offered{0};
  char device_words_handle[64] = {};  // cudaIpcMemHandle_t's bytes
};

// Whether a word that counts calls modulo 2^32 has reached `sequence`.
inline bool reached(uint32_t word, uint32_t sequence) { return static_cast<int32_t>(word - sequence) >= 0; }

// [Wake sockets]: a connected pair of Unix datagram sockets, both non-blocking and close-on-exec.
class WakeSocket {
 public:
  WakeSocket();
  int reader() const { return reader_.get(); }
  int writer() const { return writer_.get(); }
  // The writing end, to hand to a client (the executor keeps no copy once it is handed over).
  UniqueFd take_writer() { return std::move(writer_); }

 private:
  UniqueFd reader_, writer_;
};

// [Wake sockets]: the writer's side. wake() sends one byte and never blocks or raises a signal (a
// full socket already wakes its reader; a reader gone is the executor gone, which the client
// learns otherwise); wake_executor() does so after a request was pushed to `block`, if the
// executor sleeps.
void wake(int writer);
void wake_executor(const ControlBlock& block, int writer);
// The reader's side: reads what was sent (the end is non-blocking), so that poll() sleeps again.
void drain(int reader);

// Throws (TORCH_CHECK) naming the segment and its magic number unless it is `expected`.
void check_segment_magic(uint64_t magic, uint64_t expected);

// Maps a control segment made by the executor; throws naming it when it is not one.
template <typename Block>
Block* map_block(SharedMemory& memory) {
  auto* block = static_cast<Block*>(memory.data());
  check_segment_magic(block->magic, Block::kMagic);
  return block;
}

}  // namespace symbiosis::shm
