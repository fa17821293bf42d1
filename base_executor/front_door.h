#pragma once
// The executor's front door: its ROUTER socket, its local socket, and the thread that owns them. It
// admits peers by key ([Admission] in admission.h), frames and parses every ZeroMQ message, runs
// the handshake (Hello: protocol, model hash, [Transport choice], the proof of a same-host
// placement ([Proven placement] in transport/local_socket.h), the client's channel from its
// transport's plugin; Welcome: the layer table), keeps the ClientRegistry and its liveness checks,
// answers operators' statistics requests, and posts everything else to the scheduler's inbox. It
// also forwards to the clients what the scheduler and the channels answer over ZeroMQ (their PUSH
// sockets to its replies endpoint). What peers send is untrusted ([Untrusted input] in
// common/untrusted.h).
// Its parts: the loop and dispatch (front_door.cpp), the handshake (handshake.cpp), the local
// socket's proofs and links (local_links.cpp), connections and liveness (connections.cpp).
// Thread safety: construct, then run() on one thread; stop() from any thread.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "base_executor/admission.h"
#include "base_executor/base_model.h"
#include "base_executor/client_registry.h"
#include "base_executor/executor.h"
#include "base_executor/overload.h"
#include "base_executor/scheduler.h"
#include "base_executor/statistics.h"
#include "base_executor/teardown.h"
#include "common/untrusted.h"
#include "symbiosis.pb.h"
#include "transport/local_socket.h"

namespace symbiosis {

class FrontDoor {
 public:
  // Binds options.listen and replies_endpoint; throws naming the endpoint when it cannot.
  // buffers: [Buffer budget], which each same-host client's control segment takes from.
  FrontDoor(const ExecutorOptions& options, const BaseModel& model, proto::Placement placement, Scheduler& scheduler,
            Statistics& statistics, BufferBudget& buffers, zmq::context_t& context,
            const std::string& replies_endpoint);
  const std::string& endpoint() const { return endpoint_; }
  // The loop; returns once stop() was called.
  void run();
  void stop() { stopping_ = true; }
  // Any thread: what the [Shutdown notice] tells clients, when not "it was stopped".
  void set_goodbye(std::string reason) {
    std::lock_guard<std::mutex> lock(goodbye_mutex_);
    goodbye_ = std::move(reason);
  }
  // After run() has returned: lets go of every client (their channels' pending NCCL work).
  void abort_clients();

 private:
  using Clock = std::chrono::steady_clock;
  // How long a same-host client has to prove its placement after its Hello.
  static constexpr auto kProofWindow = std::chrono::seconds(10);
  // At most this many handshakes wait for their proof, and local connections for their first
  // message, so that nobody can make the executor hold state without end.
  static constexpr size_t kMaxPendingProofs = 256;
  // [Buffer budget]: what a client's control segment takes (every transport but tcp has one).
  static const uint64_t kControlSegmentBytes;
  void handle(std::vector<zmq::message_t>& frames);
  // [Admission]: with keys, names the tenant by its key (refusing another admitted key's name).
  void handle_hello(proto::Hello hello, const std::string& key, const std::string& public_key);
  // The handshake's end: the client's channel, its record and its Welcome. `link`: its proven
  // local link, for a same-host transport.
  void admit(const std::string& key, const proto::Hello& hello, TransportKind kind, UniqueFd link,
             const std::string& public_key);
  // [Proven placement]: a connection to the local socket, and what comes on it.
  void accept_local();
  void handle_proof(UniqueFd connection);
  void handle_link(int fd);
  void handle_request(const proto::Request& request, ClientRecord* client, std::vector<zmq::message_t>& frames,
                      const std::string& key);
  // Answers the peer `key` with an error, as the reply to request `request_id` or on its own.
  void refuse(const std::string& key, uint64_t request_id, const Status& status, bool as_reply);
  // A line about bad input, within the log budget.
  void note_bad_input(const std::string& line);
  void forget(const std::string& key);
  void check_liveness();
  // [Disconnected peers]: handles the ROUTER's connection events that have come.
  void read_connection_events();
  // [Shutdown notice]: once run()'s loop ends, a ShuttingDown to every registered client.
  void tell_clients_goodbye();
  // [Admission]: reads the keys folder again if it changed, and drops the clients whose key is no
  // longer admitted.
  void reload_keys();

  const ExecutorOptions& options_;
  const BaseModel& model_;
  const proto::Placement placement_;  // where this executor runs
  Scheduler& scheduler_;
  Statistics& statistics_;
  BufferBudget& buffers_;
  zmq::context_t& context_;
  const std::string replies_endpoint_;
  std::unique_ptr<Keys> keys_;  // [Admission]; none without keys
  std::unique_ptr<ZapHandler> zap_;
  zmq::socket_t router_;
  zmq::socket_t connection_events_;  // [Disconnected peers]: the ROUTER's monitor
  zmq::socket_t replies_in_;
  std::string endpoint_;
  std::atomic<bool> stopping_{false};
  std::mutex goodbye_mutex_;
  std::string goodbye_ = "it was stopped";  // guarded by goodbye_mutex_

  // Owned by the front door's thread.
  ClientRegistry registry_;
  int message_connection_ = -1;   // [Disconnected peers]: the descriptor the message being handled came on
  std::deque<int> in_handshake_;  // [Connections in handshake]: descriptors, oldest first
  Teardown teardown_;             // [Teardown off the front door]
  local::Listener listener_;
  struct PendingProof {
    std::string key;  // the ZeroMQ peer that said Hello
    proto::Hello hello;
    TransportKind kind;
    std::string public_key;
    Clock::time_point deadline;
  };
  std::map<std::string, PendingProof> pending_;  // by token
  struct Unproven {
    UniqueFd connection;
    Clock::time_point deadline;
  };
  std::vector<Unproven> unproven_;    // local connections that have not proved yet
  std::map<int, std::string> links_;  // proven local links: descriptor to ZeroMQ key
  LogBudget log_budget_{20};
  // [NCCL readiness] (transport/nccl/nccl_channel.cpp): how many nccl channels serve each GPU, by UUID.
  std::map<std::string, std::shared_ptr<std::atomic<int>>> gpu_clients_;
};

}  // namespace symbiosis
