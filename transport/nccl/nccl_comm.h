#pragma once
// A 2-rank NCCL communicator between one client (rank 0) and the executor (rank 1), RAII with
// copying deleted. [NCCL blocking mode] A communicator of NCCL's non-blocking mode
// (config.blocking = 0) runs every send and receive through a thread NCCL starts for it, which
// cost ~80 µs per operation (a call's round trip took ~350 µs). So the communicator is a blocking
// one, and what could block on a peer that died is kept off the caller's thread: joining and
// [NCCL connection] run on a thread of the communicator's own, which the caller polls with
// ready(); after that a send or receive only enqueues (the peers are connected), and a kernel
// waiting on a dead peer ends when abort() (callable from any thread) tears the communicator down.
// Every NCCL call goes through one checking macro that names file, line, call and NCCL's own
// error string.
//
// Built only with NCCL (SYMBIOSIS_WITH_NCCL); nccl_available() says whether this build has it.
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

namespace symbiosis::nccl {

bool nccl_available();

#ifdef SYMBIOSIS_WITH_NCCL

// ncclUniqueId's bytes, made by rank 0 and sent to rank 1 over the control socket.
std::string new_unique_id();

class Communicator {
 public:
  // Starts joining as `rank` on cuda:`device`, then connecting to `peer`, on a thread of its own;
  // ready() says when both are done. Throws naming NCCL's error.
  Communicator(const std::string& unique_id, int rank, int device, int peer, std::chrono::milliseconds connect_timeout);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // True once joined and connected; throws if either failed. Never blocks.
  bool ready();
  // Blocks until ready; throws (after aborting) when `timeout` passes first.
  void wait_ready(std::chrono::milliseconds timeout);
  // Enqueue on `stream` (a cudaStream_t); the tensor must be contiguous on this communicator's GPU.
  void send(const at::Tensor& t, int peer, void* stream);
  void recv(const at::Tensor& t, int peer, void* stream);
  // True when NCCL reports an error of the connection (a network peer that died). Any thread.
  bool failed() const;
  // Tears the communicator down; pending kernels end. Any thread; idempotent.
  void abort();
  bool aborted() const;

  struct Joining;  // what the joining thread shares with the communicator

 private:
  void enqueue(bool send, const at::Tensor& t, int peer, void* stream);
  std::shared_ptr<Joining> joining_;
  mutable std::mutex mutex_;  // guards comm_ against abort() from another thread
  void* comm_ = nullptr;      // ncclComm_t, set by ready() once the joining thread is done
  bool aborted_ = false;
};

#endif  // SYMBIOSIS_WITH_NCCL

}  // namespace symbiosis::nccl
