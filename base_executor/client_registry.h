#pragma once
// The executor's record of its clients, by ZeroMQ routing id: who each is (id, tenant, transport),
// its channel, and whether it is still there. A client of this host with a control segment is
// watched by its process; any other (ZeroMQ control) by silence: idle past the limit without a
// Goodbye, it is taken for gone (the front door also forgets one whose connection closes:
// [Disconnected peers] in connections.cpp). A channel that broke (a corrupt ring) or failed (NCCL to a dead
// peer) is gone too. The clock and the process probe are injected, so liveness is tested like the
// Batcher, without waiting.
// Thread safety: none; the front door's thread owns it.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "transport/channel.h"
#include "transport/transport.h"

namespace symbiosis {

struct ClientRecord {
  uint64_t id = 0;
  std::string tenant;
  TransportKind transport = TransportKind::kTcp;
  int pid = 0;  // > 0: a process of this host, watched for its end
  std::shared_ptr<Channel> channel;
  std::chrono::steady_clock::time_point last_seen;
  int connection = -1;     // [Disconnected peers] (connections.cpp): the descriptor its latest message came on
  UniqueFd link;           // [Proven placement] (transport/local_socket.h): a same-host client's local link
  std::string public_key;  // [Admission] (base_executor/admission.h): its key; "" without keys
};

class ClientRegistry {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    // ZeroMQ clients idle this long without a Goodbye are forgotten (they died or left).
    std::chrono::nanoseconds idle_limit = std::chrono::minutes(10);
    std::function<Clock::time_point()> now = [] { return Clock::now(); };
    std::function<bool(int pid)> process_alive = default_process_alive;
  };
  static bool default_process_alive(int pid);

  ClientRegistry();
  explicit ClientRegistry(Options options);

  // Records a new client under routing id `key` and gives it the next id (the caller has
  // forgotten any earlier client of that key).
  ClientRecord& add(const std::string& key, std::string tenant, TransportKind transport, int pid,
                    std::shared_ptr<Channel> channel);
  // The id the next client will get.
  uint64_t next_id() const { return next_id_; }
  // The client of `key`, or nullptr.
  const ClientRecord* find(const std::string& key) const;
  // The same, for a message from it, which counts as a sign of life.
  ClientRecord* seen(const std::string& key);
  // Removes the client of `key`, returning its record (nullopt if none).
  std::optional<ClientRecord> remove(const std::string& key);
  // The keys of the clients that are gone now.
  std::vector<std::string> gone() const;
  size_t size() const { return clients_.size(); }
  // Every record, for shutdown.
  const std::map<std::string, ClientRecord>& all() const { return clients_; }

 private:
  Options options_;
  std::map<std::string, ClientRecord> clients_;
  uint64_t next_id_ = 1;
};

}  // namespace symbiosis
