#pragma once
// A 2-rank NCCL communicator between one client (rank 0) and the executor (rank 1), RAII with
// copying deleted. Non-blocking (NCCL's config.blocking = 0), so that no call can hang forever on
// a peer that died: init and every operation are polled with a deadline, and abort() (callable
// from any thread) tears the communicator down and releases the GPU kernels waiting on it.
// Every NCCL call goes through one checking macro that names file, line, call and NCCL's own
// error string.
//
// Built only with NCCL (SYMBIOSIS_WITH_NCCL); nccl_available() says whether this build has it.
#include <ATen/ATen.h>

#include <chrono>
#include <mutex>
#include <string>

namespace symbiosis::nccl {

bool nccl_available();

#ifdef SYMBIOSIS_WITH_NCCL

// ncclUniqueId's bytes, made by rank 0 and sent to rank 1 over the control socket.
std::string new_unique_id();

class Communicator {
 public:
  // Starts joining; ready() says when both ranks have joined. Throws naming NCCL's error.
  Communicator(const std::string& unique_id, int rank, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // True once joined; throws if joining failed. Never blocks.
  bool ready();
  // Blocks until joined; throws (after aborting) when `timeout` passes first.
  void wait_ready(std::chrono::milliseconds timeout);
  // Enqueue on `stream` (a cudaStream_t); the tensor must be contiguous on this communicator's GPU.
  void send(const at::Tensor& t, int peer, void* stream);
  void recv(const at::Tensor& t, int peer, void* stream);
  // [NCCL connection] NCCL connects two ranks at their first send and receive, and that first
  // operation does not finish enqueueing until the peer takes part. A call's send must enqueue
  // before its header is pushed, so both ranks exchange one element here, right after joining,
  // and wait for it; from then on sends and receives enqueue without waiting for the peer.
  // Aborts and throws when the peer does not take part within `timeout`.
  void connect(int peer, std::chrono::milliseconds timeout);
  // Tears the communicator down; pending kernels end. Any thread; idempotent.
  void abort();
  bool aborted() const;

 private:
  static constexpr std::chrono::milliseconds kEnqueueTimeout{10000};
  void enqueue(bool send, const at::Tensor& t, int peer, void* stream);
  bool finish_enqueue(const char* what, std::chrono::steady_clock::time_point deadline);
  mutable std::mutex mutex_;  // guards comm_ against abort() from another thread
  void* comm_ = nullptr;      // ncclComm_t
  bool aborted_ = false;
  int device_;
};

#endif  // SYMBIOSIS_WITH_NCCL

}  // namespace symbiosis::nccl
