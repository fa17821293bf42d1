#pragma once
// [Teardown off the front door]
// Letting go of a client that left can wait for the GPU: aborting its NCCL communicator frees its
// memory, giving back a pinned payload buffer (cudaHostUnregister) waits for the device, and a
// cuda-ipc channel waits for the work on every stream its calls went on, where other clients'
// later work may wait on theirs. While the GPU is stalled (an NCCL tenant withholding a transfer, up
// to the [NCCL transfer watchdog]'s limit; a cuda-ipc tenant's run launched ahead, up to its
// watchdog's), the front door must still answer handshakes and calls, and the scheduler must still
// take up the calls the GPU waits for. So each hands the channels it lets go of to a thread like
// this one, which aborts each and drops that reference: the front door a forgotten client's, the
// scheduler a client's that left or that it dropped. The channel ends on whichever thread lets go
// last, neither the front door's nor the scheduler's. A teardown that took 100 ms or more is logged.
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "transport/channel.h"

namespace symbiosis {

class Teardown {
 public:
  Teardown();
  ~Teardown();  // tears down what is still handed over, then ends the thread
  Teardown(const Teardown&) = delete;
  Teardown& operator=(const Teardown&) = delete;
  void hand_over(std::shared_ptr<Channel> channel);

 private:
  void run();
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Channel>> channels_;  // guarded by mutex_
  bool stopping_ = false;                          // guarded by mutex_
  std::thread thread_;
};

}  // namespace symbiosis
