#pragma once
// The executor's front door: its ROUTER socket and the thread that owns it. It frames and parses
// every ZeroMQ message, runs the handshake (Hello: protocol, model hash, [Transport choice], the
// client's channel from its transport's plugin; Welcome: the layer table), keeps the
// ClientRegistry and its liveness checks, answers statistics requests, and posts everything else
// to the scheduler's inbox. It also forwards to the clients what the scheduler and the channels
// answer over ZeroMQ (their PUSH sockets to its replies endpoint).
// Thread safety: construct, then run() on one thread; stop() from any thread.
#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "base_executor/base_model.h"
#include "base_executor/client_registry.h"
#include "base_executor/executor.h"
#include "base_executor/scheduler.h"
#include "base_executor/statistics.h"
#include "symbiosis.pb.h"

namespace symbiosis {

class FrontDoor {
 public:
  // Binds options.listen and replies_endpoint; throws naming the endpoint when it cannot.
  FrontDoor(const ExecutorOptions& options, const BaseModel& model, proto::Placement placement, Scheduler& scheduler,
            Statistics& statistics, zmq::context_t& context, const std::string& replies_endpoint);
  const std::string& endpoint() const { return endpoint_; }
  // The loop; returns once stop() was called.
  void run();
  void stop() { stopping_ = true; }
  // After run() has returned: lets go of every client (their channels' pending NCCL work).
  void abort_clients();

 private:
  void handle(std::vector<zmq::message_t>& frames);
  void handle_hello(const proto::Hello& hello, const std::string& key);
  void handle_request(const proto::Request& request, ClientRecord* client, std::vector<zmq::message_t>& frames,
                      const std::string& key);
  // Answers the peer `key` with an error, as the reply to request `request_id` or on its own.
  void refuse(const std::string& key, uint64_t request_id, const Status& status, bool as_reply);
  void forget(const std::string& key);
  void check_liveness();

  const ExecutorOptions& options_;
  const BaseModel& model_;
  const proto::Placement placement_;  // where this executor runs
  Scheduler& scheduler_;
  Statistics& statistics_;
  zmq::context_t& context_;
  const std::string replies_endpoint_;
  zmq::socket_t router_;
  zmq::socket_t replies_in_;
  std::string endpoint_;
  std::atomic<bool> stopping_{false};

  // Owned by the front door's thread.
  ClientRegistry registry_;
  // [NCCL readiness] (transport/nccl/nccl_channel.cpp): how many nccl channels serve each GPU, by UUID.
  std::map<std::string, std::shared_ptr<std::atomic<int>>> gpu_clients_;
};

}  // namespace symbiosis
