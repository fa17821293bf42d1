#pragma once
// [Proven placement]
// A same-host transport hands memory between two processes, so the executor gives one only to a
// client that proves it runs on the executor's host, as the process its Hello names. The executor
// listens on a Unix socket in the Linux abstract namespace (reachable from this host only). To a
// Hello asking for a same-host transport it answers ProveHost (the socket's name and a random
// token); the client connects, sends Prove with the token, and the kernel tells the executor the
// connecting process (SO_PEERCRED): it must be the Hello's pid. Then, and only then, the Welcome
// follows, and the connection becomes the client's local link:
//  - executor to client, with Proven: the control segment and the writing end of the client's wake
//    pipe ([Wake sockets] in transport/call_ring.h), as file descriptors;
//  - client to executor: every set-up message (RegisterBuffer with its segment as a descriptor,
//    ShareSegments, NcclSetup); the executor takes none over ZeroMQ from such a client;
//  - its end is the client's end.
// No segment has a name (transport/shared_memory.h), so no other process can open one; a
// descriptor, CUDA IPC handle or NCCL id reaches the executor only from the proven process. A
// peer that claims the host but cannot reach the socket (it is elsewhere) gets no same-host
// transport; the client runtime then falls back to TCP when it asked for "auto".
// Messages are Envelopes, one per SOCK_SEQPACKET packet, with descriptors as SCM_RIGHTS.
#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "symbiosis.pb.h"

namespace symbiosis::local {

// The largest message either side sends (a ShareSegments of many segments fits).
constexpr size_t kMaxMessageBytes = size_t{1} << 16;
constexpr size_t kMaxDescriptors = 4;

struct Message {
  proto::Envelope envelope;
  std::vector<UniqueFd> descriptors;
};

// The executor's listening socket, under a fresh abstract name.
class Listener {
 public:
  Listener();
  const std::string& name() const { return name_; }
  int fd() const { return fd_.get(); }
  // A connection that is waiting (the listener polled readable), or none.
  UniqueFd accept();

 private:
  std::string name_;
  UniqueFd fd_;
};

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
};
PeerCredentials peer_credentials(int fd);

// Connects to the executor's socket; an error when there is none of that name on this host.
StatusOr<UniqueFd> connect(const std::string& name);
// Sends one message with `descriptors`; throws naming what failed.
void send(int fd, const proto::Envelope& envelope, const std::vector<int>& descriptors = {});
// The next message (blocks); nullopt when the peer has closed; an error for one that does not
// parse or carries more descriptors than kMaxDescriptors.
StatusOr<std::optional<Message>> receive(int fd);
// Whether a message (or the end) waits within `timeout_ms`.
bool readable(int fd, int timeout_ms);

// The client's end of the proof: connects to the socket ProveHost names, proves, and returns the
// link and the descriptors Proven carried. An error when the socket is not on this host, or the
// executor refused the proof (its reason).
struct Link {
  UniqueFd connection;
  std::vector<UniqueFd> descriptors;
};
StatusOr<Link> prove(const proto::ProveHost& challenge, int timeout_ms);

}  // namespace symbiosis::local
